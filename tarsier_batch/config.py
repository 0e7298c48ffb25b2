"""`--config FILE.toml`: default values for a command's flags, read before anything else.

    # tarsier.toml
    model = "omni-research/Tarsier2-Recap-7b"
    inputs = ["/data/incoming"]
    out = "captions.parquet"      # relative paths are relative to this file's folder
    batch-size = 32

Keys are flag names (`batch-size` or `batch_size`); a `[caption]` table may hold them instead.
Flags given on the command line win, then environment variables (TARSIER_MODEL, ...), then
this file, then the built-in defaults: the usual order of pip, git and most Unix tools.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

if sys.version_info >= (3, 11):
    import tomllib
else:   # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from .storage import is_url


class ConfigError(Exception):
    """The config file cannot be read or names a flag the command does not have."""


def config_defaults(path: Path, command: click.Command, section: str,
                    path_params: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The defaults `path` sets for `command`'s parameters, keyed by parameter name.

    Values of `path_params` given as relative paths are resolved against the file's folder,
    so a config works from cron whatever the working directory.
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read --config {path}: {getattr(error, 'strerror', None) or error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path} is not valid TOML: {error}") from error
    if isinstance(data.get(section), dict):
        data = {**{k: v for k, v in data.items() if k != section}, **data[section]}
    params = {param.name: param for param in command.params if param.name and param.name != "config"}
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        param = params.get(name)
        if param is None or isinstance(value, dict):
            known = ", ".join(sorted(name.replace("_", "-") for name in params))
            raise ConfigError(f"--config {path}: unknown setting {key!r}; known: {known}")
        defaults[name] = _resolved(value, param, path.parent.resolve(), name in path_params)
    return defaults


def _resolved(value: Any, param: click.Parameter, base: Path, is_path: bool) -> Any:
    if is_path:
        def resolve(text: Any) -> Any:
            # '-' means stdin/stdout, never a file in the config's folder; a URL is no path at all.
            if not isinstance(text, str) or text == "-" or is_url(text):
                return text
            return str(base / Path(text).expanduser())
        return [resolve(item) for item in value] if isinstance(value, list) else resolve(value)
    if isinstance(value, list) and not param.multiple and param.nargs == 1:
        return ",".join(str(item) for item in value)   # keep-columns = ["a", "b"]
    return value
