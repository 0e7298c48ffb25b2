"""`tarsier caption` as a user runs it, in a fresh process, and what its output file holds afterwards.

Each run captions the clip files into a Parquet file; the verdict counts the rows the file holds against
the files given, so a run that dies, or drops rows, shows as rows lost, whatever it printed.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from monitor import RunMonitor

REPO = Path(__file__).resolve().parents[2]


def caption(model_dir: Path, inputs: list[Path], out: Path, flags: list[str], timeout_s: float,
            expected_rows: int | None = None, monitor: RunMonitor | None = None) -> dict:
    """Run `tarsier caption` over `inputs` (files, or a folder) with `flags`, watched by `monitor` if given; its exit
    code, the rows written and lost (against `expected_rows`, by default one per input), its last words."""
    command = [sys.executable, "-m", "tarsier_batch", "caption", *map(str, inputs), "--model", str(model_dir),
               "--out", str(out), *flags]
    expected_rows = len(inputs) if expected_rows is None else expected_rows
    started = time.perf_counter()
    with monitor or contextlib.nullcontext():
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                                  env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            code, output = None, f"timed out after {timeout_s:.0f} s: {expired.stderr or ''}"
    seconds = time.perf_counter() - started
    rows = errors = 0
    if out.exists():
        table = pq.read_table(out, columns=["error"])
        rows = table.num_rows
        errors = sum(value is not None for value in table.column("error").to_pylist())
    lines = [line for line in output.strip().splitlines() if line.strip()]
    # A refusal is the memory check's: a usage error (a flag this build does not know) is the bench's own fault,
    # and counts as rows lost, so that it cannot pass for the check at work.
    usage_error = code == 2 and any(line.startswith("Usage:") for line in lines)
    refused = code == 2 and rows == 0 and not usage_error
    # The command's own rate after loading the model, from its summary line.
    while_captioning = next((float(found.group(1)) for line in lines
                             if (found := re.search(r"throughput ([0-9.]+) items/s while captioning", line))), None)
    captioning_s = rows / while_captioning if while_captioning else None
    return {"flags": flags, "exit_code": code, "seconds": round(seconds, 2), "expected_rows": expected_rows,
            "rows": rows, "error_rows": errors, "rows_lost": 0 if refused else expected_rows - rows,
            "refused_at_start": refused, "usage_error": usage_error, "last_lines": lines[-6:],
            "items_per_s": round(rows / seconds, 4), "items_per_s_while_captioning": while_captioning,
            "captioning_s": round(captioning_s, 2) if captioning_s else None,
            **(monitor.figures(captioning_s) if monitor is not None else {})}


def help_names(*flags: str) -> dict:
    """Which of `flags` `tarsier caption --help`, run as the runs are, lists; and the CLI libraries' versions (a run
    on the device once failed with "No such option: --device", which no environment here reproduces)."""
    from importlib.metadata import PackageNotFoundError, version

    done = subprocess.run([sys.executable, "-m", "tarsier_batch", "caption", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    versions = {}
    for name in ("typer", "click", "rich"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    lines = done.stdout.splitlines()
    return {"listed": {flag: any(line.strip().startswith(flag + " ") for line in lines) for flag in flags},
            "usage": next((line for line in lines if line.startswith("Usage:")), None), "exit_code": done.returncode,
            "stderr_tail": done.stderr.strip().splitlines()[-3:], "versions": versions, "sys_path": sys.path[:6]}


def linked_copies(files: list[Path], folder: Path, count: int) -> list[Path]:
    """`count` distinct names for `files` taken in turn (hard links: no bytes copied), each its own item."""
    folder.mkdir(parents=True, exist_ok=True)
    links = []
    for index in range(count):
        link = folder / f"copy_{index:03d}{files[index % len(files)].suffix}"
        if not link.exists():
            os.link(files[index % len(files)], link)
        links.append(link)
    return links
