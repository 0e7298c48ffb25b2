"""`--out-format webdataset`: captions go back as WebDataset shards, one per input shard, keyed like its members,
read by the webdataset library itself, continued like any output, refused where they cannot be placed."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.outputs.formats import WEBDATASET_SHARDS, OutputError, OutputTarget

runner = CliRunner()
SHARDS = {"00000.tar": [("clip-a", "ball.gif"), ("clip-b", "still.png")],
          "00001.tar": [("clip-c", "portrait.JPG"), ("clip-d", "demo_green_square_shrinks.mp4")]}
STABLE = ["path", "key", "caption", "num_frames", "frame_indices", "generated_tokens", "finish_reason", "error"]


def caption(*args: str):
    return runner.invoke(app, ["caption", *args])


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two input shards written by webdataset's own writer: each sample a medium and a JSON sibling."""
    folder = tmp_path_factory.mktemp("shards")
    for name, samples in SHARDS.items():
        with webdataset.TarWriter(str(folder / name)) as sink:
            for key, medium in samples:
                sink.write({"__key__": key, medium.rsplit(".", 1)[1].lower(): (SAMPLE_DATA / medium).read_bytes(),
                            "json": json.dumps({"source": medium}).encode()})
    return folder


@pytest.fixture
def args(shards: Path, tiny_model_dir: Path) -> list[str]:
    return [str(shards / "{00000..00001}.tar"), "--model", str(tiny_model_dir), "--max-new-tokens", "3"]


@pytest.fixture(scope="module")
def reference(shards: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("reference") / "r.parquet"
    result = caption(str(shards / "{00000..00001}.tar"), "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                     "-o", str(out))
    assert result.exit_code == 0, result.output
    return [{name: row[name] for name in STABLE} for row in pq.read_table(out).to_pylist()]


def samples(path: Path) -> list[dict]:
    """The samples of an output shard as webdataset reads them (json decoded, txt as text)."""
    return list(webdataset.WebDataset(str(path), shardshuffle=False).decode())


def test_each_input_shard_gets_a_shard_of_its_members_captions(args: list[str], shards: Path, tmp_path: Path,
                                                               reference: list[dict]) -> None:
    out = tmp_path / "captions"
    result = caption(*args, "--out-dir", str(out), "--out-format", "webdataset")
    assert result.exit_code == 0, result.output
    assert sorted(entry.name for entry in out.iterdir()) == ["00000.tar", "00001.tar", "tarsier.meta.json"]
    rows = []
    for name, expected in SHARDS.items():
        read = samples(out / name)
        assert [sample["__key__"] for sample in read] == [key for key, _ in expected]   # the input's keys, in order
        for sample, (key, medium) in zip(read, expected):
            row = sample["json"]
            assert row["path"] == f"{shards / name}#{key}.{medium.rsplit('.', 1)[1].lower()}"
            assert sample["txt"] == row["caption"]
            rows.append({column: row[column] for column in STABLE})
    assert rows == reference   # the same rows as a Parquet output of the same run
    meta = json.loads((out / "tarsier.meta.json").read_text())
    assert meta["tarsier_batch"]["settings"]["max_new_tokens"] == 3
    again = caption(*args, "--out-dir", str(out), "--out-format", "webdataset")
    assert again.exit_code == 0 and "captioned 0" in again.output, again.output


def test_a_run_cut_short_is_continued_into_the_same_shards(args: list[str], tmp_path: Path,
                                                           reference: list[dict]) -> None:
    out = tmp_path / "captions"
    first = caption(*args, "--out-dir", str(out), "--out-format", "webdataset", "--limit", "1")
    assert first.exit_code == 0, first.output
    assert [sample["__key__"] for sample in samples(out / "00000.tar")] == ["clip-a"]
    assert not (out / "00001.tar").exists()
    rest = caption(*args, "--out-dir", str(out), "--out-format", "webdataset")
    assert rest.exit_code == 0 and "captioned 3" in rest.output and "done earlier 1" in rest.output, rest.output
    read = samples(out / "00000.tar") + samples(out / "00001.tar")
    assert [{column: sample["json"][column] for column in STABLE} for sample in read] == reference


def test_an_error_row_has_its_json_and_no_txt(tiny_model_dir: Path, tmp_path: Path) -> None:
    shard = tmp_path / "broken.tar"
    with tarfile.open(shard, "w") as tar:
        tar.add(SAMPLE_DATA / "still.png", arcname="good.png")
        data = tmp_path / "bad.mp4"
        data.write_bytes(b"not a video")
        tar.add(data, arcname="bad.mp4")
    out = tmp_path / "captions"
    result = caption(str(shard), "--model", str(tiny_model_dir), "--max-new-tokens", "3", "--out-dir", str(out),
                     "--out-format", "webdataset")
    assert result.exit_code == 1, result.output   # one item failed
    with tarfile.open(out / "broken.tar") as tar:
        assert tar.getnames() == ["good.json", "good.txt", "bad.json"]
        bad = json.loads(tar.extractfile("bad.json").read())
    assert bad["caption"] is None and bad["error"]


def test_report_reads_a_webdataset_output(args: list[str], tmp_path: Path) -> None:
    out = tmp_path / "captions"
    assert caption(*args, "--out-dir", str(out), "--out-format", "webdataset").exit_code == 0
    page = tmp_path / "report.html"
    done = runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "1", "--frames-per-item", "1"])
    assert done.exit_code == 0, done.output
    assert "4 items" in done.output or "4 items" in page.read_text(), done.output


@pytest.mark.parametrize(("extra", "message"), [
    (["--shard-rows", "5"], "--shard-rows does not apply to --out-format webdataset: it writes one tar per input "
                            "shard"),
    (["--segments", "fixed:1s"], "--out-format webdataset writes one sample per member: not with --segments"),
])
def test_settings_it_cannot_honour_are_refused_at_once(args: list[str], tmp_path: Path, extra: list[str],
                                                       message: str) -> None:
    result = caption(*args, "--out-dir", str(tmp_path / "captions"), "--out-format", "webdataset", *extra)
    assert result.exit_code == 2 and result.output.splitlines() == [f"Error: {message}"], result.output
    assert not (tmp_path / "captions").exists()


def test_files_outside_shards_and_a_file_output_are_refused_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    loose = caption(str(SAMPLE_DATA / "still.png"), "--model", str(tiny_model_dir), "--out-dir",
                    str(tmp_path / "captions"), "--out-format", "webdataset")
    assert loose.exit_code == 2
    assert loose.output.splitlines() == [f"Error: --out-format webdataset writes captions beside WebDataset shards: "
                                         f"{SAMPLE_DATA / 'still.png'} is not a member of a .tar shard"]
    to_file = caption(str(SAMPLE_DATA / "still.png"), "--model", str(tiny_model_dir), "-o",
                      str(tmp_path / "r.parquet"), "--out-format", "webdataset")
    assert to_file.exit_code == 2
    assert to_file.output.splitlines() == ["Error: --out-format needs --out-dir (the format of an --out file is its "
                                           "suffix)"]


@pytest.mark.parametrize(("store_fixture", "scheme"), [("s3", "s3"), ("gcs", "gs"), ("azure", "az")])
def test_a_webdataset_output_at_a_url_is_its_shards_and_meta(store_fixture: str, scheme: str, args: list[str],
                                                             reference: list[dict], tmp_path: Path,
                                                             request: pytest.FixtureRequest) -> None:
    store = request.getfixturevalue(store_fixture)
    bucket = store.new_bucket()
    result = caption(*args, "--out-dir", f"{scheme}://{bucket}/captions", "--out-format", "webdataset")
    assert result.exit_code == 0, result.output
    fs = store.filesystem()
    assert sorted(fs.find(bucket)) == [f"{bucket}/captions/{name}" for name in
                                       ("00000.tar", "00001.tar", "tarsier.meta.json")]
    rows = []
    for name in SHARDS:
        local = tmp_path / name
        fs.get_file(f"{bucket}/captions/{name}", str(local))
        rows += [{column: sample["json"][column] for column in STABLE} for sample in samples(local)]
    assert rows == reference


def test_shard_runs_into_webdataset_folders_merge_into_what_one_run_writes(args: list[str], tmp_path: Path,
                                                                          reference: list[dict]) -> None:
    """Two `--shard I/2` runs each write a WebDataset folder (a whole input shard lands in one of them); merged into
    Parquet they give one run's rows in input order, merged into a WebDataset folder one run's shards, which a run
    without --shard then continues with nothing left to do."""
    shards = tmp_path / "shards"
    for index in range(2):
        done = caption(*args, "--out-dir", str(shards / f"shard-{index}"), "--out-format", "webdataset",
                       "--shard", f"{index}/2")
        assert done.exit_code == 0, done.output
    held = [sorted(entry.name for entry in (shards / f"shard-{index}").iterdir() if entry.suffix == ".tar")
            for index in range(2)]
    assert sorted(held[0] + held[1]) == sorted(SHARDS), "each input shard in exactly one shard's folder"
    merged = tmp_path / "merged.parquet"
    result = runner.invoke(app, ["merge", str(shards), "-o", str(merged)])
    assert result.exit_code == 0, result.output
    assert "merged 2 shards" in result.output and "(4 rows, 0 failed)" in result.output, result.output
    assert [{name: row[name] for name in STABLE} for row in pq.read_table(merged).to_pylist()] == reference
    folder = tmp_path / "merged"
    result = runner.invoke(app, ["merge", str(shards), "--out-dir", str(folder), "--out-format", "webdataset"])
    assert result.exit_code == 0, result.output
    assert sorted(entry.name for entry in folder.iterdir()) == ["00000.tar", "00001.tar", "tarsier.meta.json"]
    read = samples(folder / "00000.tar") + samples(folder / "00001.tar")
    assert [{column: sample["json"][column] for column in STABLE} for sample in read] == reference
    meta = json.loads((folder / "tarsier.meta.json").read_text())["tarsier_batch"]
    assert "shard" not in meta and meta["merged_shards"] == 2
    again = caption(*args, "--out-dir", str(folder), "--out-format", "webdataset")
    assert again.exit_code == 0 and "captioned 0" in again.output, again.output
    # A Parquet shard output beside the folders: not one run's set.
    (shards / "shard-2.parquet").write_bytes(b"")
    refused = runner.invoke(app, ["merge", str(shards), "-o", str(tmp_path / "mixed.parquet")])
    assert refused.exit_code == 2
    assert refused.output.splitlines() == [f"Error: {shards} holds .parquet files and WebDataset folders: keep one "
                                           f"run's shard outputs"]
    assert not (tmp_path / "mixed.parquet").exists()


def test_a_shard_run_s_row_positions_follow_its_rows_as_they_are_read_back(tmp_path: Path) -> None:
    """Rows of b.tar before a.tar's (as a manifest may list them): the output holds a.tar first (shards are read
    back by name), so the positions `tarsier merge` pairs with the rows are reordered with them."""
    rows = [{"path": "/in/b.tar#x.png", "caption": "b-x"}, {"path": "/in/a.tar#y.png", "caption": "a-y"},
            {"path": "/in/b.tar#z.png", "caption": "b-z"}]
    schema = pa.schema([("path", pa.string()), ("caption", pa.string())])
    target = OutputTarget(tmp_path / "out", webdataset=True)
    provenance = {"settings": {}, "shard": {"index": 0, "count": 1, "inputs": 3, "positions": [7, 3, 9]}}
    WEBDATASET_SHARDS.write(target, pa.Table.from_pylist(rows, schema=schema), provenance, {},
                            lambda path, write: write(path))
    table, stored, _ = WEBDATASET_SHARDS.read(target, schema)
    assert table.column("caption").to_pylist() == ["a-y", "b-x", "b-z"]
    assert stored["shard"]["positions"] == [3, 7, 9]
    assert provenance["shard"]["positions"] == [7, 3, 9], "the caller's provenance is left as it was"


def test_rows_from_no_shard_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """What a merge of loose files' shard outputs into --out-format webdataset meets: no folder is made."""
    target = OutputTarget(tmp_path / "out", webdataset=True)
    table = pa.Table.from_pylist([{"path": "/in/a.tar#y.png"}, {"path": "/in/loose.png"}])
    with pytest.raises(OutputError, match="the row of /in/loose.png comes from no .tar shard"):
        WEBDATASET_SHARDS.write(target, table, {"settings": {}}, {}, lambda path, write: write(path))
    assert not target.path.exists()
