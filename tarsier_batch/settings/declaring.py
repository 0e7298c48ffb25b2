"""How a setting is declared: once, on its dataclass field, with everything the tool derives from it.

    frames: int | None = setting(None, group="rows", metavar="N", at_least=1, fingerprint=True,
                                 help="Frames sampled uniformly from each video or GIF ...")

A field's `Setting` says how a person gives it (flags, help, metavar, environment variable, the
key of a `--config` file) and how it is recorded (in the resume fingerprint, in the provenance).
The command line's options, the flags page, the config keys, the words of a `SettingsError` and
the fingerprint are all read from these declarations; none of them lists a setting of its own.
A library error names a field (`{top_p}`); `worded` turns the names into the caller's words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import Worded, worded

# The order `tarsier caption --help` and the flags page list the groups in.
GROUPS = ("output", "inputs", "run", "model", "prompt", "rows", "engine", "sampling", "media", "resume", "display",
          "ray")


# A flag's default where it is the field's own.
FIELD_DEFAULT: Any = object()


class SettingsError(ValueError):
    """A setting, or a combination of settings, that cannot work.

    The message names settings by their field names (`top_p`); `worded` names them in a caller's
    own words (`--top-p`). Its template holds each name as `{field}` (a `Worded` template).
    """

    def __init__(self, template: str):
        self.template = template
        super().__init__(Worded(template))

    def worded(self, words: Mapping[str, str]) -> str:
        """The message with each setting named as `words` says (a field it lacks keeps its name)."""
        return worded(self, words)

    @classmethod
    def of(cls, error: Exception) -> SettingsError:
        """A parser's or a check's error as a SettingsError, naming settings as `error` does."""
        message = error.args[0] if len(error.args) == 1 else None
        return cls(message if isinstance(message, Worded) else shown(error))


def shown(value: Any) -> str:
    """`value` as it goes into a message template (its braces are not placeholders)."""
    return str(value).replace("{", "{{").replace("}", "}}")


@dataclass(frozen=True)
class Setting:
    """One setting's declaration: how it is given on the command line and in a config file, and how it is recorded.

    `flags` default to the field's name with dashes (`--max-new-tokens`); a bool without flags is
    off unless given. `key` is the command's parameter and the `--config` key (default: the field's
    name). A setting with `flags=None` has no flag of its own: it is given in code, or made by the
    command from other flags (`worded` then says how the command names it).
    """

    group: str
    help: str = ""
    flags: tuple[str, ...] | None = ()
    metavar: str | None = None
    env: str | None = None               # an environment variable that gives its value
    key: str | None = None
    worded: str | None = None            # how messages name it, when not by its flags
    choices: tuple[str, ...] = ()
    at_least: float | None = None        # a bound checked as the flag is parsed (the settings check their own rules)
    show_default: bool = True            # False: the help text says what the default does
    flag_default: Any = FIELD_DEFAULT   # the flag's default, where it is not the field's
    parse: Callable[[str], Any] | None = None   # the flag's text -> the field's value
    path: bool = False                   # a path: relative in a --config file means from that file's folder
    argument: bool = False               # a positional argument of the command, not an option
    multiple: bool = False               # the flag may be repeated (a list)
    # Whether it decides a caption (stored with the output; a run continuing it must match): under its field's
    # name, or under `recorded_as`, the value `record(settings)` gives (default: the field's value).
    fingerprint: bool = False
    recorded_as: str | None = None
    record: Callable[[Any], Any] | None = None
    # The key the provenance records it under (None: not recorded), as loading settled it, else as given (or as
    # `record` gives it).
    provenance: str | None = None

    def __post_init__(self) -> None:
        assert self.group in GROUPS, self.group


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            **declaration: Any) -> Any:
    """A dataclass field carrying its `Setting`."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"setting": Setting(**declaration)})


@dataclass(frozen=True)
class Declared:
    """A declared field, as the command and the records see it."""

    name: str                 # the field's name
    owner: type               # the settings class it belongs to
    setting: Setting
    default: Any

    @property
    def key(self) -> str:
        return self.setting.key or self.name

    @property
    def flags(self) -> tuple[str, ...]:
        if self.setting.flags is None or self.setting.argument:
            return ()
        return self.setting.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def flag_default(self) -> Any:
        return self.default if self.setting.flag_default is FIELD_DEFAULT else self.setting.flag_default

    @property
    def words(self) -> str:
        """How the command line names it in messages: its flag, the one that turns it off for a default-on bool."""
        if self.setting.worded is not None:
            return self.setting.worded
        flags = self.flags
        if not flags:
            return self.name
        on, _, off = flags[0].partition("/")
        return off if off and self.default is True else on


def nested(cls: type) -> Iterator[tuple[str, type]]:
    """The fields of `cls` that hold settings of their own (`RunSettings.caption`), with their class."""
    for field in dataclasses.fields(cls):
        factory = field.default_factory
        if "setting" not in field.metadata and isinstance(factory, type) and dataclasses.is_dataclass(factory) \
                and any("setting" in inner.metadata for inner in dataclasses.fields(factory)):
            yield field.name, factory


def declared(cls: type) -> Iterator[Declared]:
    """Every declared field of `cls` and of the settings it holds, in field order."""
    nested_classes = dict(nested(cls))
    for field in dataclasses.fields(cls):
        if field.name in nested_classes:
            yield from declared(nested_classes[field.name])
        elif "setting" in field.metadata:
            default = field.default if field.default is not dataclasses.MISSING else (
                field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
            yield Declared(field.name, cls, field.metadata["setting"], default)


def words(*classes: type) -> dict[str, str]:
    """Each declared field's name -> how the command line names it, for `SettingsError.worded`."""
    return {found.name: found.words for cls in classes for found in declared(cls) if not found.setting.argument}


def from_values(cls: type, values: Mapping[str, Any]) -> Any:
    """`cls` made from values by key (the command's parameters), parsing flag texts; missing keys keep defaults."""
    inner = dict(nested(cls))
    given: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        declaration = field.metadata.get("setting")
        if field.name in inner:
            given[field.name] = from_values(inner[field.name], values)
        elif declaration is not None and (declaration.key or field.name) in values:
            given[field.name] = _parsed(declaration, values[declaration.key or field.name])
    return cls(**given)


def _parsed(declaration: Setting, value: Any) -> Any:
    if declaration.parse is None or not isinstance(value, str):
        return value
    try:
        return declaration.parse(value)
    except SettingsError:
        raise
    except ValueError as error:   # a parser's own error names the setting in its message
        raise SettingsError.of(error) from None


def fingerprint(settings: Any) -> dict[str, Any]:
    """The declared fields of `settings` (and of the settings it holds) that decide a caption, as recorded, in
    field order."""
    inner = dict(nested(type(settings)))
    recorded: dict[str, Any] = {}
    for field in dataclasses.fields(settings):
        declaration = field.metadata.get("setting")
        if field.name in inner:
            recorded.update(fingerprint(getattr(settings, field.name)))
        elif declaration is not None and declaration.fingerprint:
            record = declaration.record
            recorded[declaration.recorded_as or field.name] = \
                record(settings) if record is not None else getattr(settings, field.name)
    return recorded


def provenance(settings: Any, settled: Mapping[str, Any]) -> dict[str, Any]:
    """The declared fields of `settings` (and of the settings it holds) that the provenance records, under their
    provenance keys: as loading settled them (`settled`, by field name), else as given, in field order."""
    inner = dict(nested(type(settings)))
    recorded: dict[str, Any] = {}
    for field in dataclasses.fields(settings):
        declaration = field.metadata.get("setting")
        if field.name in inner:
            recorded.update(provenance(getattr(settings, field.name), settled))
        elif declaration is not None and declaration.provenance is not None:
            record = declaration.record
            recorded[declaration.provenance] = settled[field.name] if field.name in settled \
                else record(settings) if record is not None else getattr(settings, field.name)
    return recorded
