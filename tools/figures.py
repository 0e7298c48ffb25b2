"""The measured figures quoted in the docs, made from bench/results/*.json.

    python tools/figures.py           # rewrite every figure in PAGES, then README.md from docs/index.md
    python tools/figures.py --check   # exit 1 if a page quotes a figure other than its results file says

A figure is written between two HTML comments, which neither GitHub nor the docs site shows:

    <!-- figure b1-2026-11-27-uncached.json speedup {:.2f}x -->2.61x<!-- /figure -->

naming the results file, the key path inside it (keys or list indices joined by `/`; a key may hold spaces)
and a Python format template for the value, which begins at the first ` {`. A whole table is
`<!-- figure table NAME -->` ... `<!-- /figure -->`, NAME one of TABLES. Figures with no results file behind them
stay plain prose; a figure quoted from elsewhere is never written into a results file. tests/test_docs.py fails
when a page has drifted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import readme  # noqa: E402

RESULTS = REPO / "bench" / "results"
PAGES = [REPO / "docs" / name for name in ("index.md", "benchmarks.md", "engine.md", "models.md", "questions.md",
                                           "captioning.md", "troubleshooting.md", "pipelines.md")] + \
    [REPO / "bench" / "README.md"]
REGION = re.compile(r"<!-- figure (?P<spec>.*?) -->(?P<body>.*?)<!-- /figure -->", re.S)


@cache
def result(name: str) -> dict:
    """bench/results/NAME, read once."""
    return json.loads((RESULTS / name).read_text())


def value(name: str, path: str) -> Any:
    """The value at `path` (keys, or a list's indices, joined by `/`) in bench/results/NAME."""
    found: Any = result(name)
    for key in path.split("/"):
        if isinstance(found, list) and key.isdigit() and int(key) < len(found):
            found = found[int(key)]
        elif isinstance(found, dict) and key in found:
            found = found[key]
        else:
            raise KeyError(f"{name} has no {path!r} (stops at {key!r})")
    if found is None:
        raise KeyError(f"{name}: {path!r} is null, not a figure")
    return found


def figure(spec: str) -> str:
    """One inline figure: `FILE PATH {TEMPLATE}` -> the value formatted."""
    name, _, rest = spec.partition(" ")
    path, brace, template = rest.partition(" {")
    if not brace:
        raise ValueError(f"figure {spec!r}: expected FILE PATH {{TEMPLATE}}")
    return ("{" + template).format(value(name, path))


def _cells(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


def _ms(by_rows: dict, rows: tuple[str, ...] = ("1", "32", "64")) -> str:
    return " / ".join(f"{by_rows[row]:.1f}" for row in rows)


# The GPU runs (bench/gpu/run.sh), oldest first: a label, the results file, and why its speed figures are not those
# of a dataset where they are not.
GPU_RUNS = (
    ("first, H100", "gpu-2026-11-27-nvidia-h100-80gb-hbm3.json", None),
    ("second, H200", "gpu-2026-11-27-nvidia-h200.json",
     "not comparable: 16 clips repeated 4 times, the prefix cache served 48 of 64 prompts"),
    ("third, H100", "gpu-2026-11-27-nvidia-h100-80gb-hbm3-run3.json", None),
    ("fourth, H100", "gpu-2026-11-27-nvidia-h100-80gb-hbm3-run4.json", None),
    ("fourth, H100, a call after (`--compile` with compiled vision blocks)",
     "gpu-2026-11-27-nvidia-h100-80gb-hbm3-run5.json", None),
)
DECODE_MODES = (("eager", "decode_ms_eager"), ("CUDA graphs", "decode_ms_graphs"))


def gpu_runs_table() -> str:
    """One row per GPU run: equality, speed against `generate`, prefill MFU, decode steps, memory check, rows lost."""
    lines = [_cells(["run", "float32 equality (tiny checkpoints)", "items/s against one-at-a-time `generate`",
                     "prefill MFU", "decode step at 1 / 32 / 64 rows, ms (bandwidth floor)",
                     "memory check: estimate / peak", "rows lost by `tarsier caption`"]),
             _cells(["---"] * 7)]
    for label, name, unfair in GPU_RUNS:
        summary, stages = result(name)["summary"], result(name)["stages"]
        lines.append(_cells([label, _equality(stages), unfair or _speedups(summary), "" if unfair else _mfu(summary),
                             _decode(summary), _or(summary["preflight_estimate_over_peak"], "{:.3f}", "not run"),
                             _or(summary["rows_lost"], "{}", "not run")]))
    return "\n".join(lines)


def _equality(stages: dict) -> str:
    equality = stages.get("equality")
    if not equality:
        return "not run"
    return f"{equality['exact_scenarios']} of {equality['scenarios']} scenarios exact"


def _with_and_without_compile(summary: dict, without: str, template: str) -> str:
    """The figure under `without` and under its `_compiled` twin, those the run measured, joined by "; "."""
    compiled = without.removesuffix("_eager") + "_compiled"
    return "; ".join(template.format(summary[key]) + label for key, label in
                     ((without, ""), (compiled, " with `--compile`")) if summary.get(key) is not None)


def _speedups(summary: dict) -> str:
    found = _with_and_without_compile(summary, "speedup_vs_transformers_eager", "{:.2f}x")
    if not found:
        return f"not run (`--compile`: {summary['items_per_s_compiled']:.2f} items/s)"
    return found + f" ({summary['transformers_items_per_s']:.3f} items/s for `generate`)"


def _mfu(summary: dict) -> str:
    return _with_and_without_compile(summary, "prefill_mfu", "{:.2f}")


def _decode(summary: dict) -> str:
    by_mode = {label: summary.get(key) for label, key in DECODE_MODES}
    if summary["decode_from"] == "compiled":  # `decode_ms` holds the fastest mode the run measured
        by_mode["`--compile`"] = summary["decode_ms"]
    parts = [f"{label} {_ms(by_rows)}" for label, by_rows in by_mode.items() if by_rows]
    return "; ".join(parts) + f" ({_ms(summary['decode_floor_ms'])})"


def _or(found: Any, template: str, missing: str) -> str:
    """`found` formatted, or `missing` where the run did not measure it (None)."""
    return missing if found is None else template.format(found)


# The CPU runs against one item per `generate()` (bench_engine.py b1 for Tarsier v1, bench_tarsier2.py), newest
# first: a label, the results file, and the frame size inside a bench_tarsier2.py file (None for a B1 file).
CPU_SPEEDUPS = (
    ("Qwen2-VL `bench`, 8 frames, 2 threads, 2026-11-29, 3 repeats, prefix cache off, one quiet window with the three "
     "runs below (prompts 172-308)", "qwen2-vl-2026-11-29-quiet-uncached.json", "bench"),
    ("Qwen2.5-VL `bench`, the same window (prompts 172-308)", "qwen2-5-vl-2026-11-29-quiet-uncached.json", "bench"),
    ("Tarsier2 `bench`, the same window (prompts 151-503)", "tarsier2-2026-11-29-quiet-uncached.json", "bench"),
    ("Tarsier2 `wide`, the same run (prompts 151-4,887)", "tarsier2-2026-11-29-quiet-uncached.json", "wide"),
    ("Qwen3-VL `bench`, the same window, first (prompts 167-329)", "qwen3-vl-2026-11-29-quiet-uncached.json",
     "bench"),
    ("Qwen2-VL `bench`, 8 frames, 2 threads, 2026-11-29, 1 repeat, prefix cache off, after the Tarsier2 run below "
     "(prompts 172-308)", "qwen2-vl-2026-11-29-rerun-uncached.json", "bench"),
    ("Qwen3-VL `bench`, 8 frames, 2 threads, 2026-11-29, 1 repeat, prefix cache off, a busy machine (prompts 167-329)",
     "qwen3-vl-2026-11-29-uncached.json", "bench"),
    ("Tarsier2 `bench`, 8 frames, 2 threads, 2026-11-29, 1 repeat, prefix cache off, a busy machine, after the "
     "Qwen3-VL "
     "run (prompts 151-503)", "tarsier2-2026-11-29-uncached.json", "bench"),
    ("Qwen2-VL `bench`, 8 frames, 2 threads, 2026-11-29, 1 repeat, prefix cache off, a busy machine (prompts 172-308)",
     "qwen2-vl-2026-11-29-uncached.json", "bench"),
    ("Qwen2.5-VL `bench`, 8 frames, 2 threads, 2026-11-29, 1 repeat, prefix cache off (prompts 172-308)",
     "qwen2-5-vl-2026-11-29-uncached.json", "bench"),
    ("B1, v1 `bench`, 2026-11-27, 3 repeats, prefix cache off", "b1-2026-11-27-uncached.json", None),
    ("Tarsier2 `bench`, 8 frames, 2 threads, 3 repeats, prefix cache off (prompts 151-503)",
     "tarsier2-2026-11-27-uncached.json", "bench"),
    ("Tarsier2 `wide`, `--video ../shared/media/demo_test.mp4` (16 x 4,887 positions), 1 repeat, prefix cache off",
     "tarsier2-official-size-2026-11-27-uncached.json", "wide"),
    ("B1, v1 `bench`, 2026-11-27, 3 repeats, cache on (negligible attention weights dropped, below)",
     "b1-2026-11-27.json", None),
    ("Tarsier2 `bench`, 8 frames, 2 threads, 3 repeats, cache on, the same (prompts 151-503)",
     "tarsier2-2026-11-27.json", "bench"),
    ("Tarsier2 `wide`, `--video ../shared/media/demo_test.mp4` (16 x 4,887 positions), cache on, the same",
     "tarsier2-official-size-2026-11-27.json", "wide"),
    ("B1, v1 `bench`, 2026-11-27, 3 repeats, cache on, before (block tables, prefix cache, the exp fix)",
     "b1-before-weight-floor-2026-11-27.json", None),
    ("Tarsier2 `bench`, 8 frames, 2 threads, 2026-11-27, cache on, before (prompts 151-503)",
     "tarsier2-before-weight-floor-2026-11-27.json", "bench"),
    ("Tarsier2 `wide`, the same (prompts 151-4,887, one of 4,887)", "tarsier2-before-weight-floor-2026-11-27.json",
     "wide"),
    ("Tarsier2 `wide`, `--video ../shared/media/demo_test.mp4`, cache on, before",
     "tarsier2-official-size-before-weight-floor-2026-11-27.json", "wide"),
    ("the same `bench` shape, before the exp fix below, same day", "tarsier2-before-exp-floor-2026-11-27.json",
     "bench"),
    ("B1, v1 `bench`, 2026-11-25, 1 repeat", "b1-2026-11-25.json", None),
    ("the same run, per-row decode attention", "b1-per-row-attention-2026-11-25.json", None),
    ("Tarsier2 `bench` (50,176 px), 2026-11-25, 1 repeat", "tarsier2-2026-11-25.json", "bench"),
    ("the same run, per-row decode attention", "tarsier2-per-row-attention-2026-11-25.json", "bench"),
    ("B1, 2026-11-22, 3 repeats, per-row decode attention", "b1-2026-11-22.json", None),
    ("Tarsier2 `bench`, 2026-11-22, per-row decode attention", "tarsier2-2026-11-22.json", "bench"),
    ("Tarsier2 `wide` (460,800 px), 2026-11-22, the same", "tarsier2-2026-11-22.json", "wide"),
)


def cpu_speedups_table() -> str:
    """One row per CPU run: our seconds, one at a time's, the speed-up (and target), after prefill, start-up."""
    lines = [_cells(["run", "ours", "one at a time", "speedup", "after prefill", "start-up"]), _cells(["---"] * 6)]
    for label, name, size in CPU_SPEEDUPS:
        run = result(name) if size is None else result(name)["by_resolution"][size]
        ours = run["seconds"]["tarsier_caption"]
        theirs = run["seconds"]["official_one_at_a_time" if size is None else "one_at_a_time_generate"]
        target = run.get("target", run.get("target_speedup"))
        lines.append(_cells([
            f"{label} ([json](results/{name}))", f"{ours:.3f} s", f"{theirs:.3f} s",
            f"{run['speedup']:.2f}x" + (f" (target {target:g}x)" if target else ""),
            _or(run.get("speedup_after_prefill"), "{:.2f}x", ""), _or(run.get("startup_s"), "{:.2f} s", "")]))
    return "\n".join(lines)


# Vision-token pruning at R = 0.5 against unpruned (bench_pruning.py speed): a label, the results file, the setting.
PRUNING = (("`temporal`", "pruning-speed-temporal-2026-11-25.json", "R=0.5,temporal"),
           ("`fastv`, K = 2", "pruning-speed-fastv-2026-11-23.json", "R=0.5,K=2"))
PRUNING_RATIOS = (("prefill FLOPs", "prefill_flops"), ("prefill time", "prefill_time"), ("KV per item", "kv_bytes"),
                  ("peak memory", "peak_memory"), ("items/s (4 items, 16 tokens)", "items_per_s"))


def pruning_table() -> str:
    """Each method's ratios to unpruned, Tarsier v1 / Tarsier2, and the items a KV cache for 16 unpruned ones holds."""
    lines = [_cells(["method (Tarsier v1 / Tarsier2)", *(label for label, _ in PRUNING_RATIOS),
                     "items in the KV of 16 unpruned"]), _cells(["---"] * (len(PRUNING_RATIOS) + 2))]
    for label, name, setting in PRUNING:
        families = [result(name)["families"][family]["settings"][setting] for family in ("tarsier", "tarsier2")]
        lines.append(_cells([label, *(" / ".join(f"{family['vs_unpruned'][key]:.2f}x" for family in families)
                                      for _, key in PRUNING_RATIOS),
                             " / ".join(str(family["rows_in_kv_of_16_unpruned"]) for family in families)]))
    return "\n".join(lines)


# Every pruning setting measured for speed, in the order bench/README.md discusses them: a label, the results file,
# the setting.
PRUNING_SETTINGS = tuple((f"fastv R={ratio}, K={layer}", "pruning-speed-fastv-2026-11-23.json", f"R={ratio},K={layer}")
                         for ratio, layer in (("0.25", 2), ("0.5", 2), ("0.75", 2), ("0.5", 8))) + tuple(
    (f"temporal R={ratio}", "pruning-speed-temporal-2026-11-25.json", f"R={ratio},temporal")
    for ratio in ("0.25", "0.5", "0.75"))
PRUNING_HEADERS = ("FLOPs", "time", "KV", "rows", "items/s")


def pruning_settings_table() -> str:
    """Each setting's ratios to unpruned and the rows a KV for 16 unpruned holds, Tarsier v1's then Tarsier2's."""
    headers = ["setting", *(f"{family} {name}" for family in ("v1", "Tarsier2") for name in PRUNING_HEADERS)]
    lines = [_cells(headers), _cells(["---"] * len(headers))]
    for label, name, setting in PRUNING_SETTINGS:
        cells = [label]
        for family in ("tarsier", "tarsier2"):
            measured = result(name)["families"][family]["settings"][setting]
            ratios = measured["vs_unpruned"]
            cells += [f"{ratios['prefill_flops']:.3f}", f"{ratios['prefill_time']:.3f}", f"{ratios['kv_bytes']:.3f}",
                      str(measured["rows_in_kv_of_16_unpruned"]), f"{ratios['items_per_s']:.2f}"]
        lines.append(_cells(cells))
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {"gpu-runs": gpu_runs_table, "cpu-speedups": cpu_speedups_table,
                                        "pruning": pruning_table, "pruning-settings": pruning_settings_table}


def render_region(spec: str, indent: str = "") -> str:
    """A region's body: one figure, or a table whose lines start with `indent` (its marker's, inside a list item)."""
    kind, _, name = spec.partition(" ")
    if kind == "table":
        if name not in TABLES:
            raise KeyError(f"no table {name!r} (tables: {', '.join(TABLES)})")
        return "\n\n" + "\n".join(indent + line for line in TABLES[name]().splitlines()) + "\n\n" + indent
    return figure(spec)


def render(text: str) -> str:
    """`text` with every figure region's body made from its results file."""
    def region(match: re.Match) -> str:
        line_start = text[text.rfind("\n", 0, match.start()) + 1:match.start()]
        indent = line_start if line_start.isspace() else ""
        return f"<!-- figure {match['spec']} -->{render_region(match['spec'], indent)}<!-- /figure -->"

    return REGION.sub(region, text)


def stale_pages() -> list[Path]:
    return [page for page in PAGES if page.read_text() != render(page.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page's figures are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_pages()
        if stale:
            sys.exit(f"stale figures in {', '.join(str(page.relative_to(REPO)) for page in stale)}: "
                     f"run python tools/figures.py")
        return
    for page in PAGES:
        page.write_text(render(page.read_text()))
    readme.README.write_text(readme.render())


if __name__ == "__main__":
    main()
