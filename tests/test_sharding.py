"""`--shard I/N` and `tarsier merge`: N shard runs plus a merge write what one run writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.inputs.sharding import Shard, shard_of
from tarsier_batch.outputs.schema import PROVENANCE_KEY

runner = CliRunner()


def caption(model: Path, out: Path, *inputs: Path | str, shard: str | None = None, extra: tuple[str, ...] = ()):
    args = ["caption", *map(str, inputs), "--model", str(model), "--max-new-tokens", "6", "--with-token-ids",
            "--workers", "1", "-o", str(out), "--quiet", *extra]
    done = runner.invoke(app, args + (["--shard", shard] if shard else []))
    assert done.exit_code in (0, 1), done.output
    return done


def rows_without_timing(path: Path) -> list[dict]:
    return pq.read_table(path).drop(["elapsed_s"]).to_pylist()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, shared_media: Path) -> list[Path]:
    """sample_data, the shared media and a file that fails to decode (an error row)."""
    folder = tmp_path_factory.mktemp("broken")
    (folder / "broken.mp4").write_bytes(b"not a video at all")
    return [SAMPLE_DATA, shared_media, folder]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, inputs: list[Path]) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    for index in range(3):
        caption(tiny_model_dir, folder / f"shard-{index}.parquet", *inputs, shard=f"{index}/3")
    return folder


def test_three_shards_merged_equal_one_run_and_the_merge_resumes(shards: Path, tiny_model_dir: Path,
                                                                  inputs: list[Path], tmp_path: Path) -> None:
    single = tmp_path / "single.parquet"
    caption(tiny_model_dir, single, *inputs)
    merged = tmp_path / "merged.parquet"
    done = runner.invoke(app, ["merge", str(shards), "-o", str(merged)])
    assert done.exit_code == 0, done.output
    expected = rows_without_timing(single)
    assert rows_without_timing(merged) == expected   # captions, token ids, metadata, order
    assert sum(row["error"] is not None for row in expected) == 1 and len(expected) > 20
    sizes = [pq.read_metadata(shards / f"shard-{index}.parquet").num_rows for index in range(3)]
    assert sum(sizes) == len(expected) and min(sizes) > 0
    assert f"merged 3 shards into {merged} ({len(expected)} rows, 1 failed)" in done.output
    provenance = json.loads(pq.read_schema(merged).metadata[PROVENANCE_KEY.encode()])
    assert "shard" not in provenance and provenance["settings"]["shard"] is None and provenance["merged_shards"] == 3
    # A run without --shard continues the merged file: nothing is left to do.
    plan = runner.invoke(app, ["caption", *map(str, inputs), "--model", str(tiny_model_dir), "--max-new-tokens", "6",
                               "--with-token-ids", "-o", str(merged), "--dry-run"])
    assert plan.exit_code == 0, plan.output
    actions = [line.split("\t")[0] for line in plan.stdout.splitlines()]
    assert len(actions) >= len(expected) and set(actions) == {"skip"}


def picture(path: Path, shade: int) -> Path:
    Image.new("RGB", (32, 24), (shade, 255 - shade, 90)).save(path)
    return path


def test_a_growing_folder_keeps_earlier_items_in_their_shard(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pictures"
    folder.mkdir()
    first = [picture(folder / f"a{number:02d}.png", number * 20) for number in range(8)]
    out = tmp_path / "shards"
    for index in range(2):
        caption(tiny_model_dir, out / f"s{index}.parquet", folder, shard=f"{index}/2")
    # New files that all fall in shard 0: shard 1 has nothing to caption when the folder grows,
    # but its output must still learn the new input order for the merge.
    added = [name for name in (f"b{number:03d}.png" for number in range(200))
             if shard_of(str(folder / name), 2) == 0][:3]
    for number, name in enumerate(added):
        picture(folder / name, 200 - number * 30)
    for index in range(2):
        plan = runner.invoke(app, ["caption", str(folder), "--model", str(tiny_model_dir), "--max-new-tokens", "6",
                                   "--with-token-ids", "-o", str(out / f"s{index}.parquet"), "--shard", f"{index}/2",
                                   "--dry-run"])
        lines = [line.split("\t") for line in plan.stdout.splitlines()]
        earlier = [path for path in first if shard_of(str(path), 2) == index]
        assert [(action, Path(path).name) for action, path, _ in lines if action == "skip"] == \
            [("skip", path.name) for path in earlier]
        assert [Path(path).name for action, path, _ in lines if action == "caption"] == (added if index == 0 else [])
    caption(tiny_model_dir, out / "s0.parquet", folder, shard="0/2")
    stale = runner.invoke(app, ["merge", str(out), "-o", str(tmp_path / "stale.parquet")])
    assert stale.exit_code == 2 and "the folder changed between their runs" in stale.output
    caption(tiny_model_dir, out / "s1.parquet", folder, shard="1/2")
    done = runner.invoke(app, ["merge", str(out), "-o", str(tmp_path / "all.jsonl")])
    assert done.exit_code == 0, done.output
    single = tmp_path / "single.jsonl"
    caption(tiny_model_dir, single, folder)
    merged = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in single.read_text().splitlines()]
    assert [Path(row["path"]).name for row in merged] == sorted(path.name for path in first) + sorted(added)
    assert [{**row, "elapsed_s": 0} for row in merged] == [{**row, "elapsed_s": 0} for row in expected]


def with_provenance(source: Path, target: Path, change) -> None:
    table = pq.read_table(source)
    provenance = json.loads(table.schema.metadata[PROVENANCE_KEY.encode()])
    change(provenance)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata,
                                                 PROVENANCE_KEY.encode(): json.dumps(provenance).encode()}), target)


def set_setting(name: str, value):
    return lambda provenance: provenance["settings"].__setitem__(name, value)


@pytest.mark.parametrize("arrange, message", [
    (lambda d: (d / "shard-1.parquet").unlink(), "shard 1 of 3 is missing from the folder"),
    (lambda d: shutil.copy(d / "shard-1.parquet", d / "copy.parquet"),
     "shard 1/3 twice: copy.parquet and shard-1.parquet"),
    (lambda d: with_provenance(d / "shard-2.parquet", d / "shard-2.parquet", set_setting("prompt", "Other.")),
     "shard-2.parquet was made with other settings than shard-0.parquet (prompt None there, 'Other.' here)"),
    (lambda d: with_provenance(d / "shard-2.parquet", d / "shard-2.parquet",
                               lambda p: p["shard"].__setitem__("inputs", 99)), "the shards saw different inputs"),
    (lambda d: with_provenance(d / "shard-2.parquet", d / "shard-2.parquet", lambda p: p.pop("shard")),
     "shard-2.parquet is not the output of a tarsier caption --shard run"),
    (lambda d: pq.write_table(pq.read_table(d / "shard-2.parquet").slice(1), d / "shard-2.parquet"),
     "shard-2.parquet was changed after tarsier wrote it"),
    (lambda d: pq.write_table(pa.table({"x": [1]}), d / "notes.parquet"), "notes.parquet is not the output"),
])
def test_merge_refuses_what_is_not_one_complete_consistent_set(shards: Path, tmp_path: Path, arrange,
                                                               message: str) -> None:
    folder = tmp_path / "set"
    shutil.copytree(shards, folder)
    arrange(folder)
    done = runner.invoke(app, ["merge", str(folder), "-o", str(tmp_path / "all.parquet")])
    assert done.exit_code == 2 and message in done.output, done.output
    assert not (tmp_path / "all.parquet").exists()


@pytest.mark.parametrize("args, message", [
    (["--shard", "3/3"], "--shard 3/3: I must be 0 to N-1"),
    (["--shard", "1-3"], "--shard '1-3': give I/N"),
    (["--shard", "0/0"], "--shard 0/0: I must be 0 to N-1"),
    (["--shard", "0/2", "-o", "r.jsonl"], "--shard writes one Parquet file (or WebDataset folder) per shard"),
])
def test_a_wrong_shard_flag_stops_at_once(args: list[str], message: str, tmp_path: Path) -> None:
    out = ["-o", str(tmp_path / "r.parquet")] if "-o" not in args else []
    done = runner.invoke(app, ["caption", "no-such-input", *out, *args])
    assert done.exit_code == 2 and message in done.output and len(done.output.strip().splitlines()) == 1, done.output


def test_shards_are_the_same_on_every_machine_and_balanced(tmp_path: Path) -> None:
    """SHA-256 of the resolved path, not Python's per-process salted hash()."""
    # A fixed folder, not tmp_path: the counts then do not depend on a random folder name (with one, a shard
    # of 2,000 paths sometimes held 300).
    paths = [f"/data/videos/clip{number}.mp4" for number in range(2000)]
    script = ("import sys; from tarsier_batch.inputs.sharding import shard_of; "
              "print([shard_of(p, 8) for p in sys.argv[1:]])")
    seen = {subprocess.run([sys.executable, "-c", script, *paths[:50]], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert seen == {f"{[shard_of(path, 8) for path in paths[:50]]}\n"}
    counts = [sum(shard_of(path, 8) == index for path in paths) for index in range(8)]
    assert min(counts) > 200 and max(counts) < 300   # 250 each on average (225 to 264 for these paths)
    assert str(Shard.parse(" 2/8 ")) == "2/8"
    assert shard_of(str(tmp_path / "." / "clip1.mp4"), 8) == shard_of(str(tmp_path / "clip1.mp4"), 8)   # resolved
