"""What a `tarsier caption` process does over time, watched from outside it: when its rows reach the disk, and how
busy the GPU is meanwhile.

Rows: the run saves finished rows in part files beside `--out` (`.NAME.tarsier/part-*.parquet`, at most a second
after they finish) and writes `--out` at its end; the watcher notes when each part appears and how many rows it
holds, and when `--out` appears (the first rows' time where they went to `--out` before a look saw their part).

GPU busy: NVML's utilisation (the share of its last sample period, 1/6 s to 1 s, in which a kernel ran), through
`torch.cuda.utilization`, which needs NVML's Python bindings (`nvidia-ml-py`, carried as a wheel); absent on the CPU
or without them.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

INTERVAL_S = 0.1


def busy_reader(device: torch.device):
    """A function giving the device's busy percentage now, or None where it cannot be read (and why)."""
    if device.type != "cuda":
        return None, "no CUDA device"
    try:
        torch.cuda.utilization(device)
    except Exception as error:   # no NVML bindings, or NVML refused: the figure is absent, the run goes on
        return None, f"{type(error).__name__}: {error}"
    return (lambda: torch.cuda.utilization(device)), "NVML (torch.cuda.utilization)"


class RunMonitor:
    """Watches `out`'s part files and the device's busy share in a thread, from `__enter__` to `__exit__`."""

    def __init__(self, out: Path, device: torch.device):
        self.out = out
        self.work_dir = out.parent / f".{out.name}.tarsier"
        self.read_busy, self.busy_source = busy_reader(device)
        self.parts: dict[str, tuple[float, int]] = {}   # part name -> (seconds since start, rows)
        self.out_at: float | None = None                # when `out` appeared
        self.busy: list[tuple[float, float]] = []       # (seconds since start, percent)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> RunMonitor:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._look()

    def _watch(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._look()

    def _look(self) -> None:
        now = time.perf_counter() - self.started
        if self.read_busy is not None:
            self.busy.append((now, float(self.read_busy())))
        for part in self.work_dir.glob("part-*.parquet") if self.work_dir.exists() else ():
            if part.name not in self.parts:
                try:
                    self.parts[part.name] = (now, pq.read_metadata(part).num_rows)
                except (OSError, ValueError):   # removed by the run's end between the listing and the read
                    continue
        if self.out_at is None and self.out.exists():
            self.out_at = now

    def figures(self, captioning_s: float | None) -> dict:
        """When the first row was saved, when each part was, and the GPU's busy share over the whole run and over
        its last `captioning_s` (the command's own count of its time after loading the model)."""
        seen = sorted(self.parts.values())
        first = min([at for at in (seen[0][0] if seen else None, self.out_at) if at is not None], default=None)
        result: dict = {"parts_seen": len(seen), "gpu_busy_source": self.busy_source,
                        "time_to_first_row_s": round(first, 2) if first is not None else None,
                        "rows_saved_at_s": [[round(at, 2), count] for at, count in seen]}
        if self.busy:
            end = self.busy[-1][0]
            result["gpu_busy"] = round(statistics.fmean(value for _, value in self.busy) / 100, 4)
            steady = [value for at, value in self.busy if captioning_s and at >= end - captioning_s]
            result["gpu_busy_while_captioning"] = round(statistics.fmean(steady) / 100, 4) if steady else None
            result["gpu_busy_samples"] = len(self.busy)
        return result
