"""The parameters of `tarsier caption`, generated from the settings' declarations (`settings.declaring`).

Each declared field becomes one typer option (or the INPUTS argument) with its flags, help,
metavar, bounds, choices and environment variable; `--help` lists them by group, in `GROUPS`
order. Nothing here names a setting: a new one appears on the command line by being declared.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Optional

import typer

from .errors import worded
from .settings import (
    GROUPS,
    OUT_FORMATS,
    SHARD_ROWS,
    CommandOptions,
    Declared,
    RaySettings,
    RunSettings,
    check_output_choice,
    declared,
    from_values,
    words,
)

__all__ = ["FLAGS", "OUT_FORMATS", "in_flags", "PATH_SETTINGS", "SHARD_ROWS", "CommandOptions", "caption_parameters",
           "check_output_choice", "from_values"]

# In this order within a group: the run's settings, then the command's own options, then Ray's.
SOURCES = (RunSettings, CommandOptions, RaySettings)


def caption_declarations() -> list[Declared]:
    """Every declared setting the command takes, in the order `--help` lists them."""
    given = [found for cls in SOURCES for found in declared(cls) if found.flags or found.setting.argument]
    return sorted(given, key=lambda found: GROUPS.index(found.setting.group))


def caption_parameters(**extra: dict[str, Any]) -> Iterator[inspect.Parameter]:
    """A keyword parameter per declared setting, annotated with its typer option; `extra` adds typer keywords to
    the parameter of that key (a callback)."""
    for found in caption_declarations():
        info = _typer_info(found, extra.get(found.key, {}))
        yield inspect.Parameter(found.key, inspect.Parameter.KEYWORD_ONLY, default=found.flag_default,
                                annotation=Annotated[_value_type(found), info])


def _typer_info(found: Declared, extra: dict[str, Any]) -> Any:
    declaration = found.setting
    keywords: dict[str, Any] = {"metavar": declaration.metavar, "show_default": declaration.show_default, **extra}
    if declaration.argument:   # described in the command's docstring: help would show a Python type
        return typer.Argument(hidden=True, **keywords)
    if declaration.env:
        keywords.update(envvar=declaration.env, show_envvar=True)
    if declaration.choices:
        keywords["case_sensitive"] = False
    return typer.Option(*found.flags, help=declaration.help, min=declaration.at_least,
                        **keywords)


def _value_type(found: Declared) -> Any:
    """The type the flag's value is parsed to: its text where the setting parses it or picks a choice."""
    declaration = found.setting
    if declaration.multiple or declaration.argument:
        return Optional[list[str]]
    if declaration.choices:
        choice = Literal[declaration.choices]  # type: ignore[valid-type]
        return choice if found.flag_default is not None else Optional[choice]
    if declaration.parse is not None:
        return str if found.flag_default is not None else Optional[str]
    hint = typing.get_type_hints(found.owner)[found.name]
    return Optional[hint] if found.flag_default is None else hint


# The settings' fields as the command line names them, for `SettingsError.worded`.
FLAGS = words(*SOURCES)


def in_flags(said: object, flags: dict[str, str] = FLAGS) -> str:
    """A library's note or error (the library names settings by field) as the command line says it: by flag."""
    return worded(said, flags)
# Keys whose relative paths in a --config file are relative to that file's folder.
PATH_SETTINGS = frozenset(found.key for found in caption_declarations() if found.setting.path)
