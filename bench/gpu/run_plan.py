"""What a GPU run asks for: the sizes of each kind of run (the real ones on a GPU, tiny ones for the CPU dry run),
the stages in the order they run, the sets a call names them by, and what each stage needs at most."""

from __future__ import annotations

from dataclasses import dataclass, field

import end_to_end
import torch


@dataclass(frozen=True)
class Profile:
    """The sizes of one kind of run: the real ones on a GPU, tiny ones for the CPU dry run."""

    name: str
    device: str
    geometry: dict | None        # the checkpoint's, in the tiny builder's terms (None: Tarsier2-7B's)
    frames: int
    width: int
    height: int
    clips: int                   # the speed workload
    prefill_clips: int           # of them, prefilled alone for the prefill rate
    baseline_clips: int          # transformers' one-at-a-time side
    new_tokens: int
    decode_rows: tuple[int, ...]
    decode_steps: int
    attention_rows: tuple[int, ...]   # FlexAttention compiles once per shape: a few sizes
    attention_repeats: int
    cli_clips: int
    cli_new_tokens: int
    cli_kv_gb: float             # the KV cache of the run without the memory check
    user_files: end_to_end.UserFiles   # the user's run: its files and how they are captioned
    pruning_clips: int           # clips of the workload's kind, run with and without temporal pruning
    pruning_frames: int          # their frames (more than the dry run's 2: at R = 0.5 a block would empty)
    demo_clips: int              # held-out clips of the demo model (each forwards and backwards)
    budget_s: float
    stage_s: dict[str, float] = field(default_factory=dict)   # what each stage needs at most, to plan the budget


GPU = Profile("gpu", "cuda", None, frames=16, width=1920, height=800, clips=64, prefill_clips=16, baseline_clips=8,
              new_tokens=256, decode_rows=(1, 8, 32, 64), decode_steps=20, attention_rows=(8, 32, 64),
              attention_repeats=50, cli_clips=8,
              cli_new_tokens=32, cli_kv_gb=40, user_files=end_to_end.GPU_FILES, pruning_clips=32,
              pruning_frames=16, demo_clips=50,
              budget_s=540,
              stage_s={"env": 15, "equality": 45, "build": 30, "engine": 110, "baseline": 90, "decode": 20,
                       "profile": 40, "attention": 40, "cli": 100, "compiled": 160,
                       "e2e": 180, "bf16_demo": 50, "pruning": 75, "segments": 100, "e2e_compiled": 110,
                       "qwen2_5_vl": 150})
# A 2-layer language model behind the real vision pipeline's pixel budget, bfloat16 as on the GPU.
DRY_GEOMETRY = dict(embed_dim=32, depth=2, vision_heads=2, text_hidden=128, text_intermediate=320, text_layers=2,
                    text_heads=4, text_kv_heads=2, mrope_section=[4, 6, 6], max_pixels=12_845_056)
DRY = Profile("cpu-dry-run", "cpu", DRY_GEOMETRY, frames=2, width=640, height=272, clips=4, prefill_clips=2,
              baseline_clips=2, new_tokens=8, decode_rows=(1, 2, 4), decode_steps=3, attention_rows=(1, 4),
              attention_repeats=3,
              cli_clips=2, cli_new_tokens=4, cli_kv_gb=1, user_files=end_to_end.DRY_FILES, pruning_clips=4,
              pruning_frames=8, demo_clips=2, budget_s=1800)
# Two calls on one warm machine. `targets`: the stages whose figures the engine's targets are judged by. The fourth
# run (an H100) took, from run.sh's start: 20 s to start, equality 32, build 20, engine 89, baseline 71, decode 9,
# compiled 129 (with the compiled vision blocks and their prefill), cli 81: ~450 s (profile 31 and attention 27 more,
# measured already: left out unless named). Each allowance above is that pace with a margin of a fifth or more.
# `user`: the user's run and the checks never run on a GPU, most telling first (their allowances are estimates
# until a run measures them); on the same machine it goes on from the first call's checkpoint and results.
# `qwen`: Qwen2.5-VL-7B beside Tarsier2-7B, a call of its own (`targets` has no 150 s left): `env` for the copy rate
# its decode floor is quoted against, then the stage (build ~20 s, load, the 64 clips, the decode steps: an estimate
# from `build`, `engine` and `decode` above, with fewer positions a clip than Tarsier2's).
STAGE_SETS = {"targets": ["env", "equality", "build", "engine", "baseline", "decode", "compiled", "cli"],
              "user": ["e2e", "bf16_demo", "pruning", "segments", "e2e_compiled"],
              "qwen": ["env", "qwen2_5_vl"]}
STAGES = [*STAGE_SETS["targets"], *STAGE_SETS["user"], "qwen2_5_vl", "profile", "attention"]
DEFAULT_STAGES = [*STAGE_SETS["targets"], *STAGE_SETS["user"], "qwen2_5_vl"]
DTYPE = torch.bfloat16


def wanted_stages(spec: str) -> list[str]:
    """The stages `--stages` names, comma-separated, a set's name standing for its stages."""
    return [stage for name in spec.split(",") if name.strip() for stage in STAGE_SETS.get(name.strip(), [name.strip()])]
