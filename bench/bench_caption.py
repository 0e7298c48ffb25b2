"""Throughput of batched captioning against one item at a time, measured side by side.

    python bench/bench_caption.py [--size small] [--repeats 3] [--max-new-tokens 32]

Builds a random-weight checkpoint (`small` has the real token layout: 601 vectors per frame,
about 4,800 prefill tokens for 8 frames), loads it once, then captions ../shared/media with each
batch size in turn, interleaving the repeats so machine noise hits every setting alike. Prints
JSON: per setting the median items/s and generated tokens/s, and ratios against batch size 1.
Also times one whole `tarsier caption` run of ../shared/media (process start to exit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from tarsier_batch import Captioner, CaptionSettings, SamplingParams, discover
from tarsier_batch.tiny import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
SHARED_MEDIA = REPO.parent / "shared" / "media"


def timed_run(captioner: Captioner, items: list) -> dict[str, float]:
    tokens = 0

    def count(new: int) -> None:
        nonlocal tokens
        tokens += new

    start = time.perf_counter()
    results = list(captioner.caption(items, count))
    seconds = time.perf_counter() - start
    assert all(result.ok for result in results), [result.error for result in results]
    return {"seconds": seconds, "items_per_s": len(items) / seconds, "tokens_per_s": tokens / seconds}


def cli_run_seconds(model_dir: Path, max_new_tokens: int, workdir: Path) -> float:
    out = workdir / "cli.parquet"
    command = [sys.executable, "-m", "tarsier_batch.cli", "caption", str(SHARED_MEDIA), "--model", str(model_dir),
               "--out", str(out), "--overwrite", "--quiet", "--max-new-tokens", str(max_new_tokens)]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,4,8")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        model_dir = make_tiny_model(workdir / "model", args.size, seed=0)
        items = discover([str(SHARED_MEDIA)]).items
        base = CaptionSettings(model=str(model_dir), dtype="float32", device="cpu",
                               sampling=SamplingParams(max_new_tokens=args.max_new_tokens))
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
        captioners = {size: Captioner(replace(base, batch_size=size)) for size in batch_sizes}
        timed_run(captioners[batch_sizes[-1]], items)  # warm-up: caches, allocator, lazy imports
        runs: dict[int, list[dict[str, float]]] = {size: [] for size in batch_sizes}
        for _ in range(args.repeats):
            for size in batch_sizes:
                runs[size].append(timed_run(captioners[size], items))
        cli_seconds = cli_run_seconds(model_dir, args.max_new_tokens, workdir)

    medians = {size: {key: statistics.median(run[key] for run in results) for key in results[0]}
               for size, results in runs.items()}
    reference = medians[batch_sizes[0]]
    report = {
        "benchmark": "caption throughput by batch size",
        "model": f"random-weight Tarsier v1, size {args.size}",
        "items": len(items), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "by_batch_size": {str(size): {key: round(value, 4) for key, value in stats.items()}
                          for size, stats in medians.items()},
        "speedup_vs_batch_1": {str(size): round(stats["items_per_s"] / reference["items_per_s"], 3)
                               for size, stats in medians.items()},
        "cli_run_of_shared_media_s": round(cli_seconds, 2),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
