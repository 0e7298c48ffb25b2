"""Deterministic random-weight checkpoints of every family, in the real on-disk formats.

No model hub is needed: tokenizers are trained here on a small built-in text, weights are drawn
from a seeded generator, and the files are those of the published checkpoints. Captions from
such a model are noise; they exist so the whole pipeline can run and be tested offline.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..catalog import family_named


def sizes(family: str) -> list[str]:
    return list(_builder(family).SIZES)


def make_tiny_model(out_dir: Path, size: str = "tiny", seed: int = 0, family: str = "tarsier") -> Path:
    """Write a random-weight checkpoint of `family` and `size` to `out_dir`; returns it."""
    builder = _builder(family)
    if size not in builder.SIZES:
        raise ValueError(f"unknown size {size!r} for {family}; choose one of {', '.join(builder.SIZES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    builder.build(out_dir, size, seed)
    return out_dir


def ensure_tiny_model(target: Path, family: str = "tarsier", size: str = "tiny", seed: int = 0) -> Path:
    """The tiny checkpoint at `target`, built once (into a temporary folder, then moved in place)."""
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    # mkdtemp makes the folder private (0700); a cache shared by a group must stay readable to it.
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        make_tiny_model(staging, size, seed, family)
        for written in staging.iterdir():  # some writers (safetensors) create private files
            written.chmod(0o666 & ~umask)
        os.replace(staging, target)
    except OSError:
        if not (target / "model.safetensors").exists():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _builder(family: str):  # noqa: ANN202 - a module
    return family_named(family).code("tiny_builder")
