"""Fitting into data pipelines: manifests, output formats, stdout, shards, dry-run, --limit, config and env."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import caption_probe
from tarsier_batch.cli import app
from tarsier_batch.outputs.schema import PROVENANCE_KEY

runner = CliRunner()
NAMES = ["clip_5f.gif", "tarsier_logo.jpg", "short_5f.mp4"]
STABLE = ["path", "key", "caption", "frame_indices", "generated_tokens", "error"]


def caption(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, ["caption", *args], env=env)


def tarsier(*args: str, stdin: bytes | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed command in a real process (real pipes, real stdout)."""
    return subprocess.run([sys.executable, "-m", "tarsier_batch.cli", *args], input=stdin, capture_output=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def stable(rows: list[dict]) -> list[dict]:
    return [{name: row[name] for name in STABLE} for row in rows]


@pytest.fixture
def media(shared_media: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    for name in NAMES:
        shutil.copy(shared_media / name, folder / name)
    return folder


@pytest.fixture
def reference(tiny_model_dir: Path, media: Path, tmp_path: Path) -> list[dict]:
    """The rows of a plain Parquet run over `media`, to compare every other output with."""
    out = tmp_path / "reference.parquet"
    result = caption(str(media), "--model", str(tiny_model_dir), "-o", str(out), "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    return pq.read_table(out).to_pylist()


def write_manifest(path: Path, rows: list[dict]) -> None:
    suffix = path.suffix
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter="\t" if suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows(rows)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_manifest_rows_with_prompts_and_kept_columns(tiny_model_dir: Path, media: Path, tmp_path: Path,
                                                     suffix: str) -> None:
    manifest = media / f"list{suffix}"   # relative paths resolve against the manifest's folder
    write_manifest(manifest, [
        {"video": "short_5f.mp4", "label": "cat", "caption": "an old caption", "prompt": "What moves?"},
        {"video": "clip_5f.gif", "label": "dog", "caption": "", "prompt": ""},
        {"video": "notes.txt", "label": "x", "caption": "", "prompt": ""},
    ])
    out = tmp_path / "r.parquet"
    result = caption("--manifest", str(manifest), "--keep-columns", "all", "--model", str(tiny_model_dir),
                     "-o", str(out), "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "manifest column 'caption' is an output column too; kept as 'input_caption'" in result.output
    table = pq.read_table(out)
    assert table.column_names[-3:] == ["video", "label", "input_caption"]
    rows = table.to_pylist()
    assert [row["path"] for row in rows] == [str(media / "short_5f.mp4"), str(media / "clip_5f.gif")]  # row order
    assert [row["video"] for row in rows] == ["short_5f.mp4", "clip_5f.gif"]
    assert [row["label"] for row in rows] == ["cat", "dog"]
    assert rows[0]["prompt"] == "What moves?" and rows[1]["prompt"] == "Describe the video in detail."
    assert rows[0]["input_caption"] == "an old caption" and all(row["error"] is None for row in rows)
    assert "skipped 1 (1 .txt)" in result.output


def test_manifest_prompt_changes_recaption_and_edited_columns_show(tiny_model_dir: Path, media: Path,
                                                                   tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    out = tmp_path / "r.parquet"
    args = ["--manifest", str(manifest), "--keep-columns", "label", "--model", str(tiny_model_dir), "-o", str(out),
            "--max-new-tokens", "3"]
    write_manifest(manifest, [{"path": str(media / "tarsier_logo.jpg"), "label": 1, "prompt": "Who?"},
                              {"path": str(media / "clip_5f.gif"), "label": 2, "prompt": "What?"}])
    assert caption(*args).exit_code == 0
    assert pq.read_table(out).schema.field("label").type == pa.int64()   # JSONL keeps its types
    write_manifest(manifest, [{"path": str(media / "tarsier_logo.jpg"), "label": 10, "prompt": "Who?"},
                              {"path": str(media / "clip_5f.gif"), "label": 2, "prompt": "Where?"}])
    again = caption(*args)
    assert again.exit_code == 0 and "captioned 1" in again.output and "done earlier 1" in again.output
    rows = pq.read_table(out).to_pylist()
    assert [row["label"] for row in rows] == [10, 2] and rows[1]["prompt"] == "Where?"


@pytest.mark.parametrize(("rows", "flags", "message"), [
    ([{"file": "a.mp4"}], [], "has none of the columns path, file_name, video, image; name the column"),
    ([{"file": "a.mp4"}], ["--path-column", "f"], "--path-column 'f' is not a column"),
    ([{"path": "a.mp4"}, {"path": "./a.mp4"}], [], "row 2 repeats the path of row 1"),
    ([{"path": "a.mp4"}], ["--keep-columns", "nope"], "--keep-columns: nope not in"),
    ([{"path": ""}], [], "row 1 has no path"),
])
def test_manifest_problems_are_one_line_usage_errors(tmp_path: Path, rows: list[dict], flags: list[str],
                                                     message: str) -> None:
    manifest = tmp_path / "m.csv"
    write_manifest(manifest, rows)
    result = caption("--manifest", str(manifest), "-o", str(tmp_path / "r.parquet"), *flags)
    assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1, result.output


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_text_outputs_hold_the_same_rows_and_resume(tiny_model_dir: Path, media: Path, tmp_path: Path,
                                                    reference: list[dict], suffix: str) -> None:
    out = tmp_path / f"r{suffix}"
    args = [str(media), "--model", str(tiny_model_dir), "-o", str(out), "--max-new-tokens", "3"]
    assert caption(*args).exit_code == 0
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    else:
        rows = list(csv.DictReader(out.open()))
        for row in rows:
            row["frame_indices"] = json.loads(row["frame_indices"])
            row["generated_tokens"] = int(row["generated_tokens"])
            row["error"] = row["error"] or None
    assert stable(rows) == stable(reference)
    meta = json.loads((tmp_path / f"r{suffix}.meta.json").read_text())
    assert meta[PROVENANCE_KEY]["settings"]["max_new_tokens"] == 3
    stamp = out.stat().st_mtime_ns
    again = caption(*args)
    assert again.exit_code == 0 and "done earlier 3" in again.output and out.stat().st_mtime_ns == stamp
    shutil.copy(media / "tarsier_logo.jpg", media / "another.jpg")
    grown = caption(*args)
    assert grown.exit_code == 0 and "captioned 1" in grown.output and "done earlier 3" in grown.output
    assert len(out.read_text().splitlines()) == 4 + (suffix == ".csv")


def test_unknown_output_suffix_and_out_conflicts_are_refused_at_once(tmp_path: Path) -> None:
    for flags, message in [(["-o", str(tmp_path / "r.txt")], "unknown format '.txt'; name it .parquet, .jsonl or .csv"),
                           ([], "give --out FILE"),
                           (["-o", "a.parquet", "--out-dir", str(tmp_path)], "not both"),
                           (["-o", "a.parquet", "--shard-rows", "5"], "--shard-rows needs --out-dir"),
                           (["-o", "-", "--retry-errors"], "'-o -' streams to stdout"),
                           (["-o", "a.parquet", "--keep-columns", "x"], "--keep-columns needs --manifest")]:
        result = caption(str(tmp_path), *flags)
        assert result.exit_code == 2 and message in result.output, (flags, result.output)


@pytest.mark.long
def test_stdout_streams_json_lines_in_input_order(tiny_model_dir: Path, media: Path, reference: list[dict]) -> None:
    # Input order differs from both name order and finishing order: the image is done first.
    paths = [media / "short_5f.mp4", media / "clip_5f.gif", media / "tarsier_logo.jpg"]
    done = tarsier("caption", "-", "-0", "--model", str(tiny_model_dir), "-o", "-", "--max-new-tokens", "3",
                   stdin=b"".join(os.fsencode(path) + b"\0" for path in paths))
    assert done.returncode == 0, done.stderr.decode()
    rows = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [row["path"] for row in rows] == [str(path) for path in paths]
    by_path = {row["path"]: row for row in reference}
    assert stable(rows) == stable([by_path[str(path)] for path in paths])
    assert b"captioning 3 items" in done.stderr and b"output stdout (3 rows)" in done.stderr
    assert not list(media.parent.glob(".*tarsier*"))   # a stream leaves no work directory or lock


@pytest.mark.long
def test_stdout_closed_early_stops_quietly_with_141(tiny_model_dir: Path, media: Path) -> None:
    # Rows of 100 kB (a kept manifest column): more than the pipe and head's read can take, so the tool is
    # still writing when head exits, whatever the timing (with small rows it could finish first and exit 0).
    manifest = media / "list.jsonl"
    write_manifest(manifest, [{"path": name, "note": "x" * 100_000} for name in NAMES])
    command = (f"{sys.executable} -m tarsier_batch.cli caption --manifest {manifest} --keep-columns note "
               f"--model {tiny_model_dir} -o - --max-new-tokens 3 2>err.txt | head -n 1; echo \"${{PIPESTATUS[0]}}\"")
    done = subprocess.run(["bash", "-c", command], capture_output=True, cwd=media.parent, timeout=300)
    first, code = done.stdout.decode().splitlines()
    assert json.loads(first)["path"] == str(media / "clip_5f.gif") and code == "141"
    errors = (media.parent / "err.txt").read_text()
    assert "stdout was closed" in errors and "Traceback" not in errors and "BrokenPipe" not in errors


def test_out_dir_writes_shards_with_metadata_and_resumes(tiny_model_dir: Path, media: Path, tmp_path: Path,
                                                         reference: list[dict]) -> None:
    shards = tmp_path / "shards"
    args = [str(media), "--model", str(tiny_model_dir), "--out-dir", str(shards), "--shard-rows", "2",
            "--max-new-tokens", "3"]
    assert caption(*args).exit_code == 0
    assert sorted(path.name for path in shards.iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    table = pq.read_table(shards)   # the folder reads as one dataset
    assert stable(table.to_pylist()) == stable(reference)
    assert json.loads(pq.read_table(shards / "part-00001.parquet").schema.metadata[PROVENANCE_KEY.encode()])
    assert pq.ParquetFile(shards / "part-00000.parquet").metadata.row_group(0).column(0).compression == "ZSTD"
    again = caption(*args)
    assert again.exit_code == 0 and "done earlier 3" in again.output
    (shards / "notes.txt").write_text("mine")
    refused = caption(*args)
    assert refused.exit_code == 2 and "holds other files (notes.txt)" in refused.output


def test_dry_run_lists_actions_and_reasons_without_loading(tiny_model_dir: Path, media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    args = [str(media), "--model", str(tiny_model_dir), "-o", str(out), "--max-new-tokens", "3"]
    assert caption(*args, "--limit", "2").exit_code == 0   # two captioned, one left for later
    (media / "notes.txt").write_text("hello")
    shutil.copy(media / "tarsier_logo.jpg", media / "copy.jpg")
    done = tarsier("caption", *args, "--dry-run")
    assert done.returncode == 0, done.stderr.decode()
    lines = [line.split("\t") for line in done.stdout.decode().splitlines()]
    assert lines == [["skip", str(media / "clip_5f.gif"), "done earlier"],
                     ["caption", str(media / "copy.jpg"), "new"],
                     ["skip", str(media / "short_5f.mp4"), "done earlier"],
                     ["caption", str(media / "tarsier_logo.jpg"), "new"],
                     ["skip", str(media / "notes.txt"), "not media (.txt)"]]
    assert done.stderr.decode().strip() == ("tarsier: dry run, nothing loaded or written: skip 3 (2 done earlier, "
                                            "1 not media); caption 2 (2 new)")
    limited = tarsier("caption", *args, "--dry-run", "--limit", "1")
    assert [line.split("\t")[0] for line in limited.stdout.decode().splitlines()] == \
        ["skip", "caption", "skip", "later", "skip"]
    assert not list(tmp_path.glob(".r.parquet*"))   # no lock, no work directory


def test_dry_run_on_ten_thousand_files_imports_no_model_code(tmp_path: Path) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for index in range(10_000):
        (folder / f"{index:05d}.jpg").touch()
    probe = ("import sys, runpy; sys.argv = ['tarsier'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('tarsier_batch.cli', run_name='__main__')\n"
             "except SystemExit as stop:\n"
             "    heavy = sorted(m for m in ('torch', 'transformers', 'decord', 'av') if m in sys.modules)\n"
             "    print('HEAVY', heavy, 'CODE', stop.code, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, "caption", str(folder), "-o", str(tmp_path / "r.parquet"),
                           "--dry-run"], capture_output=True, timeout=120)
    assert done.stdout.decode().count("\tnew\n") == 10_000
    assert "HEAVY [] CODE 0" in done.stderr.decode()


@pytest.mark.parametrize("flags", [["--device", "gpu"], ["--prompt", "  "], ["--top-p", "0"], ["--dtype", "half"],
                                   ["--frames", "0"], ["--config", "missing.toml"], ["--manifest", "m.xlsx"],
                                   ["--prune-vision", "1"], ["--prune-layer", "2"],
                                   ["--prune-vision", "0.5", "--prune-layer", "0"],
                                   ["--prune-vision", "0.5", "--prune-method", "fastv", "--offload-kv"],
                                   ["--prune-vision", "0.5", "--prune-method", "temporal", "--prune-layer", "2"]])
def test_bad_flags_are_answered_in_one_line_before_heavy_imports(tmp_path: Path, flags: list[str]) -> None:
    done = caption_probe(tmp_path, *flags)
    assert done.stdout.strip() == "HEAVY False CODE 2"
    assert done.stderr.count("Error") == 1, done.stderr


def test_config_file_then_env_then_flags_decide(monkeypatch, tmp_path: Path, media: Path) -> None:
    """Flags win over environment variables, which win over --config, which wins over built-in defaults."""
    import tarsier_batch.run.caption_run as run

    seen: list[dict] = []

    def record(settings, items=None):
        seen.append({"model": settings.model, "batch_size": settings.batch_size, "workers": settings.workers,
                     "max_new_tokens": settings.sampling.max_new_tokens})
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "load_captioner", record)
    config = tmp_path / "conf" / "job.toml"
    config.parent.mkdir()
    config.write_text('model = "org/from-config"\nbatch-size = 3\nmax_new_tokens = 7\nout = "r.parquet"\n'
                      f'inputs = ["{media}"]\n[caption]\nworkers = 2\n')
    caption("--config", str(config))
    caption("--config", str(config), env={"TARSIER_MODEL": "org/from-env", "TARSIER_BATCH_SIZE": "5"})
    caption("--config", str(config), "--model", "org/from-flag", env={"TARSIER_MODEL": "org/from-env"})
    caption(str(media), "-o", str(tmp_path / "d.parquet"), env={"TARSIER_CONFIG": str(config)})
    assert [(s["model"], s["batch_size"], s["workers"], s["max_new_tokens"]) for s in seen] == [
        ("org/from-config", 3, 2, 7), ("org/from-env", 5, 2, 7), ("org/from-flag", 3, 2, 7),
        ("org/from-config", 3, 2, 7)]
    assert not (config.parent / "r.parquet").exists()   # `out` is relative to the config's folder; interrupted
    unknown = tmp_path / "bad.toml"
    unknown.write_text("modle = 'x'\n")
    result = caption("--config", str(unknown))
    assert result.exit_code == 2 and "unknown setting 'modle'; known:" in result.output


def test_help_shows_env_vars_readable_metavars_and_short_help() -> None:
    result = runner.invoke(app, ["caption", "-h"])
    assert result.exit_code == 0
    shown = " ".join(result.output.split())
    for text in ["env var: TARSIER_MODEL", "env var: TARSIER_DEVICE", "--out FILE", "--batch-size N", "--manifest FILE",
                 "--kv-cache-gb GIB", "-0, --null"]:
        assert text in shown, text
    for python_type in ["<str>", "<int", "<float", "<path>", "list[str]", "INTEGER", "FLOAT"]:
        assert python_type not in shown, python_type
    assert runner.invoke(app, ["--version"]).output.startswith("tarsier-batch ")
    assert "--install-completion" in runner.invoke(app, ["-h"]).output
