"""How many decoding workers a host runs when the caller does not say."""

from __future__ import annotations

import os
from pathlib import Path

# Past a few workers decoding keeps ahead of a model on the CPU, which shares the cores with them; a GPU shares
# none, and a 1080p file costs a core seconds per clip (bench/bench_decode.py), so there every core decodes.
MAX_DEFAULT_WORKERS = 4
MAX_DEFAULT_WORKERS_ACCELERATED = 32
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def default_workers(accelerated: bool = False) -> int:
    """How many decoding workers to run when the caller does not say: one per core but one.

    One core stays with the parent, which receives the decoded items and drives the model; the others decode
    (each worker runs torch on one thread). With the model on the CPU (`accelerated` False) the workers take
    cores from it, so they stop at a few: past that decoding keeps ahead, while each more worker costs memory
    (about 60 MB of its own at rest, most of its 0.35 GB resident being shared with the fork server, plus what it
    decodes, up to its memory limit). With the model on an accelerator, decoding is what the device waits for,
    so every core but one decodes, up to a bound for very large hosts. The cores counted are those this process
    may run on (its affinity mask, and a cgroup v2 CPU quota, as in a container started with --cpus), not all of
    the machine's.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    most = MAX_DEFAULT_WORKERS_ACCELERATED if accelerated else MAX_DEFAULT_WORKERS
    return max(1, min(most, cores - 1))


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period this cgroup may use (cgroup v2 `cpu.max`), or None without a quota."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None
