"""Half precision on a model that knows something: the trained demo model's captions of its held-out clips, batched
through the engine against one at a time through transformers' `generate`.

On random weights the two sides' bfloat16 ids part within a few tokens at near ties, which says nothing; the demo
model (a Tarsier v1 trained on synthetic clips of moving shapes, `--model demo`) has real margins between its
answers. Its held-out clips (forwards and played backwards, as `tarsier dev eval-demo` draws them) are written as
MP4 files and decoded the command's way; each side captions them greedily in the dtype, EOS on. Reported per
dtype: the share of identical captions and each side's exact-caption accuracy.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from real_size import engine_pass
from transformers import LogitsProcessorList

from official_baseline import generate_tarsier

from tarsier_batch import Captioner, CaptionSettings, SamplingParams
from tarsier_batch.demo import HELD_OUT_SEEDS
from tarsier_batch.demo.clips import make_clip, reversed_clip, write_mp4
from tarsier_batch.families.base import embed_whole_prompt
from tarsier_batch.media import MediaType

if TYPE_CHECKING:
    from run_state import Bench

NEW_TOKENS = 24   # a caption is ~10 tokens; `tarsier dev eval-demo` allows 24
SEED = 1
DTYPES = ("bfloat16", "float16")


def held_out_files(folder: Path, clips: int) -> dict[Path, str]:
    """`clips` held-out clips and each played backwards, as MP4 files; file -> the right caption."""
    folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    for index, seed in enumerate(random.Random(SEED).sample(range(*HELD_OUT_SEEDS), clips)):
        clip = make_clip(seed)
        for suffix, shown in (("", clip), ("-reversed", reversed_clip(clip))):
            path = folder / f"{index:04d}{suffix}.mp4"
            if not path.exists():
                write_mp4(shown, path)
            expected[path] = shown.caption
    return expected


def captions_both_ways(bench: Bench, dtype: str, expected: dict[Path, str]) -> dict:
    """The demo model in `dtype`: every file's caption from the engine (all at once) and from `generate` (one by
    one); how many agree and how many are right."""
    settings = CaptionSettings(model="demo", device=bench.profile.device, dtype=dtype, kv_cache_gb=1,
                               isolate_decoding=False, sampling=SamplingParams(max_new_tokens=NEW_TOKENS))
    captioner = Captioner(settings)
    model = captioner.model
    processor = model.processor
    paths = list(expected)
    prompts = [processor.process(processor.load_media(str(path), MediaType.VIDEO, captioner.frames), None)
               for path in paths]
    engine_ids = engine_pass(captioner.engine, prompts, NEW_TOKENS)["ids"]
    one_by_one = [generate_tarsier(model, embed_whole_prompt(model, prompt), NEW_TOKENS, False,
                                   LogitsProcessorList()) for prompt in prompts]
    engine_captions = [processor.decode(ids).strip() for ids in engine_ids]
    hf_captions = [processor.decode(ids).strip() for ids in one_by_one]
    right = [expected[path] for path in paths]
    count = len(paths)
    return {"captions": count,
            "identical_rate": round(sum(a == b for a, b in zip(engine_captions, hf_captions)) / count, 4),
            "engine_accuracy": round(sum(a == b for a, b in zip(engine_captions, right)) / count, 4),
            "transformers_accuracy": round(sum(a == b for a, b in zip(hf_captions, right)) / count, 4),
            "differing": [{"file": path.name, "engine": a, "transformers": b, "right": r}
                          for path, a, b, r in zip(paths, engine_captions, hf_captions, right) if a != b][:8]}


def run_bf16_demo(bench: Bench) -> None:
    info = bench.stage("bf16_demo")
    expected = held_out_files(bench.workdir / "demo-clips", bench.profile.demo_clips)
    for dtype in DTYPES:
        try:
            info[dtype] = captions_both_ways(bench, dtype, expected)
        except Exception as error:   # float16 may not suit the family: say so, keep bfloat16's figures
            info[dtype] = {"error": f"{type(error).__name__}: {error}"}
        bench.save()
    if "error" in info["bfloat16"]:
        raise RuntimeError(info["bfloat16"]["error"])
