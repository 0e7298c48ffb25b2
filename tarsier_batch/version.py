"""The package version and how it was installed, in a module of its own: the package's __init__ and the modules
it exports both need it, and importing it from the package would make them import each other."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def install_extra_command(extra: str) -> str:
    """The command that adds an optional extra to this installation (see `extra_command_for`)."""
    import json
    from importlib import metadata  # here, not at import: every `tarsier` start imports this module

    # Every copy of the metadata found: run from the checkout, its build's egg-info comes before the installed one.
    recorded = (dist.read_text("direct_url.json") for dist in metadata.distributions(name="tarsier-batch"))
    try:
        direct_url = json.loads(next((text for text in recorded if text), "null"))
    except ValueError:
        direct_url = None
    return extra_command_for(direct_url, extra)


def extra_command_for(direct_url: Any, extra: str) -> str:
    """The command that adds `extra` to an installation pip recorded as `direct_url` (PEP 610's
    direct_url.json, None for one from an index): from the index as a rule; from the folder itself where the
    package was installed from one (`pip install -e .` in a clone), or from the same repository where it came
    from version control, which an index may not have."""
    import shlex
    from urllib.parse import unquote, urlparse

    index = f"pip install 'tarsier-batch[{extra}]'"
    if not isinstance(direct_url, dict) or not isinstance(direct_url.get("url"), str):
        return index
    url = direct_url["url"]
    vcs = direct_url.get("vcs_info")
    if isinstance(vcs, dict) and isinstance(vcs.get("vcs"), str):
        requirement = f"tarsier-batch[{extra}] @ {vcs['vcs']}+{url}"
        return f"pip install {shlex.quote(requirement)}"
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return index
    dir_info = direct_url.get("dir_info")
    editable = "-e " if isinstance(dir_info, dict) and dir_info.get("editable") else ""
    folder = f"{unquote(parsed.path)}[{extra}]"
    return f"pip install {editable}{shlex.quote(folder)}"
