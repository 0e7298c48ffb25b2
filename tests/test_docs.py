"""The documentation cannot drift from the tool: the flags page is what the CLI says, the README is the docs' home
page, and the marked shell blocks run as written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import flags_reference  # noqa: E402


def test_the_flags_page_is_what_the_cli_says() -> None:
    """Fails when a flag, its help or its default changed without `python tools/flags_reference.py`."""
    assert flags_reference.PAGE.read_text() == flags_reference.render()


def test_every_flag_of_every_command_is_on_the_page() -> None:
    import typer.main

    from tarsier_batch.cli import app

    page = flags_reference.PAGE.read_text()
    for path, command in flags_reference._commands(typer.main.get_command(app), ["tarsier"]):
        assert f"## `{' '.join(path)}`" in page
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                assert all(f"`{name}`" in page for name in param.opts), (path, param.opts)


def test_the_docs_figures_are_what_the_results_say() -> None:
    """Fails when a results file or a quoted figure changed without `python tools/figures.py`."""
    import figures

    for page in figures.PAGES:
        text = page.read_text()
        assert figures.REGION.search(text), f"{page} quotes no figure from bench/results"
        assert text == figures.render(text), f"{page}: run python tools/figures.py"


def test_a_figure_is_remade_from_its_results_file_and_a_missing_one_is_an_error() -> None:
    import figures

    quoted = ("speed <!-- figure b1-2026-11-27-uncached.json speedup {:.2f}x -->9.99x<!-- /figure --> and "
              "<!-- figure tarsier2-2026-11-27-uncached.json by_resolution/bench/prompt_tokens/2 {:,} -->?"
              "<!-- /figure -->")
    b1 = figures.result("b1-2026-11-27-uncached.json")
    tarsier2 = figures.result("tarsier2-2026-11-27-uncached.json")
    assert figures.render(quoted) == (
        f"speed <!-- figure b1-2026-11-27-uncached.json speedup {{:.2f}}x -->{b1['speedup']:.2f}x<!-- /figure --> and "
        f"<!-- figure tarsier2-2026-11-27-uncached.json by_resolution/bench/prompt_tokens/2 {{:,}} -->"
        f"{tarsier2['by_resolution']['bench']['prompt_tokens'][2]:,}<!-- /figure -->")
    with pytest.raises(KeyError, match="no 'speedups'"):
        figures.render("<!-- figure b1-2026-11-27-uncached.json speedups {} --><!-- /figure -->")
    with pytest.raises(KeyError, match="no table 'cpu'"):
        figures.render("<!-- figure table cpu --><!-- /figure -->")


def test_the_readme_is_made_from_the_docs_home_page() -> None:
    """Fails when README.md or docs/index.md was edited alone (`python tools/readme.py` remakes the README)."""
    import readme

    assert readme.README.read_text() == readme.render()


def runnable_blocks(page: Path) -> list[str]:
    """The shell blocks a page marks `<!-- runnable -->`: they must run as written."""
    return re.findall(r"<!-- runnable -->\n```sh\n(.*?)```", page.read_text(), re.S)


def runnable_files(page: Path) -> dict[str, str]:
    """The code blocks a page marks `<!-- runnable: NAME -->`: files the page tells the reader to save as NAME."""
    return dict(re.findall(r"<!-- runnable: ([\w.-]+) -->\n```\w*\n(.*?)```", page.read_text(), re.S))


TASK_PAGES = sorted(page for page in (REPO / "docs").glob("*.md") if page.name != "index.md" and runnable_blocks(page))


def run_page(page: Path, folder: Path) -> str:
    """Every marked block of the page in one shell, in order, in a folder holding a copy of sample_data and the
    page's files, with this environment's `tarsier` and `python` first on the PATH (as in the environment the
    install section creates)."""
    blocks = runnable_blocks(page)
    assert blocks
    shutil.copytree(REPO / "sample_data", folder / "sample_data")
    for name, text in runnable_files(page).items():
        (folder / name).write_text(text)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(blocks)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.docs
def test_the_readmes_runnable_shell_blocks_run_as_written(tmp_path: Path) -> None:
    """...and the quick start's output shown (its first block's, before "...") is the first lines they print."""
    printed = run_page(REPO / "README.md", tmp_path).splitlines()
    shown = re.search(r"<!-- output -->\n```text\n(.*?)\.\.\.\n```", (REPO / "README.md").read_text(), re.S)
    expected = shown.group(1).splitlines()
    assert printed[:len(expected)] == expected


@pytest.mark.docs
@pytest.mark.parametrize("page", TASK_PAGES, ids=lambda page: page.name)
def test_the_task_pages_runnable_blocks_run_as_written(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path)


def test_every_task_page_has_runnable_blocks() -> None:
    """A new user follows a task page's commands as written: each page about a task shows them runnable."""
    reference = {"index.md", "benchmarks.md", "changelog.md", "development.md"}
    pages = {page.name for page in (REPO / "docs").glob("*.md")} - reference
    assert pages == {page.name for page in TASK_PAGES}


def test_the_readme_gives_a_smoke_command_that_covers_each_layer_and_the_full_one() -> None:
    """A contributor's first look: README's Tests section has a quick command and the whole suite's, and the quick
    one selects tests of the engine's exactness for both families, the command line and a re-run."""
    section = re.search(r"^## Tests\n(.*?)^## ", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    commands = re.findall(r"^(\.venv/bin/python -m pytest -q[^#\n]*?)\s*(?:#|$)", section, re.M)
    assert commands == [".venv/bin/python -m pytest -q -m smoke", ".venv/bin/python -m pytest -q"]
    layers = ["tests/test_engine.py", "tests/test_tarsier2.py", "tests/test_cli.py", "tests/test_resume_cli.py"]
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-m", "smoke", *layers], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stdout[-2000:]
    files = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    assert files == set(layers)   # each file holds smoke tests
