"""The package version and how it was installed, in a module of its own: the package's __init__ and the modules
it exports both need it, and importing it from the package would make them import each other."""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any
from urllib.parse import unquote, urlparse

__version__ = "0.1.0"


def install_extra_command(extra: str) -> str:
    """The command that adds an optional extra to this installation (see `extra_command_for`)."""
    # Every copy of the metadata found: run from the checkout, its build's egg-info comes before the installed one.
    recorded = (dist.read_text("direct_url.json") for dist in metadata.distributions(name="tarsier-batch"))
    try:
        direct_url = json.loads(next((text for text in recorded if text), "null"))
    except ValueError:
        direct_url = None
    return extra_command_for(direct_url, extra)


def extra_command_for(direct_url: Any, extra: str) -> str:
    """The command that adds `extra` to an installation pip recorded as `direct_url` (PEP 610's
    direct_url.json, None for one from an index): from the index as a rule, but from the folder itself where
    the package was installed from one (`pip install -e .` in a clone), which an index may not even have."""
    url = urlparse(direct_url.get("url", "")) if isinstance(direct_url, dict) else None
    if url is None or url.scheme != "file":
        return f"pip install 'tarsier-batch[{extra}]'"
    editable = "-e " if (direct_url.get("dir_info") or {}).get("editable") else ""
    return f"pip install {editable}'{unquote(url.path)}[{extra}]'"
