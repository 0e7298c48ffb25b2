"""KV pages against contiguous ranges: rows in flight and items/s for a mix of long and short prompts in a KV
cache that holds about four long rows.

    git worktree add /tmp/ranges <a commit before block tables>
    python bench/bench_kv_pages.py --ranges-tree /tmp/ranges [--long 4096 --short 512 --items 48 --repeats 2]

Each side runs in a child process of this script, importing `tarsier_batch` from its own tree (the ranges side
from --ranges-tree, the pages side from this checkout), the sides alternating over the repeats. The workload: a
tiny random-weight Tarsier2 checkpoint (real on-disk format), text-only prompts of --long and --short positions
(one long in four, in a fixed shuffled order), --new-tokens each with EOS off, greedy, float32, batch 16, prefill
chunk 512, a KV cache of 4 x (long + new tokens) slots. The model is small on purpose: the figure is how many
rows the cache lets run at once (ranges reserve room to grow geometrically and need a contiguous hole, pages
neither) and what the scheduling costs, not the arithmetic.

Prints one JSON object: per side, items/s (median), the mean and most rows running per step, steps, and
preemptions; and the ratios pages / ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measured_on import measured_on

REPO = Path(__file__).resolve().parent.parent


def side(model_dir: str, long: int, short: int, items: int, new_tokens: int) -> dict:
    """One run in this process, with whichever `tarsier_batch` is first on the path."""
    import torch

    import tarsier_batch
    from tarsier_batch.engine import Engine, EngineConfig, SamplingParams
    from tarsier_batch.families.base import ProcessedPrompt
    from tarsier_batch.families.loading import load_caption_model

    torch.set_num_threads(2)
    model = load_caption_model(Path(model_dir), torch.float32, torch.device("cpu"))
    model.eos_token_ids = frozenset()
    lengths = [long if index % 4 == 0 else short for index in range(items)]
    random.Random(0).shuffle(lengths)
    ids = torch.arange(5, 5 + long) % 200 + 5   # text ids clear of the special tokens

    def prompt(length: int) -> ProcessedPrompt:
        positions = torch.arange(length).expand(3, -1)   # M-RoPE: three components
        return ProcessedPrompt("", ids[:length].clone(), positions, length, [], torch.empty(0))

    # Every prompt starts with the same ids: the prefix cache (which the ranges tree lacks) would hand the rows
    # each other's pages, and the comparison is of how rows hold their KV, not of skipping prefill.
    no_prefix_cache = {"prefix_cache": False} if "prefix_cache" in EngineConfig.__dataclass_fields__ else {}
    config = EngineConfig(max_rows=16, max_batch_tokens=1024, prefill_chunk=512,
                          kv_cache_tokens=4 * (long + new_tokens), **no_prefix_cache)
    engine = Engine(model, config, SamplingParams(max_new_tokens=new_tokens))
    rows = [engine.add(prompt(length)) for length in lengths]
    in_flight: list[int] = []
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
        in_flight.append(len(engine.scheduler.running))
    seconds = time.perf_counter() - started
    assert all(row.error is None and len(row.output_ids) == new_tokens for row in rows)
    return {"tree": str(Path(tarsier_batch.__file__).resolve().parent.parent), "seconds": round(seconds, 3),
            "items_per_s": round(items / seconds, 3),
            "mean_rows_in_flight": round(statistics.mean(in_flight), 2), "most_rows_in_flight": max(in_flight),
            "steps": len(in_flight), "preemptions": sum(row.preemptions for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranges-tree", required=True, help="a checkout of the engine before block tables")
    parser.add_argument("--long", type=int, default=4096)
    parser.add_argument("--short", type=int, default=512)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--side", help=argparse.SUPPRESS)   # a child: the checkpoint to run
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.long, args.short, args.items, args.new_tokens)))
        return
    sys.path.insert(0, str(REPO))
    from tarsier_batch.families.tiny import make_tiny_model

    trees = {"ranges": str(Path(args.ranges_tree).resolve()), "pages": str(REPO)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = make_tiny_model(Path(workdir) / "tiny2", "tiny", seed=0, family="tarsier2")
        for _ in range(args.repeats):
            for name, tree in trees.items():
                command = [sys.executable, __file__, "--ranges-tree", args.ranges_tree, "--side", str(model_dir),
                           "--long", str(args.long), "--short", str(args.short), "--items", str(args.items),
                           "--new-tokens", str(args.new_tokens)]
                done = subprocess.run(command, check=True, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": tree})
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                assert figures.pop("tree") == tree, f"the {name} side imported another checkout"
                figures.pop("seconds")   # items/s says it
                runs[name].append(figures)
    result = {"workload": {"long": args.long, "short": args.short, "items": args.items,
                           "new_tokens": args.new_tokens, "kv_cache_tokens": 4 * (args.long + args.new_tokens),
                           "repeats": args.repeats}}
    for name, figures in runs.items():
        result[name] = {**figures[0], "items_per_s": round(statistics.median(run["items_per_s"] for run in figures), 3),
                        "all_items_per_s": [run["items_per_s"] for run in figures]}
    result["pages_over_ranges"] = {
        key: round(result["pages"][key] / result["ranges"][key], 3)
        for key in ("items_per_s", "mean_rows_in_flight", "most_rows_in_flight")}
    print(json.dumps({**measured_on(), **result}, indent=2))


if __name__ == "__main__":
    main()
