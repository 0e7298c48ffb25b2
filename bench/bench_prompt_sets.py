"""Several questions per clip: one engine run whose questions fork each clip's shared prefix, against one
run per question (what three `tarsier caption --prompt` runs do today).

    python bench/bench_prompt_sets.py [--clips 16] [--frames 8] [--new-tokens 32] [--repeats 2] [--video PATH]
                                      [--prefix-cache]

A random-weight Tarsier2 checkpoint at the official frame geometry (`wide`: 460,800 px a frame, an
8-layer 1024-wide language model), 16 videos from ../shared/media and sample_data (or --video, 16 times:
../shared/media/demo_test.mp4 gives 4,887 positions a prompt, the official size), three questions each,
32 new tokens with EOS off, the engine sized as `tarsier caption` sizes it on this machine (batch size,
KV cache, prefill chunk). Media are decoded and prompts prepared before timing, once for both sides, so
the separate runs are not charged for decoding each clip three times (as they would be). Side by side in
one process, interleaved: the three questions as a set (each clip's later questions share its first's
prefix KV) and as three runs; then one question alone through the same engine (the path without a set).
Peak memory (VmHWM above the loaded model) of each side in a fresh process. The prefix cache is off on both
sides unless --prefix-cache: with it, the 16 copies of --video share their prefix in every run, each question's
too, and the figures measure the cache rather than a set's forks. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from bench_engine import interleaved, timed, without_eos  # noqa: E402
from bench_tarsier2 import videos  # noqa: E402
from measured_on import measured_on  # noqa: E402

from tarsier_batch import Captioner, CaptionSettings, SamplingParams, discover  # noqa: E402
from tarsier_batch.engine import Engine, Sequence  # noqa: E402
from tarsier_batch.families.base import ProcessedPrompt  # noqa: E402
from tarsier_batch.families.tiny import make_tiny_model  # noqa: E402

QUESTIONS = ["Describe the video in detail.", "List the objects that appear in the video.",
             "How does the camera move?"]

# One side in a fresh process: the peak resident memory above the loaded, warmed-up model.
_PEAK = """
import sys
sys.path.insert(0, {bench!r})
from bench_prompt_sets import load, prepared, run_engine
captioner = load({model_dir!r}, {frames}, {new_tokens}, {prefix_cache})
sets = prepared(captioner, {clips}, {frames}, {questions}, {video!r})
run_engine(captioner, sets[:1], {fork})   # warm up
status = lambda field: int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
open("/proc/self/clear_refs", "w").write("5")
start = status("VmRSS:")
run_engine(captioner, sets, {fork})
print((status("VmHWM:") - start) / 1024)
"""


def load(model_dir: str, frames: int, new_tokens: int, prefix_cache: bool) -> Captioner:
    return without_eos(Captioner(CaptionSettings(model=model_dir, device="cpu", dtype="float32", frames=frames,
                                                 sampling=SamplingParams(max_new_tokens=new_tokens),
                                                 prefix_cache=prefix_cache)))


def prepared(captioner: Captioner, clips: int, frames: int, questions: int, video: str | None = None
             ) -> list[list[ProcessedPrompt]]:
    """Each clip decoded once, then one prompt per question over the same pixels."""
    processor = captioner.model.processor
    sets = []
    for item in (discover([video]).items * clips if video else videos(clips)):
        media = processor.load_media(item.path, item.media_type, frames)
        prompts = [processor.process(media, question) for question in QUESTIONS[:questions]]
        sets.append([replace(prompt, pixel_values=prompts[0].pixel_values) for prompt in prompts])  # one per clip
    return sets


def run_engine(captioner: Captioner, sets: list[list[ProcessedPrompt]], fork: bool) -> list[Sequence]:
    """Every question of every clip through one engine; with `fork`, a clip's later questions fork its first."""
    engine = Engine(captioner.model, captioner.engine_config, captioner.engine.sampling)
    rows = []
    for prompts in sets:
        first = engine.add(prompts[0])
        rows += [first] + [engine.add(prompt, prefix_source=first if fork else None) for prompt in prompts[1:]]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return rows


def peak_mb(model_dir: Path, args: argparse.Namespace, questions: int, fork: bool) -> float:
    script = _PEAK.format(bench=str(REPO / "bench"), model_dir=str(model_dir), frames=args.frames,
                          new_tokens=args.new_tokens, clips=args.clips, questions=questions, fork=fork,
                          video=args.video, prefix_cache=args.prefix_cache)
    done = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return round(float(done.stdout.strip().splitlines()[-1]), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--video", help="caption this video --clips times instead of the shared media")
    parser.add_argument("--prefix-cache", action="store_true", help="the prefix cache on, both sides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = make_tiny_model(Path(workdir) / "wide", "wide", seed=0, family="tarsier2")
        captioner = load(str(model_dir), args.frames, args.new_tokens, args.prefix_cache)
        sets = prepared(captioner, args.clips, args.frames, len(QUESTIONS), args.video)
        outputs: dict[str, list[list[int]]] = {}

        def as_set() -> float:
            return timed(lambda: outputs.__setitem__("set", [r.output_ids for r in run_engine(captioner, sets, True)]))

        def as_runs() -> float:
            tokens: list[list[list[int]]] = []
            seconds = sum(timed(lambda q=q: tokens.append([r.output_ids for r in run_engine(
                captioner, [[prompts[q]] for prompts in sets], False)])) for q in range(len(QUESTIONS)))
            outputs["runs"] = [tokens[q][clip] for clip in range(len(sets)) for q in range(len(QUESTIONS))]
            return seconds

        def one_question() -> float:
            return timed(lambda: run_engine(captioner, [prompts[:1] for prompts in sets], True))

        seconds = interleaved({"set_of_3": as_set, "3_runs": as_runs, "1_question": one_question}, args.repeats)
        assert outputs["set"] == outputs["runs"], "a question's tokens differ between the set and its own run"
        answers = len(sets) * len(QUESTIONS)
        result = {
            "benchmark": "prompt sets: 3 questions per clip, one forked prefill vs one run per question",
            "checkpoint": "tarsier2 wide (460,800 px frames, 8-layer 1024-wide LM)", "clips": len(sets),
            "video": args.video or "shared media and sample_data",
            "frames": args.frames, "new_tokens": args.new_tokens, "batch_size": captioner.batch_size,
            "prefix_cache": args.prefix_cache,
            "prefill_chunk": captioner.engine_config.prefill_chunk,
            "prompt_positions": sum(prompt.length for prompts in sets for prompt in prompts),
            "shared_prefix_positions": sum(prompts[0].shared_prefix(prompt)
                                           for prompts in sets for prompt in prompts[1:]),
            "seconds": seconds,
            "answers_per_s": {"set_of_3": round(answers / seconds["set_of_3"], 3),
                              "3_runs": round(answers / seconds["3_runs"], 3),
                              "1_question": round(len(sets) / seconds["1_question"], 3)},
            "set_speedup": round(seconds["3_runs"] / seconds["set_of_3"], 2),
            "tokens_equal": True,
            "peak_above_loaded_mb": {
                "set_of_3": peak_mb(model_dir, args, 3, True),
                "3_runs_each": peak_mb(model_dir, args, 1, False)},
        }
    print(json.dumps({**measured_on(), **result}, indent=1))


if __name__ == "__main__":
    main()
