"""What engine settings cost in caption quality, measured with the demo model on held-out clips.

    python bench/bench_demo.py [--n 100] [--seed 1] [--model demo]

Each setting captions the same `--n` held-out clips, forwards and backwards, through the whole
`tarsier caption` path (`tarsier_batch.demo.evaluate`), one after the other in this run; prints
JSON with the exact-match accuracies and the wall time of each. The first setting is the
reference `tarsier dev eval-demo` uses (float32, batches of 8, prefill chunks of 64 tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.demo.evaluate import evaluate_demo  # noqa: E402

SETTINGS = {
    "reference (float32, batch 8, chunk 64)": (),
    "bfloat16": ("--dtype", "bfloat16"),
    "one at a time (batch 1)": ("--batch-size", "1"),
    "batch 32, prefill chunk 16": ("--batch-size", "32", "--prefill-chunk", "16"),
    "batch 32, whole-prompt prefill": ("--batch-size", "32", "--prefill-chunk", "4096"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()
    results = []
    for name, flags in SETTINGS.items():
        start = time.perf_counter()
        result = evaluate_demo(args.n, args.seed, args.model, flags)
        seconds = time.perf_counter() - start
        results.append({"setting": name, "flags": " ".join(flags), "accuracy": round(result.accuracy, 3),
                        "reversed_accuracy": round(result.reversed_accuracy, 3), "clips": 2 * args.n,
                        "seconds": round(seconds, 1)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({**measured_on(), "n": args.n, "seed": args.seed, "model": args.model, "results": results},
                     indent=2))


if __name__ == "__main__":
    main()
