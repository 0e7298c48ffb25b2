"""The documentation cannot drift from the command line: its flags page is what the CLI says."""

from __future__ import annotations

import sys
from pathlib import Path

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
