"""What a benchmark ran on: the commit, the machine and the versions, for the top of its JSON.

    from measured_on import measured_on
    print(json.dumps({**measured_on(), **figures}))

A figure is only comparable with another measured on the same code and machine, so every bench in this folder
records them beside its figures (tools/figures.py shows them next to the tables it makes).
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "tarsier-batch")


def measured_on() -> dict:
    """The checkout's commit and whether it had uncommitted changes, the machine, the libraries' versions."""
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": _uncommitted_changes(),
            "machine": machine(), "versions": versions()}


def machine() -> dict:
    """The CPU's model name, the cores the machine has and the cores this process may run on."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "system": platform.system()}


def versions() -> dict:
    """Python's and each of PACKAGES' installed version (None where one is not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _cpu_model() -> str:
    # platform.processor() is often empty on Linux; /proc/cpuinfo names the model there.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _uncommitted_changes() -> bool | None:
    """Whether tracked files differ from the commit (untracked files, such as new results, do not count)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _git(*args: str) -> str | None:
    """git's output in this checkout, or None outside a git checkout or without git."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()
