"""The flags reference page (docs/reference/flags.md), made from the command line itself.

    python tools/flags_reference.py           # rewrite docs/reference/flags.md
    python tools/flags_reference.py --check   # exit 1 if the page differs from what the CLI says

Every command and option of `tarsier` with its help text, default and environment variable, as click
knows them (the options of `tarsier caption` are made from the settings' declarations, tarsier_batch/settings/):
the page cannot drift from the flags, and tests/test_docs.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import typer.main

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tarsier_batch.cli import app  # noqa: E402

PAGE = REPO / "docs" / "reference" / "flags.md"


def render() -> str:
    root = typer.main.get_command(app)
    lines = ["# Flags", "",
             "Every command and flag of `tarsier`, generated from the command line itself "
             "(`python tools/flags_reference.py`). `tarsier COMMAND --help` says the same.", ""]
    for path, command in _commands(root, ["tarsier"]):
        lines += [f"## `{' '.join(path)}`", "", _first_paragraph(command.help or ""), ""]
        arguments = [param for param in command.params if param.param_type_name == "argument"]
        options = [param for param in command.params if param.param_type_name == "option" and not param.hidden]
        if arguments:
            lines += ["Arguments: " + ", ".join(
                f"`{argument.name.upper()}`" + (f": {argument.help}" if getattr(argument, "help", None) else "")
                for argument in arguments), ""]
        if options:
            lines += ["| flag | default | what it does |", "|---|---|---|"]
            lines += [_row(option) for option in options]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _commands(command, path: list[str]):
    """(path, command) for every leaf command, in the order the CLI lists them (typer's own click types: duck-typed)."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, command


def _row(option) -> str:
    names = ", ".join(f"`{name}`" for name in [*option.opts, *option.secondary_opts])
    if option.metavar and not option.is_flag:
        names += f" `{option.metavar}`"
    default = "" if option.default in (None, False, ()) or not option.show_default else f"`{option.default}`"
    if option.envvar:
        default = (default + "; " if default else "") + f"env `{option.envvar}`"
    text = " ".join((option.help or "").split()).replace("|", "\\|")
    return f"| {names} | {default} | {text} |"


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            sys.exit(f"{PAGE.relative_to(REPO)} is stale: run python tools/flags_reference.py")
        return
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
