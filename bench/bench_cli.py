"""How fast the command answers before any model work: help, usage errors, and --dry-run on 10,000 files.

    python bench/bench_cli.py [--files 10000] [--repeats 5]

Each case runs the installed command in a fresh process (what a user or a cron job sees), best
of `--repeats`, next to a bare `python -c pass` started the same way, in one run. Targets: --help
and every usage error under a second; --dry-run over 10,000 files under a second.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measured_on import measured_on

TARGET_S = 1.0


def best_time(command: list[str], repeats: int, expect: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True)
        times.append(time.perf_counter() - start)
        if done.returncode != expect:
            raise SystemExit(f"{command} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tarsier = [sys.executable, "-m", "tarsier_batch.cli"]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "media"
        folder.mkdir()
        for index in range(args.files):
            (folder / f"{index:05d}.mp4").touch()
        out = str(Path(scratch) / "r.parquet")
        cases = {
            "python -c pass": ([sys.executable, "-c", "pass"], 0),
            "tarsier --help": ([*tarsier, "--help"], 0),
            "tarsier caption -h": ([*tarsier, "caption", "-h"], 0),
            "bad --device": ([*tarsier, "caption", str(folder), "-o", out, "--device", "gpu"], 2),
            "bad --out suffix": ([*tarsier, "caption", str(folder), "-o", "r.txt"], 2),
            f"--dry-run over {args.files} files": ([*tarsier, "caption", str(folder), "-o", out, "--dry-run"], 0),
        }
        seconds = {name: round(best_time(command, args.repeats, code), 3) for name, (command, code) in cases.items()}
    print(json.dumps({**measured_on(), "seconds_best_of": args.repeats, "seconds": seconds, "target_s": TARGET_S,
                      "all_under_target": all(value < TARGET_S for value in seconds.values())}, indent=2))


if __name__ == "__main__":
    main()
