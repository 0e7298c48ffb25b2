"""Captions written back as WebDataset shards against a Parquet file, on the same shard.

    python bench/bench_wds_output.py [--members 1000] [--rounds 2]

One shard of `--members` images (the sample PNGs, each member a copy under its own key) is captioned by
`tarsier caption` in a fresh process, `--model demo`, 8 new tokens, into `-o r.parquet` and into
`--out-dir d --out-format webdataset`, the two sides interleaved round after round (this machine is shared and
noisy), each into a new output. Wall time of the whole command is compared (target: webdataset within 1.1x of
Parquet). Prints JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from measured_on import measured_on

REPO = Path(__file__).resolve().parent.parent
IMAGES = ["still.png", "portrait.JPG", "ball.gif"]


def write_shard(path: Path, members: int) -> None:
    with tarfile.open(path, "w") as tar:
        for index in range(members):
            name = IMAGES[index % len(IMAGES)]
            data = (REPO / "sample_data" / name).read_bytes()
            info = tarfile.TarInfo(f"{index:06d}.{name.rsplit('.', 1)[1].lower()}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def run(shard: Path, output: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tarsier_batch.cli", "caption", str(shard), "--model", "demo",
                           "--max-new-tokens", "8", "--quiet", *output], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-wds-") as directory:
        folder = Path(directory)
        shard = folder / "shard-00000.tar"
        write_shard(shard, args.members)
        times: dict[str, list[float]] = {"parquet": [], "webdataset": []}
        for round_ in range(args.rounds):
            for side in (times if round_ % 2 == 0 else reversed(list(times))):
                out = folder / f"{side}-{round_}"
                output = ["-o", str(out.with_suffix(".parquet"))] if side == "parquet" else \
                    ["--out-dir", str(out), "--out-format", "webdataset"]
                times[side].append(run(shard, output))
            shutil.rmtree(folder / f"webdataset-{round_}", ignore_errors=True)
        medians = {side: statistics.median(values) for side, values in times.items()}
        print(json.dumps({**measured_on(), "members": args.members, "rounds": args.rounds, "seconds": times,
                          "median_s": {side: round(value, 2) for side, value in medians.items()},
                          "webdataset_over_parquet": round(medians["webdataset"] / medians["parquet"], 3)},
                         indent=1))


if __name__ == "__main__":
    main()
