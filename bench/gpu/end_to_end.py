"""The user's run: `tarsier caption` over video files as a camera or a site writes them, against the engine alone.

Three stages, each a fresh `tarsier caption` process over files made on the device (bench/gpu/video_files.py),
watched from outside (bench/gpu/monitor.py: when rows reach the disk, how busy the GPU is):

- `e2e`: the clips at the command's defaults (only `--max-new-tokens` set, to the engine stage's 256); then the
  same clips decoded and preprocessed beforehand in a process per core (decord's seconds per clip for the sampled
  frames, timed apart) and fed to the engine as the `engine` stage feeds it, EOS on as in the command. The ratio of
  the command's rate while captioning (its own figure: after the model is loaded) to the engine's says how much of
  the engine's speed a user gets, decoding, moving pixels and writing rows included;
- `e2e_compiled`: the same command with `--compile`;
- `segments`: one long file with `--segments fixed:10s`: a row per 10 s window, the file decoded once.
"""

from __future__ import annotations

import math
import os
import pickle
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import torch
from cli_runs import caption
from monitor import RunMonitor
from real_size import engine_pass
from video_files import VideoSpec, clip_lengths, make_videos

from tarsier_batch.families.loading import load_processor
from tarsier_batch.media import MediaType
from tarsier_batch.workers.sizing import default_workers

if TYPE_CHECKING:
    from run_state import Bench


@dataclass(frozen=True)
class UserFiles:
    """The files of the user's run and how they are captioned."""

    clips: int
    shortest_s: float
    longest_s: float
    width: int
    height: int
    fps: int
    long_s: float          # the file cut into segments
    segment_s: float
    new_tokens: int
    timeout_s: float       # for one `tarsier caption` process


GPU_FILES = UserFiles(clips=32, shortest_s=10, longest_s=20, width=1920, height=1080, fps=30, long_s=300,
                      segment_s=10, new_tokens=256, timeout_s=300)
DRY_FILES = UserFiles(clips=4, shortest_s=1, longest_s=3, width=320, height=180, fps=30, long_s=30, segment_s=10,
                      new_tokens=8, timeout_s=300)


def clip_specs(folder: Path, files: UserFiles) -> list[VideoSpec]:
    lengths = clip_lengths(files.clips, files.shortest_s, files.longest_s)
    return [VideoSpec(folder / f"clip_{index:03d}.mp4", seconds, files.width, files.height, files.fps, 1000 + index)
            for index, seconds in enumerate(lengths)]


def user_command(bench: Bench, inputs: list[Path], name: str, flags: list[str], expected_rows: int) -> dict:
    """`tarsier caption INPUTS --out NAME.parquet` in a fresh process (the parent lets go of the GPU first), watched;
    its figures, with the workers it decoded with and the rate over its whole wall time."""
    files: UserFiles = bench.profile.user_files
    bench.drop_model()
    out = bench.workdir / f"{name}.parquet"
    out.unlink(missing_ok=True)
    run = caption(bench.built(), inputs, out, [*bench.cli_flags(), "--max-new-tokens", str(files.new_tokens),
                                                  "--overwrite", *flags],
                  files.timeout_s, expected_rows, RunMonitor(out, bench.device))
    run["workers"] = default_workers()   # the command's default here: it runs on this machine's cores
    if out.exists():
        table = pq.read_table(out, columns=["generated_tokens"])
        run["generated_tokens"] = sum(value or 0 for value in table.column("generated_tokens").to_pylist())
    return run


# --- decoding beforehand -----------------------------------------------------------------------------------

_processor = None


def _load_processor(model_dir: str) -> None:
    global _processor
    torch.set_num_threads(1)   # one core per process, as the command's decoding workers run
    _processor = load_processor(Path(model_dir))


def _decode_one(path: str, frames: int) -> tuple[bytes, dict]:
    """One clip the command's way (frames sampled, decoded, resized, patched; the prompt made), and decord alone
    decoding the same frames: the prompt, pickled, and the seconds of each."""
    import decord

    started = time.perf_counter()
    media = _processor.load_media(path, MediaType.VIDEO, frames)
    loaded = time.perf_counter()
    prompt = _processor.process(media, None)
    prompt.digest_pixels()   # the command's workers do this too, off the engine's loop
    processed = time.perf_counter()
    reader = decord.VideoReader(path, num_threads=1, ctx=decord.cpu(0))
    reader.get_batch(list(media.frame_indices)).asnumpy()
    decoded = time.perf_counter()
    return pickle.dumps(prompt), {"load_media_s": loaded - started, "process_s": processed - loaded,
                                  "decord_s": decoded - processed, "frames_in_file": len(reader),
                                  "positions": prompt.length}


def decode_beforehand(model_dir: Path, paths: list[Path], frames: int, processes: int) -> tuple[list, dict]:
    """Every clip through the command's decoding in `processes` processes at once: the prompts, in order, and the
    seconds a clip took (on one core) and the clips per second the processes gave together."""
    started = time.perf_counter()
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn"), initializer=_load_processor,
                             initargs=(str(model_dir),)) as pool:
        done = list(pool.map(_decode_one, map(str, paths), [frames] * len(paths)))
    seconds = time.perf_counter() - started
    prompts = [pickle.loads(blob) for blob, _ in done]
    timings = [figures for _, figures in done]

    def mean(key: str) -> float:
        return round(statistics.fmean(figures[key] for figures in timings), 3)

    return prompts, {"processes": processes, "clips": len(paths), "wall_s": round(seconds, 2),
                     "clips_per_s": round(len(paths) / seconds, 3), "decord_s_per_clip": mean("decord_s"),
                     "load_media_s_per_clip": mean("load_media_s"), "process_s_per_clip": mean("process_s"),
                     "frames_per_clip": mean("frames_in_file"), "positions": sorted({f["positions"] for f in timings})}


# --- the stages --------------------------------------------------------------------------------------------


def run_e2e(bench: Bench) -> None:
    files: UserFiles = bench.profile.user_files
    info = bench.stage("e2e")
    folder = bench.workdir / "user-clips"
    specs = clip_specs(folder, files)
    started = time.perf_counter()
    info["files"] = make_videos(specs)
    info["files"]["make_s"] = round(time.perf_counter() - started, 1)
    bench.save()
    info["command"] = user_command(bench, [folder], "e2e", [], len(specs))
    bench.save()
    cores = len(os.sched_getaffinity(0))
    prompts, info["decode"] = decode_beforehand(bench.checkpoint, [spec.path for spec in specs],
                                                bench.profile.frames, cores)
    captioner = bench.loaded()
    captioner.model.eos_token_ids = bench.eos_token_ids   # EOS on, as in the command
    try:
        run = engine_pass(captioner.engine, prompts, files.new_tokens)
    finally:
        captioner.model.eos_token_ids = frozenset()
    run.pop("ids")
    info["engine_only"] = run
    command = info["command"]
    steady = command.get("items_per_s_while_captioning")
    info["e2e_over_engine"] = round(steady / run["items_per_s"], 4) if steady else None
    info["e2e_over_engine_whole_run"] = round(command["items_per_s"] / run["items_per_s"], 4)


def run_e2e_compiled(bench: Bench) -> None:
    if not bench.with_compile:
        bench.stage("e2e_compiled")["skipped"] = "compiling needs --with-compile on the CPU"
        return
    files: UserFiles = bench.profile.user_files
    folder = bench.workdir / "user-clips"
    specs = clip_specs(folder, files)
    make_videos(specs)   # made by `e2e` already, unless it was not run
    bench.stage("e2e_compiled")["command"] = user_command(bench, [folder], "e2e-compiled", ["--compile"],
                                                          len(specs))


def run_segments(bench: Bench) -> None:
    files: UserFiles = bench.profile.user_files
    info = bench.stage("segments")
    spec = VideoSpec(bench.workdir / "user-long" / "long.mp4", files.long_s, files.width, files.height, files.fps,
                     7)
    started = time.perf_counter()
    info["file"] = make_videos([spec])
    info["file"]["make_s"] = round(time.perf_counter() - started, 1)
    bench.save()
    windows = math.ceil(files.long_s / files.segment_s)
    info["command"] = user_command(bench, [spec.path], "segments", ["--segments", f"fixed:{files.segment_s:g}s"],
                                   windows)
