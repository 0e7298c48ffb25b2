"""Tarsier2 at its real size on one device: the engine against transformers' one-at-a-time generate.

The checkpoint is `bench/make_real_size_checkpoint.py`'s (8.29 B parameters in the official layout), its
weights drawn on the device and written to local disk, then loaded by the tool's own loader. EOS is off
on both sides, so every item generates exactly `new_tokens` tokens and both sides do the same work.

- `engine_pass`: every prompt through the engine as `tarsier caption` drives it (rows join as others
  finish), timed from the first `add` to the last token on the device;
- `baseline_pass`: transformers' own Qwen2-VL `generate`, one item per call, on the same loaded weights
  (bench/official_baseline.py): the way the official scripts caption;
- `decode_step_ms`: the engine's decode step with R rows at a given context, the rows admitted with
  their KV already in place (random values, `fill_with_noise`: what a decode step costs does not depend on
  them), against the step's bandwidth floor;
- `prefill_flops`: the arithmetic of a prefill, for the MFU.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from make_real_size_checkpoint import write_checkpoint, write_qwen2_5_vl_checkpoint  # noqa: E402, F401
from official_baseline import generate_tarsier2, qwen2_vl_for_generation  # noqa: E402

from tarsier_batch.engine import Engine  # noqa: E402
from tarsier_batch.families.base import CaptionModel, ProcessedPrompt  # noqa: E402

# The datasheet's dense bfloat16 rate of the H100 SXM and the H200 (the same Hopper tensor cores).
HOPPER_BF16_PEAK = 989.4e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(workdir: Path, geometry: dict | None, vocab: int | None, dtype: torch.dtype,
          device: torch.device) -> tuple[Path, dict]:
    path = workdir / "tarsier2-real-size"
    kwargs = {"vocab": vocab} if vocab else {}
    return path, write_checkpoint(path, dtype, device, geometry, **kwargs)


def engine_pass(engine: Engine, prompts: list[ProcessedPrompt], new_tokens: int) -> dict:
    """Every prompt through `engine`; seconds, rates and each row's ids."""
    device = engine.model.device
    synchronize(device)
    start = time.perf_counter()
    rows = [engine.add(prompt, payload=index, max_new_tokens=new_tokens) for index, prompt in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    synchronize(device)
    seconds = time.perf_counter() - start
    errors = [row.error for row in rows if row.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed: {errors[:3]}")
    tokens = sum(len(row.output_ids) for row in rows)
    return {"items": len(rows), "seconds": round(seconds, 3), "items_per_s": round(len(rows) / seconds, 4),
            "generated_tokens_per_s": round(tokens / seconds, 1), "generated_tokens": tokens,
            "preemptions": sum(row.preemptions for row in rows),
            "prefix_cache_hit_rate": round(engine.prefix_counts.hit_rate, 4), "ids": [row.output_ids for row in rows]}


@contextmanager
def prefix_cache_off(engine: Engine) -> Iterator[None]:
    """Within: every prompt computed whole, even where an earlier pass left its pages computed (distinct files,
    which a user's run captions, never find each other's pages)."""
    kv = engine.kv
    kept, kv.prefix_cache = kv.prefix_cache, False
    try:
        yield
    finally:
        kv.prefix_cache = kept


def prefill_pass(engine: Engine, prompts: list[ProcessedPrompt]) -> dict:
    """`prompts` prefilled (one token each) with the prefix cache off: each prompt computed whole, even where
    an earlier pass left its pages computed."""
    with prefix_cache_off(engine):
        run = engine_pass(engine, prompts, 1)
    run.pop("ids")
    run.pop("prefix_cache_hit_rate")
    return run


def baseline_pass(model: CaptionModel, prompts: list[ProcessedPrompt], new_tokens: int) -> dict:
    """transformers' Qwen2-VL generate, one prompt per call, greedy, EOS off, the checkpoint's repetition
    penalty: seconds, rates and ids. The first call's warm-up (two tokens) is not timed."""
    hf = qwen2_vl_for_generation(model)
    with torch.inference_mode():
        generate_tarsier2(model, hf, prompts[0], 2, disable_eos=True)
        synchronize(model.device)
        start = time.perf_counter()
        recorders = [Margins() for _ in prompts]
        ids = [generate_tarsier2(model, hf, prompt, new_tokens, disable_eos=True,
                                 logits_processor=LogitsProcessorList([recorder]))
               for prompt, recorder in zip(prompts, recorders)]
        synchronize(model.device)
        seconds = time.perf_counter() - start
    margins = [recorder.values() for recorder in recorders]
    tokens = sum(len(row) for row in ids)
    return {"items": len(prompts), "seconds": round(seconds, 3), "items_per_s": round(len(prompts) / seconds, 4),
            "generated_tokens_per_s": round(tokens / seconds, 1), "generated_tokens": tokens, "ids": ids,
            "margins": margins}


class Margins(LogitsProcessor):
    """Records, at each step of a greedy generate, the gap between the best and the second-best score (after the
    repetition penalty: what the argmax sees) relative to the largest score's magnitude. Where two runs' ids
    part, this says whether the reference was at a near tie there (random weights give flat logits: many are)."""

    def __init__(self) -> None:
        self.margins: list[torch.Tensor] = []   # kept on the device: reading each would wait for it every step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = scores[0].float().topk(2).values
        self.margins.append((top[0] - top[1]) / top.abs().max().clamp(min=1e-30))
        return scores

    def values(self) -> list[float]:
        return torch.stack(self.margins).tolist() if self.margins else []


def agreement(reference: list[list[int]], candidate: list[list[int]],
              margins: list[list[float]] | None = None) -> dict:
    """How often the engine's ids equal the baseline's, where they first part, and (given the reference's
    `margins`) how close to a tie the reference was there, against its median margin over all steps."""
    firsts = [next((index for index, (a, b) in enumerate(zip(want, got)) if a != b),
                   None if len(want) == len(got) else min(len(want), len(got)))
              for want, got in zip(reference, candidate)]
    parted = [first for first in firsts if first is not None]
    result = {"items": len(firsts), "exact_match_rate": round(1 - len(parted) / len(firsts), 4),
              "first_divergence": firsts,
              "median_first_divergence": statistics.median(parted) if parted else None,
              "tokens_per_item": len(reference[0]) if reference else 0}
    if margins:
        result["reference_margin_at_divergence"] = [
            None if first is None or first >= len(row) else row[first] for first, row in zip(firsts, margins)]
        result["reference_median_margin"] = statistics.median(value for row in margins for value in row)
    return result


def text_prompt(length: int, components: int, vocab: int) -> ProcessedPrompt:
    """`length` text positions (what a decode step reads does not depend on what the positions held)."""
    ids = torch.randint(10, vocab // 2, (length,), generator=torch.Generator().manual_seed(length))
    return ProcessedPrompt("", ids, torch.arange(length).expand(components, -1).clone(), length, [], torch.empty(0))


def fill_with_noise(engine: Engine) -> None:
    """Random keys and values in every slot of the engine's cache: the decode timings then read real numbers
    (a slot never written may hold NaN or inf, which changes what the kernels do). The prefix cache is off from
    then on: the pages it kept hold noise now."""
    engine.kv.prefix_cache = False
    for pool in engine.pools:
        pool.keys.normal_()
        pool.values.normal_()


def decode_step_ms(engine: Engine, rows: int, context: int, steps: int, warmup: int) -> float:
    """Median ms of a decode step with `rows` rows whose first `context` positions are cached, in `engine` emptied
    first (each step ends on the host with the sampled tokens, so its wall time is the device's)."""
    model = engine.model
    scheduler = engine.scheduler
    sequences = admit_decoding(engine, rows, context, warmup + steps + 2)
    times = []
    for index in range(warmup + steps):
        synchronize(model.device)
        start = time.perf_counter()
        engine.step()
        synchronize(model.device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    assert len(scheduler.running) == rows and all(len(seq.output_ids) == warmup + steps + 1 for seq in sequences)
    scheduler.clear()
    return round(statistics.median(times) * 1000, 3)


def admit_decoding(engine: Engine, rows: int, context: int, new_tokens: int) -> list:
    """`rows` rows in `engine` (emptied first) whose first `context` positions count as cached, each to generate
    `new_tokens`: every step from here on is a pure decode step."""
    scheduler = engine.scheduler
    scheduler.clear()
    prompt = text_prompt(context, 3, engine.model.model.language_model.lm_head.out_features)
    sequences = [engine.add(prompt, max_new_tokens=new_tokens) for _ in range(rows)]
    if sequences[0].error:
        raise RuntimeError(sequences[0].error)
    for seq in sequences:
        scheduler.waiting.remove(seq)
        if not scheduler._admit(seq, force=True):
            raise RuntimeError(f"no room for {rows} rows of {context} positions")
        seq.num_computed_tokens, seq.output_ids = context, [11]
    return sequences


def decode_floor_ms(model: CaptionModel, rows: int, context: int, copy_bytes_per_s: float) -> float:
    """The fewest bytes a decode step must read (the language model's weights but the input embedding, of which
    it reads one row per token, and every row's keys and values) over the device's measured copy rate."""
    language = model.model.language_model
    embedding = language.model.embed_tokens.weight
    weights = sum(parameter.numel() * parameter.element_size() for parameter in language.parameters()) \
        - embedding.numel() * embedding.element_size()
    kv = rows * context * model.kv_geometry.bytes_per_token(model.dtype)
    return round((weights + kv) / copy_bytes_per_s * 1000, 3)


def prefill_flops(model: CaptionModel, prompts: list[ProcessedPrompt],
                  encoded: list[ProcessedPrompt] | None = None) -> float:
    """Multiply-adds x 2 of prefilling `prompts`: every linear layer of the vision tower per patch (the merger's
    per merged vector), each frame's patches attending to each other, every linear layer of the language model
    per position, causal attention, and one row of logits per prompt. The tower's work is counted over the
    frames of `encoded` (default: `prompts`): pruned prompts keep fewer vectors of frames encoded whole."""
    tower = model.model.vision_tower
    merger = tower.merger
    merger_weights = sum(module.weight.numel() for module in merger.modules() if isinstance(module, torch.nn.Linear))
    tower_weights = sum(module.weight.numel() for module in tower.modules()
                        if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d))) - merger_weights
    vision_config, text_config = model.config.vision, model.config.text
    language = model.model.language_model
    layer_weights = sum(module.weight.numel() for module in language.model.layers.modules()
                        if isinstance(module, torch.nn.Linear))
    head = language.lm_head.weight.numel()
    merge = model.processor.merge_size ** 2
    attention_width = text_config.num_attention_heads * (text_config.hidden_size // text_config.num_attention_heads)
    flops = 0.0
    for prompt, frames in zip(prompts, encoded or prompts):
        patches = [block.length * merge for block in frames.vision_blocks]
        flops += 2 * tower_weights * sum(patches) + 2 * merger_weights * sum(patches) / merge
        flops += sum(4 * vision_config.embed_dim * count ** 2 * vision_config.depth for count in patches)
        flops += 2 * layer_weights * prompt.length + 2 * head
        flops += 2 * attention_width * prompt.length ** 2 * text_config.num_hidden_layers   # causal: half of 4 L^2 d
    return flops


def bf16_peak(device_name: str, measured_matmul: float) -> tuple[float, str]:
    """The peak an MFU is quoted against: the datasheet's for a Hopper card, else the measured matmul rate."""
    if any(name in device_name for name in ("H100", "H200")):
        return HOPPER_BF16_PEAK, "datasheet dense bf16 (989.4 TFLOP/s)"
    return measured_matmul, "measured matmul rate"


