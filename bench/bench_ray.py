"""What running on Ray costs here: the same job single-process and with `--ray local`, side by side.

    python bench/bench_ray.py [--n 64] [--model demo] [--repeats 2]

Writes `--n` held-out demo clips as MP4, then captions them with `tarsier caption` (one process:
decoding workers plus the engine) and with `tarsier caption --ray local --out-dir` (a local Ray
cluster started by the run: decoding tasks, one captioning actor), alternating, `--repeats`
times each. Wall times include starting the process, and for Ray starting the cluster and the
actor (Ray's own start is reported apart, from `ray.init` in a separate process). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.demo import HELD_OUT_SEEDS  # noqa: E402
from tarsier_batch.demo.clips import make_clip, write_mp4  # noqa: E402

TARSIER = [sys.executable, "-m", "tarsier_batch.cli"]


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        clips = Path(scratch) / "clips"
        clips.mkdir()
        for number in range(args.n):
            write_mp4(make_clip(HELD_OUT_SEEDS[0] + number), clips / f"{number:04d}.mp4")
        common = ["caption", str(clips), "--model", args.model, "--device", "cpu", "--quiet"]
        ray_start = timed([sys.executable, "-c", "import ray; ray.init(num_cpus=2); ray.shutdown()"])
        single, on_ray = [], []
        for repeat in range(args.repeats):
            single.append(timed(TARSIER + common + ["-o", f"{scratch}/single-{repeat}.parquet"]))
            on_ray.append(timed(TARSIER + common + ["--ray", "local", "--out-dir", f"{scratch}/ray-{repeat}"]))
    best_single, best_ray = min(single), min(on_ray)
    print(json.dumps({
        **measured_on(), "items": args.n, "model": args.model,
        "single_process_s": [round(s, 2) for s in single], "ray_local_s": [round(s, 2) for s in on_ray],
        "single_items_per_s": round(args.n / best_single, 3), "ray_items_per_s": round(args.n / best_ray, 3),
        "ray_over_single_time": round(best_ray / best_single, 2),
        "ray_init_and_shutdown_s": round(ray_start, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
