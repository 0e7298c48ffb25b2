"""How much of a run a `kill -9` costs, at the flush defaults against the old ones, side by side.

    python bench/bench_kill9.py [--files 144] [--size small] [--new-tokens 48] [--kill-at 0.45]

A random-weight checkpoint (`--size small`: real frame geometry, so each item costs what it costs
with a real vision tower; `tiny`: the unit-test one) captions `--files` small files (sample_data's stills, GIFs
and clips, copied under distinct names). For each flush setting, in one run: a full run's wall
time T; then a run killed with SIGKILL at `--kill-at` x T, the same again, and a last run that
finishes. The figure is the last run's time / T (1.0: everything finished before the kills was
redone; lower is better), with the output checked: every file once, the same captions as the full
run. Also the full run's time at each setting (what saving more often costs). Prints JSON.

The timer only decides when to kill; nothing waits on it for correctness.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from measured_on import measured_on

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"defaults (1 s)": [], "old defaults (64 rows, 30 s)": ["--flush-rows", "64", "--flush-seconds", "30"]}


def make_inputs(folder: Path, count: int) -> None:
    sources = sorted(path for path in (REPO / "sample_data").iterdir() if path.suffix.lower() != ".txt")
    folder.mkdir(parents=True)
    for number in range(count):
        source = sources[number % len(sources)]
        shutil.copy(source, folder / f"{number:04d}-{source.name}")


def command(model: Path, inputs: Path, out: Path, new_tokens: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "tarsier_batch.cli", "caption", str(inputs), "--model", str(model), "-o", str(out),
            "--max-new-tokens", str(new_tokens), "--device", "cpu", "--quiet", *extra]


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True)
    return time.perf_counter() - start


def killed_at(args: list[str], seconds: float) -> None:
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(seconds)
    os.killpg(process.pid, signal.SIGKILL)   # the run and its decoding workers, as the OOM killer or a node loss would
    process.wait()


def rows(out: Path) -> list[tuple[str, str, str | None]]:
    return sorted((row["path"], row["caption"], row["error"]) for row in pq.read_table(out).to_pylist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=144)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--kill-at", type=float, default=0.45)
    args = parser.parse_args()
    from tarsier_batch.families.tiny import make_tiny_model

    # Bytecode compiled before any timing: otherwise the first timed run pays for it, and the runs after it do not.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "tarsier_batch")], check=True)
    work = Path(tempfile.mkdtemp(prefix="bench-kill9-"))
    model = make_tiny_model(work / "model", args.size, seed=0)
    inputs = work / "inputs"
    make_inputs(inputs, args.files)
    report: dict[str, dict[str, float | bool]] = {}
    for name, extra in SETTINGS.items():
        full_out = work / f"full-{len(report)}.parquet"
        full = timed(command(model, inputs, full_out, args.new_tokens, extra))
        out = work / f"killed-{len(report)}.parquet"
        for _ in range(2):
            killed_at(command(model, inputs, out, args.new_tokens, extra), args.kill_at * full)
        last = timed(command(model, inputs, out, args.new_tokens, extra))
        finished = rows(out)
        report[name] = {"full_run_s": round(full, 2), "last_run_s": round(last, 2),
                        "last_run_over_full": round(last / full, 3),
                        "every_file_once": len(finished) == args.files == len({row[0] for row in finished}),
                        "same_captions_as_full_run":
                            [row[1:] for row in finished] == [row[1:] for row in rows(full_out)]}
    first, second = report.values()
    print(json.dumps({**measured_on(), "files": args.files, "size": args.size, "new_tokens": args.new_tokens,
                      "kill_at": args.kill_at,
                      "runs": report,
                      "full_run_ratio_defaults_over_old": round(first["full_run_s"] / second["full_run_s"], 3)},
                     indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
