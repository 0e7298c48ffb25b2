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
from monitor import RunMonitor  # noqa: E402
from video_files import GOP, VideoSpec, frame_at, make_videos, scene  # noqa: E402

from tarsier_batch import SamplingParams  # noqa: E402

SUMMARY_KEYS = {"device", "torch", "speedup_vs_transformers", "speedup_vs_transformers_eager", "items_per_s",
                "prefill_mfu", "decode_ms", "decode_floor_ms", "fp32_equality_passed", "bf16_exact_match_rate",
                "preflight_estimate_over_peak", "rows_lost", "e2e_items_per_s", "e2e_over_engine", "gpu_busy",
                "decode_s_per_clip", "bf16_demo_identical_rate", "pruned_speedup", "commit"}


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
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    results = dry_run(tmp_path, "--stages", "targets,user,profile,attention")
    summary, stages = results["summary"], results["stages"]
    assert summary["stages_failed"] == [], {name: stages[name].get("error") for name in summary["stages_failed"]}
    assert summary["stages_done"] == ["env", "equality", "build", "engine", "baseline", "decode", "cli", "e2e",
                                      "bf16_demo", "pruning", "segments", "profile", "attention"]
    # Compiling on the CPU takes --with-compile.
    assert summary["stages_skipped"] == ["compiled", "e2e_compiled"]
    assert summary["commit"].startswith(commit) and len(commit) == 40   # run.sh's, from git here
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
    assert_user_run(summary, stages)


def assert_user_run(summary: dict, stages: dict) -> None:
    """The user's run: four H.264 files of 1-3 s made and captioned by the command, one row each; the same clips
    decoded beforehand and run through the engine; the long file cut into 10 s rows; the demo model's captions both
    ways; the pruned clips shorter and the speed-up their two measured rates' ratio."""
    e2e = stages["e2e"]
    files = e2e["files"]
    assert files["files"] == 4 and files["gop"] == GOP and files["fps"] == 30
    assert all(1 <= seconds <= 3 for seconds in files["seconds"]) and len(set(files["seconds"])) == 4
    command = e2e["command"]
    assert command["exit_code"] == 0 and command["rows"] == 4 and command["rows_lost"] == 0
    assert command["generated_tokens"] == e2e["engine_only"]["generated_tokens"] > 0   # the same work both ways
    assert 0 < command["time_to_first_row_s"] <= command["seconds"]
    assert command["gpu_busy_source"] == "no CUDA device" and summary["gpu_busy"] is None
    assert summary["e2e_items_per_s"] == command["items_per_s"] == pytest.approx(4 / command["seconds"], rel=0.01)
    assert summary["e2e_over_engine"] == round(command["items_per_s_while_captioning"]
                                               / e2e["engine_only"]["items_per_s"], 4)
    assert summary["e2e_workers"] == command["workers"] >= 1
    decode = e2e["decode"]
    assert decode["clips"] == e2e["engine_only"]["items"] == 4
    assert summary["decode_s_per_clip"] == decode["decord_s_per_clip"] > 0
    assert decode["frames_per_clip"] == pytest.approx(30 * sum(files["seconds"]) / 4, abs=1)
    segments = stages["segments"]["command"]
    assert stages["segments"]["file"]["seconds"] == [30]
    assert segments["rows"] == segments["expected_rows"] == 3 and segments["rows_lost"] == 0   # 30 s / 10 s
    assert summary["segments_rows_per_s"] == segments["items_per_s"] > 0
    demo = stages["bf16_demo"]
    assert demo["bfloat16"]["captions"] == 4   # two held-out clips, forwards and backwards
    # A trained model's margins: the engine in bfloat16 gives transformers' captions, and the right ones.
    assert demo["bfloat16"]["identical_rate"] == demo["bfloat16"]["engine_accuracy"] == 1.0
    assert demo["bfloat16"]["transformers_accuracy"] == 1.0
    assert summary["bf16_demo_identical_rate"] == 1.0
    assert "identical_rate" in demo["float16"] or "error" in demo["float16"]
    pruning = stages["pruning"]
    assert pruning["positions"]["pruned"] < pruning["positions"]["whole"]
    assert pruning["whole"]["generated_tokens"] == pruning["pruned"]["generated_tokens"] == 4 * 8
    assert summary["pruned_speedup"] == round(pruning["pruned"]["items_per_s"] / pruning["whole"]["items_per_s"], 4)
    assert 0 < summary["pruned_prefill_mfu"] < 1


@pytest.mark.bench
def test_cpu_dry_run_of_qwen2_5_vl_beside_tarsier2(tmp_path: Path) -> None:
    results = dry_run(tmp_path, "--stages", "qwen")
    summary, qwen = results["summary"], results["stages"]["qwen2_5_vl"]
    assert summary["stages_done"] == ["env", "qwen2_5_vl"], qwen.get("traceback")
    # Its own checkpoint in Qwen2.5-VL's layout (flat config, untied head, weights under visual., model., lm_head.).
    checkpoint = tmp_path / "work" / "qwen2_5_vl-real-size"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["tie_word_embeddings"] is False
    weights = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert {name.split(".")[0] for name in weights} == {"visual", "model", "lm_head"}
    assert qwen["build"]["parameters"] > 0 and qwen["describe"]
    # The clips through its own processor and the engine, EOS off: every clip its 8 tokens.
    assert qwen["engine"]["generated_tokens"] == 4 * 8 and qwen["engine"]["items"] == 4
    assert summary["qwen2_5_vl_items_per_s"] == qwen["engine"]["items_per_s"] > 0
    assert qwen["decode"]["context"] == max(qwen["prompt_positions"])
    assert set(summary["qwen2_5_vl_decode_ms"]) == set(summary["qwen2_5_vl_decode_floor_ms"]) == {"1", "2", "4"}
    assert all(ms > 0 for ms in summary["qwen2_5_vl_decode_ms"].values())
    assert all(floor > 0 for floor in summary["qwen2_5_vl_decode_floor_ms"].values())


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


def test_a_long_file_made_in_pieces_is_one_file_with_a_keyframe_every_gop(tmp_path: Path) -> None:
    # Pieces of two GOPs encoded apart and joined: the frames and their times run on across each join, and the
    # keyframes fall every GOP frames (a join that restarted the times, or a piece encoded from the wrong frame,
    # would show).
    import decord

    spec = VideoSpec(tmp_path / "long.mp4", 20, 96, 64, 30, 3)
    facts = make_videos([spec], processes=2)
    assert facts["made"] == 1 and spec.path.exists() and not list(tmp_path.glob("*piece*"))
    reader = decord.VideoReader(str(spec.path))
    assert len(reader) == 600
    assert list(reader.get_key_indices()) == [0, GOP, 2 * GOP]
    assert reader.get_frame_timestamp(599)[0] == pytest.approx(599 / 30, abs=1e-3)
    background = scene(spec.seed, spec.width, spec.height)
    for index in (0, 499, 500, 599):   # the last of the first piece, the first of the second
        drawn = frame_at(background, spec, index).astype(int)
        difference = abs(reader[index].asnumpy().astype(int) - drawn).mean()
        assert difference < 8, (index, difference)
    assert make_videos([spec])["made"] == 0   # a file already there is kept


def test_gpu_busy_while_captioning_is_the_mean_over_the_last_captioning_seconds(tmp_path: Path) -> None:
    monitor = RunMonitor(tmp_path / "x.parquet", torch.device("cpu"))
    monitor.busy = [(0.5, 0.0), (1.0, 10.0), (2.0, 80.0), (3.0, 100.0), (4.0, 90.0)]
    monitor.parts = {"part-2.parquet": (3.5, 3), "part-1.parquet": (2.5, 1)}
    figures = monitor.figures(captioning_s=2.0)
    assert figures["gpu_busy_while_captioning"] == pytest.approx((80 + 100 + 90) / 300)
    assert figures["gpu_busy"] == pytest.approx(280 / 500)
    assert figures["time_to_first_row_s"] == 2.5 and figures["rows_saved_at_s"] == [[2.5, 1], [3.5, 3]]
    assert monitor.figures(captioning_s=None)["gpu_busy_while_captioning"] is None
    # Rows that reached `--out` before any look saw a part of theirs arrived when `--out` did.
    monitor.parts, monitor.out_at = {}, 4.2
    assert monitor.figures(captioning_s=2.0)["time_to_first_row_s"] == 4.2
