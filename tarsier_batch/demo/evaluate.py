"""Measure a demo checkpoint on held-out clips, through the whole `tarsier caption` command.

The clips are written as MP4 files and captioned by the CLI in a child process (decoding
workers, batching, chunked prefill, Parquet), so a bug anywhere on that path costs accuracy.
Every clip is captioned forwards and backwards: played backwards it must get the opposite
motion ("moves up" becomes "moves down"), which fails if frame order is lost anywhere.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from . import HELD_OUT_SEEDS
from .clips import make_clip, reversed_clip, write_mp4


@dataclass
class Evaluation:
    n: int
    correct: int
    reversed_correct: int
    mistakes: list[tuple[str, str, str]] = field(default_factory=list)   # (file, expected, got)
    captions: dict[str, str] = field(default_factory=dict)               # file -> caption (or error)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def reversed_accuracy(self) -> float:
        return self.reversed_correct / self.n if self.n else 0.0


def evaluate_demo(n: int, seed: int, model: str = "demo", extra_flags: tuple[str, ...] = ()) -> Evaluation:
    """Caption `n` held-out clips (and each played backwards) with `model`; exact-match accuracy."""
    draw = random.Random(seed)
    seeds = draw.sample(range(*HELD_OUT_SEEDS), n)
    with tempfile.TemporaryDirectory(prefix="tarsier-eval-") as scratch:
        folder = Path(scratch) / "clips"
        folder.mkdir()
        expected: dict[str, tuple[str, bool]] = {}
        for index, clip_seed in enumerate(seeds):
            clip = make_clip(clip_seed)
            for backwards, shown in ((False, clip), (True, reversed_clip(clip))):
                path = write_mp4(shown, folder / f"{index:04d}{'-reversed' if backwards else ''}.mp4")
                expected[str(path)] = (shown.caption, backwards)
        out = Path(scratch) / "captions.parquet"
        # Small prefill chunks and batches: the run exercises chunked prefill and rows joining mid-run.
        command = [sys.executable, "-m", "tarsier_batch.cli", "caption", str(folder), "-o", str(out),
                   "--model", model, "--max-new-tokens", "24", "--prefill-chunk", "64", "--batch-size", "8",
                   "--quiet", *extra_flags]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode not in (0, 1):
            raise RuntimeError(f"tarsier caption failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        rows = pq.read_table(out, columns=["path", "caption", "error"]).to_pylist()
    result = Evaluation(n, 0, 0)
    for row in rows:
        caption, backwards = expected[row["path"]]
        got = (row["caption"] or row["error"] or "").strip()
        result.captions[Path(row["path"]).name] = got
        if got == caption:
            result.reversed_correct += backwards
            result.correct += not backwards
        else:
            result.mistakes.append((Path(row["path"]).name, caption, got))
    return result
