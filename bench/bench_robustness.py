"""What crash safety costs. Decoding in worker processes vs threads, and part files vs none.

    python bench/bench_robustness.py [--size bench] [--items 32] [--repeats 3] [--new-tokens 32]

One process, one checkpoint, the same items for every side, run in rotation so that the noise
of this shared machine hits every side alike:

- `threads`: decoding in threads, rows kept in memory until the end (the previous design);
- `processes`: decoding in worker processes (crash, hang and memory isolation), rows in memory;
- `processes+parts`: the CLI's path, rows saved in part files at the default flush settings;
- `processes+parts-every-row`: a part file per row (`--flush-rows 1`), the worst case.

Items are ../shared/media and sample_data repeated (videos, GIFs, images). The default `bench`
checkpoint (a ~100M-parameter v1 LM, 112 px frames) keeps the model fast, so decoding and I/O
overheads show more than they would behind a 7B model on a GPU. Prints one JSON object: the
median items/s per side and each side's ratio to `threads`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_engine import bench_items, measured_settings, without_eos  # noqa: E402
from measured_on import measured_on  # noqa: E402

from tarsier_batch import Captioner, SamplingParams  # noqa: E402
from tarsier_batch.families.tiny import make_tiny_model  # noqa: E402
from tarsier_batch.inputs.sources import MediaItem, item_key  # noqa: E402
from tarsier_batch.outputs.formats import OutputTarget  # noqa: E402
from tarsier_batch.outputs.resume import plan_run  # noqa: E402
from tarsier_batch.outputs.schema import OutputColumns  # noqa: E402
from tarsier_batch.outputs.store import ResultStore, StoredRows  # noqa: E402
from tarsier_batch.progress import RunStats  # noqa: E402
from tarsier_batch.run.loop import ItemLoop  # noqa: E402
from tarsier_batch.settings import FLUSH_ROWS  # noqa: E402

SIDES = {  # name -> (decode in processes, rows per part file or None for no parts)
    "threads": (False, None),
    "processes": (True, None),
    "processes+parts": (True, FLUSH_ROWS),
    "processes+parts-every-row": (True, 1),
}


def run_side(captioner: Captioner, items: list[MediaItem], flush_rows: int | None, workdir: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=workdir)) / "r.parquet"
    # No parts: rows wait in memory until the end (one flush), as the previous design kept them.
    store = ResultStore(OutputTarget(out), OutputColumns(), flush_rows=flush_rows or 10**9,
                        flush_seconds=float("inf"))
    store.begin({"settings": {}}, fresh=True)
    plan = plan_run(items, StoredRows())
    job = ItemLoop(items, plan, store, RunStats(total=len(items)), "bench", OutputColumns())
    start = time.perf_counter()
    for _ in job.run(captioner, []):
        pass
    store.flush()
    store.commit(job.final_rows(), {"settings": {}}, {})
    elapsed = time.perf_counter() - start
    assert job.stats.done == len(items) and job.stats.failed == 0
    return len(items) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        model_dir = make_tiny_model(workdir / args.size, args.size, seed=0)
        # Distinct keys: every item is captioned (a repeated file would otherwise be captioned once).
        items = [MediaItem(item.path, item.media_type, key=f"{item_key(item.path)}#{index}")
                 for index, item in enumerate(bench_items(args.items))]
        captioners = {}
        for name, (isolate, _) in SIDES.items():
            settings = measured_settings(model_dir, workers=args.workers, isolate_decoding=isolate,
                                         sampling=SamplingParams(max_new_tokens=args.new_tokens))
            captioners[name] = without_eos(Captioner(settings))
        run_side(captioners["processes"], items[:2], None, workdir)  # warm up: worker start, first allocations
        rates: dict[str, list[float]] = {name: [] for name in SIDES}
        for _ in range(args.repeats):
            for name, (_, flush_rows) in SIDES.items():
                rates[name].append(run_side(captioners[name], items, flush_rows, workdir))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(json.dumps({
        **measured_on(), "bench": "robustness", "size": args.size, "items": args.items, "new_tokens": args.new_tokens,
        "workers": args.workers, "repeats": args.repeats, "torch_threads": 1,
        "items_per_s": {name: round(value, 3) for name, value in medians.items()},
        "ratio_to_threads": {name: round(value / medians["threads"], 3) for name, value in medians.items()},
        "runs": {name: [round(value, 3) for value in values] for name, values in rates.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
