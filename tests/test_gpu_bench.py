"""The prepared GPU run works before it reaches a device: its CPU dry run end to end, and the comparison by
which it judges CUDA's float32 results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

from equality import RELATIVE_GAP, Generated, compare  # noqa: E402

from tarsier_batch import SamplingParams  # noqa: E402

SUMMARY_KEYS = {"device", "torch", "speedup_vs_transformers", "speedup_vs_transformers_eager", "items_per_s",
                "prefill_mfu", "decode_ms", "decode_floor_ms", "fp32_equality_passed", "bf16_exact_match_rate",
                "preflight_estimate_over_peak", "rows_lost"}


def dry_run(tmp_path: Path, *flags: str, through_run_sh: bool = True) -> dict:
    """The dry run through run.sh (whose start the budget counts from), or gpu_bench.py alone (from its own)."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    entry = ["bash", "bench/gpu/run.sh"] if through_run_sh else [sys.executable, "bench/gpu/gpu_bench.py", "--out",
                                                                 str(tmp_path / "out")]
    done = subprocess.run([*entry, "--cpu-dry-run", "--workdir", str(tmp_path / "work"), *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [path] = (tmp_path / "out").glob("gpu-*-cpu-dry-run.json")
    if through_run_sh:
        assert (tmp_path / "out" / "gpu-bench.log").read_text().strip().endswith(done.stdout.strip().splitlines()[-1])
    return json.loads(path.read_text())


@pytest.mark.bench
def test_cpu_dry_run_runs_every_stage_and_writes_the_summary(tmp_path: Path) -> None:
    results = dry_run(tmp_path)
    summary, stages = results["summary"], results["stages"]
    assert summary["stages_failed"] == [], {name: stages[name].get("error") for name in summary["stages_failed"]}
    assert summary["stages_done"] == ["env", "equality", "build", "engine", "baseline", "decode", "profile",
                                      "attention", "cli"]
    assert summary["stages_skipped"] == ["compiled"]   # compiling on the CPU takes --with-compile
    assert SUMMARY_KEYS <= set(summary)
    # Float32 on the CPU: every scenario of both families gives each row its ids alone, on inputs whose outputs
    # all differ (so rows swapped or mixed up would show).
    equality = stages["equality"]
    assert summary["fp32_equality_passed"] is True
    assert equality["exact_scenarios"] == equality["scenarios"] == 16
    for family in equality["families"].values():
        for scenario in family["scenarios"].values():
            assert scenario["distinct_reference_outputs"] == scenario["rows"]
    # The engine and transformers' generate ran the same clips; the figures are real numbers.
    assert summary["speedup_vs_transformers"] > 0 and summary["items_per_s"] > 0
    assert len(summary["bf16_first_divergence"]) == 2 and 0 <= summary["bf16_exact_match_rate"] <= 1
    assert stages["engine"]["eager"]["generated_tokens"] == 4 * 8   # EOS off: every clip its 8 tokens
    assert 0 < summary["prefill_mfu"] < 1
    assert set(summary["decode_ms"]) == set(summary["decode_floor_ms"]) == {"1", "2", "4"}
    assert all(ms > 0 for ms in summary["decode_ms"].values())
    assert all(kernel["exact"] for shape in stages["attention"]["by_rows"].values()
               for name, kernel in shape.items() if isinstance(kernel, dict))
    # The CLI runs: every file has its row, whether the batch was checked, unchecked or offloaded.
    assert summary["rows_lost"] == 0
    assert [stages["cli"][run]["rows"] for run in ("offload_kv", "batch_too_large", "batch_too_large_unchecked")] \
        == [2, 4, 4]


@pytest.mark.compile
def test_cpu_dry_run_of_the_compiled_stage(tmp_path: Path) -> None:
    results = dry_run(tmp_path, "--with-compile", "--stages", "env,build,engine,compiled")
    compiled = results["stages"]["compiled"]
    assert "error" not in compiled, compiled.get("traceback")
    assert compiled["equality"]["passed"] and compiled["equality"]["scenarios"] == 4
    assert compiled["engine"]["generated_tokens"] == 4 * 8
    assert compiled["prefill_only"]["items"] == 2 and 0 < results["summary"]["prefill_mfu_compiled"] < 1
    assert compiled["preflight"]["estimated_peak"] > 0   # against the compiled engine's peak on CUDA
    assert set(compiled["decode"]["ms"]) == {"1", "2", "4"}
    assert results["summary"]["decode_from"] == "compiled"


@pytest.mark.compile
def test_a_compiled_stage_past_the_budget_is_stopped_and_named(tmp_path: Path) -> None:
    # Its child process is killed when the budget ends (the first H100 run's compilation ran for minutes): the
    # run goes on to write its results, and the stage says it timed out and after which part. (Without run.sh
    # the budget counts from the script's start: starting Python would take more than these 2 s.)
    results = dry_run(tmp_path, "--with-compile", "--stages", "compiled", "--budget-s", "2", through_run_sh=False)
    compiled = results["stages"]["compiled"]
    assert compiled["error"] == "timed out after 2 s, in the part after none"
    assert results["summary"]["stages_failed"] == ["compiled"]


@pytest.mark.bench
def test_the_budget_counts_from_the_start_of_run_sh(tmp_path: Path) -> None:
    # The H200 run's second call started its 380 s budget after ~25 s of installing wheels and starting Python,
    # so the call's own 400 s limit killed it first. Starting Python alone takes more than half a second.
    results = dry_run(tmp_path, "--stages", "env", "--budget-s", "0.5")
    assert results["stages"]["env"]["skipped"].endswith("s left")
    assert results["summary"]["stages_skipped"] == ["env"]


def logits(*rows: list[float]) -> dict[int, tuple[torch.Tensor, list[int]]]:
    return {index: (torch.tensor(row), []) for index, row in enumerate(rows)}


GREEDY = SamplingParams(max_new_tokens=3, repetition_penalty=1.0)
STEPS = [[0.9, 0.1, 0.2, 0.3], [0.1, 0.8, 0.2, 0.3]]


def test_ids_may_part_only_at_a_tie_as_close_as_the_logit_gap() -> None:
    reference = Generated([[0, 1, 2]], [logits(*STEPS, [0.1, 0.2, 1.0, 1.0 - 1e-7])])
    near_tie = Generated([[0, 1, 3]], [logits(*STEPS, [0.1, 0.2, 1.0 - 1e-7, 1.0])])
    verdict = compare(reference, near_tie, GREEDY, exact_only=False)
    assert verdict["passed"] and not verdict["exact"]
    assert verdict["divergences"] == [{"row": 0, "position": 2, "of": 3}]
    assert not compare(reference, near_tie, GREEDY, exact_only=True)["passed"]   # the CPU's rule


def test_a_divergence_without_a_tie_fails() -> None:
    reference = Generated([[0, 1, 2]], [logits(*STEPS, [0.1, 0.2, 1.0, 0.5])])
    parted = Generated([[0, 1, 3]], [logits(*STEPS, [0.1, 0.2, 1.0, 0.5])])   # same logits, another token
    verdict = compare(reference, parted, GREEDY, exact_only=False)
    assert not verdict["passed"] and verdict["unexplained_rows"] == [0]


def test_logits_moved_by_a_real_bug_fail_even_when_the_ids_agree() -> None:
    reference = Generated([[0, 1]], [logits(*STEPS)])
    shifted = Generated([[0, 1]], [logits(STEPS[0], [0.1, 0.8, 0.25, 0.3])])
    verdict = compare(reference, shifted, GREEDY, exact_only=False)
    assert verdict["exact"] and not verdict["passed"]
    assert verdict["largest_relative_logit_gap"] == pytest.approx(0.05 / 0.8)
    assert verdict["largest_relative_logit_gap"] > RELATIVE_GAP
