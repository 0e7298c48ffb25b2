"""The package's shape: folders in the order a file goes through the tool, imports that run one way.

Read from the source (every import: at the top, inside functions and under TYPE_CHECKING), so that a
new import against the grain fails here, not as a circular-import error at some later start.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

PACKAGE = Path(__file__).resolve().parents[1] / "tarsier_batch"

# Lowest first. A module imports only from its own unit (a top-level module, or a folder) and from units
# of lower ranks; units of one rank never import each other.
LAYERS: list[set[str]] = [
    {"version"},                                # the version, and how to install an extra into this installation
    {"errors", "storage", "demo"},              # shared by all: item errors and safe text, URLs, the demo's files
    {"media"},                                  # what a media file holds: types, frames as the official code samples
    {"inputs"},                                           # where items come from
    {"families"},                                         # what a model family is (processor, modules, registry)
    {"settings"},                                         # every setting of a run, checked once
    {"model"},                                            # what to load and whether it fits
    {"engine", "workers", "outputs"},                     # batched generation; media decoded in workers; rows saved
    {"progress"},                                         # a run's statistics and displays
    {"api"},                                              # Captioner: the model loaded once, fed by the workers
    {"run"},                                              # CaptionRun: one run over an output
    {"runners", "review", "config", "cli_options"},       # Ray; reports and inspection; the CLI's config and options
    {""},                                                 # the public names (the package's __init__)
    {"cli_run"},                                          # around a command's run: reports, exit codes, signals
    {"cli_review"},                                       # the commands that read results: report, peek
    {"cli"},                                              # the command line: a client of the public names
    {"__main__"},                                         # python -m tarsier_batch
]


def _modules() -> dict[str, Path]:
    """Every module by dotted name below the package ('' is the package itself)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of this package that `node`, in module `name`, imports."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
        return [target.removeprefix("tarsier_batch").lstrip(".") for target in targets
                if target == "tarsier_batch" or target.startswith("tarsier_batch.")]
    if node.level:
        base = name.split(".") if name else []
        if MODULES[name].name != "__init__.py":
            base = base[:-1]
        base = base[:len(base) - node.level + 1]
        module = ".".join([*base, *([node.module] if node.module else [])])
    elif node.module == "tarsier_batch" or (node.module or "").startswith("tarsier_batch."):
        module = node.module.removeprefix("tarsier_batch").lstrip(".")
    else:
        return []
    # `from package import submodule` imports the submodule; `from module import name` the module.
    return [f"{module}.{alias.name}".lstrip(".") if f"{module}.{alias.name}".lstrip(".") in MODULES else module
            for alias in node.names]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(name, node):
                    while target not in MODULES:   # a name inside a module: the module
                        target = target.rpartition(".")[0]
                    if target != name:
                        edges.add(target)
    return graph


def _unit(module: str) -> str:
    return module.split(".")[0]


def _rank(module: str) -> int:
    return next(rank for rank, units in enumerate(LAYERS) if _unit(module) in units)


def test_the_top_level_holds_at_most_twelve_modules_and_every_unit_has_a_layer() -> None:
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    units = {_unit(module) for module in MODULES}
    assert units == set().union(*LAYERS), units ^ set().union(*LAYERS)


def test_imports_run_from_higher_layers_to_lower_ones_only() -> None:
    against = [f"{module} imports {target}" for module, targets in _graph().items() for target in sorted(targets)
               if _unit(module) != _unit(target) and _rank(module) <= _rank(target)]
    assert not against, "\n".join(against)


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, circles


def test_the_command_line_imports_no_private_name() -> None:
    """cli.py takes the public names from `tarsier_batch` itself and what only a command needs (its displays,
    the settings' flags) from the modules; never a module's private (underscored) name, which may change
    without notice."""
    import tarsier_batch

    tree = ast.parse((PACKAGE / "cli.py").read_text())
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            names = [alias.name for alias in node.names]
            wrong += [name for name in names if name.startswith("_") and name != "__version__"]
            if node.module is None:
                wrong += [name for name in names if name not in tarsier_batch.__all__]
        elif isinstance(node, ast.Import):
            wrong += [alias.name for alias in node.names if alias.name.startswith("tarsier_batch")]
    assert not wrong, wrong


def test_the_public_names_are_listed_alike_everywhere_and_all_import() -> None:
    """`__all__`, the lazy map and the TYPE_CHECKING imports (what type checkers read) name the same
    things from the same modules, and each name resolves."""
    import tarsier_batch

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom)
                checked.update({alias.name: statement.module or "" for alias in statement.names})
    exports = tarsier_batch._EXPORTS
    assert checked == exports
    assert sorted(tarsier_batch.__all__) == sorted(["__version__", *exports])
    for name in tarsier_batch.__all__:
        assert getattr(tarsier_batch, name) is not None, name


@pytest.mark.parametrize("module", ["tarsier_batch.families", "tarsier_batch.families.catalog",
                                    "tarsier_batch.inputs.sources", "tarsier_batch.model.checkpoints",
                                    "tarsier_batch.settings"])
def test_modules_the_command_line_needs_at_start_import_nothing_heavy(module: str) -> None:
    """The folders' own __init__ files stay light: checking a flag must not import torch through them."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_every_public_name_is_on_the_python_api_page() -> None:
    import tarsier_batch

    page = (PACKAGE.parent / "docs" / "python-api.md").read_text()
    missing = [name for name in tarsier_batch.__all__ if name != "__version__" and f"`{name}" not in page]
    assert not missing, missing


# Where a `--flag` may be written: the settings' declarations and the command line (its options, its
# config file). Everywhere else the library names a setting by its field (`Worded`), and the command
# line words it as a flag, so that a Python caller reads field names and a row names no flag.
FLAG_WRITERS = {"settings", "cli", "cli_options", "cli_run", "cli_review", "config",
                # runs `tarsier caption` as a person would: a command line is flags by nature
                "demo.evaluate"}
# Flags of other programs that a message tells a person to run.
FOREIGN_FLAGS = {"--local-dir"}   # `hf download REPO --local-dir DIR`
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _flags_written(path: Path) -> list[tuple[int, str]]:
    """(line, flag) of each flag in the string literals of `path`, docstrings aside."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    return [(node.lineno, flag) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            for flag in FLAG.findall(node.value) if flag not in FOREIGN_FLAGS]


def test_only_the_settings_declarations_and_the_command_line_write_flags() -> None:
    allowed = FLAG_WRITERS
    written = [f"{path.relative_to(PACKAGE.parent)}:{line}: {flag}" for module, path in sorted(MODULES.items())
               if module not in allowed and _unit(module) not in allowed for line, flag in _flags_written(path)]
    assert not written, "\n".join(written)


def test_the_flag_check_finds_a_flag_in_code_and_none_in_a_docstring(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text('"""Given as --frames."""\n\n\ndef f() -> str:\n    """With --top-p."""\n'
                      '    return f"raise --kv-cache-gb or pass --local-dir; models--org--name"\n')
    assert _flags_written(module) == [(6, "--kv-cache-gb")]
