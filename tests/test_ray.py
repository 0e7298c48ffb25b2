"""`tarsier caption --ray`: on a local Ray cluster, the rows a single-process run writes; resume; a dying actor.

The cluster tests are marked `ray` (a local cluster takes a while to start on 2 cores): run them
with `python -m pytest -m ray` after `pip install -e ".[test,ray]"` (.ci/run does).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.outputs.formats import OutputTarget, read_results
from tarsier_batch.outputs.schema import PROVENANCE_KEY, OutputColumns
from tarsier_batch.version import install_extra_command
from test_damaged_files import write_small_cut

runner = CliRunner()
FAULT_SUBSTRING = "actor-dies-here"
CRASH_SUBSTRING = "decoder-crashes-here"


def caption(model: Path, *args: str):
    return runner.invoke(app, ["caption", "--model", str(model), "--max-new-tokens", "6", "--with-token-ids",
                               "--device", "cpu", *args])


def ray_rows(out_dir: Path) -> list[dict]:
    table, _, _ = read_results(OutputTarget.existing(out_dir), OutputColumns(with_token_ids=True).schema())
    return table.drop(["elapsed_s"]).to_pylist()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, s3_server):
    """A local Ray cluster on 2 CPUs; its workers get the fault hooks for the items named FAULT_SUBSTRING
    (the captioning actor dies once) and CRASH_SUBSTRING (the decoder segfaults), and the local S3 server as their
    endpoint (as a real cluster's nodes get theirs from their own environment)."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    marker = tmp_path_factory.mktemp("fault") / "died"
    ray.init(num_cpus=2, log_to_driver=False, runtime_env={"env_vars": {
        "TARSIER_BATCH_RAY_FAULT": f"die-once:{FAULT_SUBSTRING}:{marker}",
        "TARSIER_BATCH_FAULT": f"segfault:{CRASH_SUBSTRING}", "AWS_ENDPOINT_URL": s3_server.endpoint}})
    yield marker
    ray.shutdown()


@pytest.mark.ray
def test_ray_rows_equal_the_single_process_rows_and_a_rerun_resumes(cluster: Path, tiny_model_dir: Path,
                                                                     shared_media: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "broken.mp4").write_bytes(b"not a video at all")
    inputs = [str(SAMPLE_DATA), str(shared_media), str(broken)]
    single = tmp_path / "single.parquet"
    assert caption(tiny_model_dir, *inputs, "-o", str(single), "--quiet").exit_code == 1   # the broken file
    out = tmp_path / "ray-out"
    done = caption(tiny_model_dir, *inputs, "--ray", "local", "--out-dir", str(out))
    assert done.exit_code == 1, done.output
    expected = pq.read_table(single).drop(["elapsed_s"]).to_pylist()
    assert ray_rows(out) == expected   # captions, token ids, metadata, one row per input, in input order
    assert f"captioned {len(expected) - 1}; failed 1" in done.output
    provenance = json.loads(pq.read_schema(next(out.glob("part-*.parquet"))).metadata[PROVENANCE_KEY.encode()])
    single_provenance = json.loads(pq.read_schema(single).metadata[PROVENANCE_KEY.encode()])
    assert provenance["settings"] == single_provenance["settings"] and provenance["runner"] == "ray"
    parts = sorted(out.glob("part-*.parquet"))
    again = caption(tiny_model_dir, *inputs, "--ray", "local", "--out-dir", str(out))
    assert again.exit_code == 0 and f"captioned 0; failed 0; done earlier {len(expected)}" in again.output
    assert "on Ray" not in again.output   # nothing to caption: no cluster is joined
    assert sorted(out.glob("part-*.parquet")) == parts
    shutil.copy(SAMPLE_DATA / "still.png", broken / "new.png")
    grown = caption(tiny_model_dir, *inputs, "--ray", "local", "--out-dir", str(out), "--retry-errors")
    assert "captioning 2 items on Ray" in grown.output, grown.output   # the new file and the error row
    rows = ray_rows(out)
    assert len(rows) == len(expected) + 1 and {row["path"] for row in rows} == {row["path"] for row in expected} | \
        {str((broken / "new.png").resolve())}


@pytest.mark.ray
def test_ray_rows_of_a_damaged_file_carry_its_warnings(cluster: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ray-out"
    done = caption(tiny_model_dir, str(write_small_cut(tmp_path / "in")), "--ray", "local", "--out-dir", str(out))
    assert done.exit_code == 0, done.output
    assert [row["warnings"] for row in ray_rows(out)] == [["cut_short"]]
    assert "with warnings 1 (cut_short 1" in done.output


@pytest.mark.ray
def test_a_manifest_on_ray_keeps_its_columns_and_prompts_and_captions_each_content_once(
        cluster: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """--manifest with kept columns and a row's own prompt, --key sha256 with a copied file: the rows a single
    run writes; the copy is captioned once; a copy added later is not captioned at all."""
    clips = tmp_path / "clips"
    clips.mkdir()
    shutil.copy(SAMPLE_DATA / "ball_h264.mp4", clips / "a.mp4")
    shutil.copy(SAMPLE_DATA / "ball_h264.mp4", clips / "a-copy.mp4")
    shutil.copy(SAMPLE_DATA / "ball.gif", clips / "b.gif")
    shutil.copy(SAMPLE_DATA / "still.png", clips / "c.png")
    manifest = tmp_path / "list.csv"
    lines = ["video,id,prompt", "clips/a.mp4,1,", "clips/a-copy.mp4,2,", "clips/b.gif,3,What moves?", "clips/c.png,4,"]
    manifest.write_text("\n".join(lines) + "\n")
    flags = ["--manifest", str(manifest), "--keep-columns", "id", "--key", "sha256"]
    single = tmp_path / "single.parquet"
    assert caption(tiny_model_dir, *flags, "-o", str(single), "--quiet").exit_code == 0
    out = tmp_path / "ray-out"
    done = caption(tiny_model_dir, *flags, "--ray", "local", "--out-dir", str(out))
    assert done.exit_code == 0, done.output
    assert "captioning 3 items on Ray" in done.output and "captioned 4; failed 0" in done.output   # one a copy

    def by_path(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda row: row["path"])

    expected = pq.read_table(single).drop(["elapsed_s"]).to_pylist()
    assert by_path(ray_rows(out)) == by_path(expected)
    rows = {Path(row["path"]).name: row for row in expected}
    assert rows["a-copy.mp4"]["caption"] == rows["a.mp4"]["caption"] and rows["a-copy.mp4"]["id"] == "2"
    assert rows["b.gif"]["prompt"] == "What moves?"

    shutil.copy(SAMPLE_DATA / "still.png", clips / "c-copy.png")
    manifest.write_text("\n".join([*lines, "clips/c-copy.png,5,"]) + "\n")
    again = caption(tiny_model_dir, *flags, "--ray", "local", "--out-dir", str(out))
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 5" in again.output, again.output
    assert "on Ray" not in again.output   # the copy's row is the captioned file's: nothing to caption
    added = {Path(row["path"]).name: row for row in ray_rows(out)}["c-copy.png"]
    assert added["caption"] == rows["c.png"]["caption"] and added["id"] == "5" and added["error"] is None


@pytest.mark.ray
def test_a_dying_actor_is_restarted_and_a_crashing_decoder_is_an_error_row(cluster: Path, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    folder = tmp_path / "pictures"
    folder.mkdir()
    for number in range(6):
        shutil.copy(SAMPLE_DATA / "still.png", folder / f"p{number}.png")
    shutil.copy(SAMPLE_DATA / "still.png", folder / f"{FAULT_SUBSTRING}.png")
    shutil.copy(SAMPLE_DATA / "still.png", folder / f"{CRASH_SUBSTRING}.png")
    out = tmp_path / "ray-out"
    done = caption(tiny_model_dir, str(folder), "--ray", "local", "--out-dir", str(out), "--batch-size", "2",
                   "--ray-workers", "1-2")
    assert done.exit_code == 1, done.output   # the crashed item failed; the run went on
    assert cluster.exists()   # the actor did die (once)
    rows = ray_rows(out)
    assert sorted(Path(row["path"]).name for row in rows) == sorted(path.name for path in folder.iterdir())
    errors = {Path(row["path"]).name: row["error"] for row in rows if row["error"] is not None}
    assert (list(errors) == [f"{CRASH_SUBSTRING}.png"]
            and "the decoder crashed (SIGSEGV" in errors[f"{CRASH_SUBSTRING}.png"]), errors
    assert all(row["caption"] for row in rows if row["error"] is None)


@pytest.mark.parametrize("args, message", [
    (["--out-dir", "d", "--shard", "0/2"], "--ray spreads the items over the cluster itself; leave out --shard"),
    (["--out-dir", "d", "--ray-workers", "4-2"], "--ray-workers '4-2': give a number of actors N >= 1, or MIN-MAX"),
    (["--out-dir", "d", "--ray-workers", "0"], "--ray-workers '0': give a number of actors N >= 1, or MIN-MAX"),
])
def test_wrong_ray_flags_stop_at_once(args: list[str], message: str, tmp_path: Path) -> None:
    done = runner.invoke(app, ["caption", "no-such-input", "--ray", "local",
                               *[str(tmp_path / arg) if arg in ("r.parquet", "d") else arg for arg in args]])
    assert done.exit_code == 2 and message in done.output, done.output


def test_a_setting_the_models_family_cannot_run_is_refused_before_the_cluster_starts(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tarsier v1 samples a fixed count of frames: `--fps` is refused in one line from config.json, on the driver,
    not by every actor as it builds its model."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")

    def start(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cluster starts before the refusal")

    monkeypatch.setattr(ray, "init", start)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    done = caption(tiny_model_dir, str(SAMPLE_DATA / "still.png"), "--ray", "local", "--out-dir",
                   str(tmp_path / "d"), "--fps", "2")
    assert done.exit_code == 2, done.output
    assert "--fps: Tarsier v1 samples a fixed count of frames from every clip" in done.output


def test_ray_without_the_extra_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "ray" else real(name, *rest))
    done = runner.invoke(app, ["caption", "no-such-input", "--ray", "auto", "--out-dir", str(tmp_path / "d")])
    assert done.exit_code == 2 and f"--ray needs Ray, an optional extra: {install_extra_command('ray')}" in done.output


def _decoded_sample_data(captioner) -> tuple[list, list]:
    from tarsier_batch.inputs.sources import discover
    from tarsier_batch.workers.pool import DecodeJob, decode_item

    items = discover([str(SAMPLE_DATA)]).items
    job = DecodeJob(captioner.model.processor, captioner.frames, None)
    return items, [decode_item(job, index, item) for index, item in enumerate(items)]


def _service_captioner(model: Path, batch_size: int, max_new_tokens: int):
    from tarsier_batch.api import Captioner, CaptionSettings
    from tarsier_batch.engine import SamplingParams

    return Captioner(CaptionSettings(model=str(model), sampling=SamplingParams(max_new_tokens=max_new_tokens),
                                     batch_size=batch_size, workers=1, isolate_decoding=False, device="cpu"))


def _summary(results) -> list[tuple]:
    return [(result.path, result.caption, result.generated_ids, result.error) for result in results]


def test_the_caption_service_gives_what_caption_gives_to_callers_on_two_threads(tiny_model_dir: Path) -> None:
    """The seam a Ray actor uses: items decoded elsewhere, handed in by two threads at once, come back to
    each caller in its order with exactly a normal run's results."""
    from concurrent.futures import ThreadPoolExecutor

    captioner = _service_captioner(tiny_model_dir, batch_size=3, max_new_tokens=6)
    items, decoded = _decoded_sample_data(captioner)
    expected = _summary(captioner.caption(items))
    service = captioner.serve()
    halves = [decoded[0::2], decoded[1::2]]
    with ThreadPoolExecutor(2) as callers:
        got = list(callers.map(service.caption, halves))
    service.close()
    assert _summary(got[0]) == expected[0::2] and _summary(got[1]) == expected[1::2]
    assert len(items) > 5 and sum(1 for row in expected if row[3] is None and row[2]) >= 5


def test_a_second_callers_items_join_the_first_callers_running_rows(tiny_model_dir: Path) -> None:
    """Continuous batching across an actor's calls: the second caller's two items join the first caller's
    two running rows (4 rows in one step), and every result is what the item gets alone."""
    import threading

    captioner = _service_captioner(tiny_model_dir, batch_size=4, max_new_tokens=12)
    _, decoded = _decoded_sample_data(captioner)
    videos = [one for one in decoded if one.error is None][:4]
    alone = captioner.serve()
    expected = [_summary(alone.caption([one])) for one in videos]
    alone.close()

    engine = captioner.engine
    first_step, second_handed_in = threading.Event(), threading.Event()
    rows_per_step: list[int] = []
    real_step = engine.step

    def step(*args):
        if not first_step.is_set():   # the first step, with only the first caller's rows, waits for the second
            first_step.set()
            assert second_handed_in.wait(60)
        finished = real_step(*args)
        rows_per_step.append(len(engine.scheduler.running) + len(finished))
        return finished

    engine.step = step
    service = captioner.serve()
    first = service.submit(videos[:2])
    assert first_step.wait(60)
    second = service.submit(videos[2:])
    second_handed_in.set()
    got = [_summary([future.result()]) for future in first + second]
    service.close()
    assert got == expected
    assert max(rows_per_step) == 4 and rows_per_step[0] <= 2, rows_per_step
    assert all(row[2] and len(row[2]) > 1 for [row] in got)   # rows ran several steps, so they overlapped


def test_a_failed_engine_fails_every_caller_of_the_service(tiny_model_dir: Path) -> None:
    """A run-level failure (a lost device) reaches the caller waiting and every later one: none waits forever."""
    captioner = _service_captioner(tiny_model_dir, batch_size=2, max_new_tokens=4)
    _, decoded = _decoded_sample_data(captioner)

    def lost_device(*args):
        raise RuntimeError("CUDA error: device-side assert triggered")

    captioner.engine.step = lost_device
    service = captioner.serve()
    with pytest.raises(RuntimeError, match="device-side assert"):
        service.caption(decoded[:2])
    with pytest.raises(RuntimeError, match="the caption service stopped earlier"):
        service.caption(decoded[2:3])


@pytest.mark.ray
def test_ray_writes_any_output_a_single_run_writes(cluster: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The run writes what the cluster captions: a JSON Lines file (and its provenance) as a single run does;
    --prune-missing drops the row of a file that went away."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("still.png", "ball.gif"):
        shutil.copy(SAMPLE_DATA / name, folder / name)
    single, on_ray = tmp_path / "single.jsonl", tmp_path / "ray.jsonl"
    assert caption(tiny_model_dir, str(folder), "-o", str(single), "--quiet").exit_code == 0
    done = caption(tiny_model_dir, str(folder), "--ray", "local", "-o", str(on_ray))
    assert done.exit_code == 0, done.output

    def rows(path: Path) -> list[dict]:
        return [{**row, "elapsed_s": None} for row in map(json.loads, path.read_text().splitlines())]

    assert rows(on_ray) == rows(single) and len(rows(single)) == 2
    meta = json.loads((tmp_path / "ray.jsonl.meta.json").read_text())[PROVENANCE_KEY]
    assert meta["runner"] == "ray" and meta["settings"] == json.loads(
        (tmp_path / "single.jsonl.meta.json").read_text())[PROVENANCE_KEY]["settings"]
    (folder / "ball.gif").unlink()
    pruned = caption(tiny_model_dir, str(folder), "--ray", "local", "-o", str(on_ray), "--prune-missing")
    assert pruned.exit_code == 0 and [Path(row["path"]).name for row in rows(on_ray)] == ["still.png"], pruned.output


@pytest.mark.ray
def test_a_prompt_set_on_ray_writes_the_single_process_rows_and_resumes_with_a_new_question(
        cluster: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    inputs = [str(SAMPLE_DATA / name) for name in ("ball.gif", "still.png", "ball_h264.mp4")]
    asks = ["--ask", "caption=Describe the video in detail.", "--ask", "objects=List the objects."]
    single = tmp_path / "single.parquet"
    assert caption(tiny_model_dir, *inputs, *asks, "-o", str(single), "--quiet").exit_code == 0
    out = tmp_path / "ray-out"
    done = caption(tiny_model_dir, *inputs, *asks, "--ray", "local", "--out-dir", str(out))
    assert done.exit_code == 0, done.output
    columns = OutputColumns(with_token_ids=True, questions=("caption", "objects", "camera"))

    def rows(schema_of: OutputColumns) -> list[dict]:
        table, _, _ = read_results(OutputTarget.existing(out), schema_of.schema())
        return table.drop(["elapsed_s"]).to_pylist()

    expected = pq.read_table(single).drop(["elapsed_s"]).to_pylist()
    assert rows(OutputColumns(with_token_ids=True, questions=("caption", "objects"))) == expected
    more = caption(tiny_model_dir, *inputs, *asks, "--ask", "camera=How does the camera move?", "--ray", "local",
                   "--out-dir", str(out))
    assert more.exit_code == 0 and "captioning 3 items on Ray" in more.output, more.output
    grown = rows(columns)
    assert [(row["caption"], row["objects"]) for row in grown] == [(row["caption"], row["objects"]) for row in expected]
    assert all(row["camera_prompt"] == "How does the camera move?" and row["camera_generated_tokens"] for row in grown)
    asked = sum(row["camera_generated_tokens"] for row in grown)
    # Only the new question was asked.
    assert re.search(rf"throughput [^;]*items/s[^;]*, {asked} tokens;", more.output), more.output


@pytest.mark.ray
def test_ray_reads_objects_and_shards_from_a_store_without_a_shared_path(cluster: Path, tiny_model_dir: Path, s3,
                                                                         tmp_path: Path, monkeypatch) -> None:
    """Inputs and output only in the store (objects, a WebDataset shard, a Parquet object): the rows a single run
    writes, and a rerun resumes."""
    import boto3

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bucket = s3.new_bucket()
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for name in ("still.png", "ball.gif"):
        client.upload_file(str(SAMPLE_DATA / name), bucket, f"in/{name}")
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:
        for key, name in (("a", "ball_h264.mp4"), ("b", "portrait.JPG")):
            tar.add(SAMPLE_DATA / name, arcname=f"{key}.{name.rsplit('.', 1)[1]}")
    client.put_object(Bucket=bucket, Key="in/shard.tar", Body=shard.getvalue())
    inputs = [f"s3://{bucket}/in/"]
    single = tmp_path / "single.parquet"
    assert caption(tiny_model_dir, *inputs, "-o", str(single), "--quiet").exit_code == 0
    expected = pq.read_table(single).drop(["elapsed_s"]).to_pylist()
    assert [row["path"] for row in expected] == [f"s3://{bucket}/in/ball.gif", f"s3://{bucket}/in/shard.tar#a.mp4",
                                                 f"s3://{bucket}/in/shard.tar#b.JPG", f"s3://{bucket}/in/still.png"]
    out = f"s3://{bucket}/captions.parquet"   # nothing of the run on a path the cluster shares
    done = caption(tiny_model_dir, *inputs, "--ray", "local", "-o", out)
    assert done.exit_code == 0, done.output
    body = client.get_object(Bucket=bucket, Key="captions.parquet")["Body"].read()
    assert pq.read_table(io.BytesIO(body)).drop(["elapsed_s"]).to_pylist() == expected
    again = caption(tiny_model_dir, *inputs, "--ray", "local", "-o", out)
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 4" in again.output, again.output


@pytest.mark.ray
def test_windows_on_ray_are_the_single_process_windows(cluster: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """--segments on Ray: each window an item of its own, decoded within its span by the cluster's workers."""
    flags = [str(SAMPLE_DATA / "ball_h264.mp4"), str(SAMPLE_DATA / "still.png"), "--segments", "fixed:1s"]
    single = tmp_path / "single.parquet"
    assert caption(tiny_model_dir, *flags, "-o", str(single), "--quiet").exit_code == 0
    out = tmp_path / "ray-out"
    done = caption(tiny_model_dir, *flags, "--ray", "local", "--out-dir", str(out))
    assert done.exit_code == 0, done.output
    assert "captioning 4 items on Ray" in done.output   # 0-1, 1-2, 2-4 s (a last 1 s joins the one before), the image
    table, _, _ = read_results(OutputTarget.existing(out), OutputColumns(with_token_ids=True, spans=True).schema())
    assert table.drop(["elapsed_s"]).to_pylist() == pq.read_table(single).drop(["elapsed_s"]).to_pylist()


@pytest.mark.ray
def test_a_qwen3_vl_checkpoints_rows_on_ray_are_the_single_process_rows(cluster: Path, tmp_path: Path) -> None:
    """A Qwen-family checkpoint on Ray: a video (timestamps before its temporal patches, from the sampled frames'
    times, which the cluster's decoders must pass on) and an image give the rows a single-process run writes."""
    model = make_tiny_model(tmp_path / "qwen3_vl", "tiny", seed=0, family="qwen3_vl")
    inputs = [str(SAMPLE_DATA / "ball_h264.mp4"), str(SAMPLE_DATA / "still.png")]
    single = tmp_path / "single.parquet"
    assert caption(model, *inputs, "-o", str(single), "--quiet").exit_code == 0
    out = tmp_path / "ray-out"
    done = caption(model, *inputs, "--ray", "local", "--out-dir", str(out))
    assert done.exit_code == 0, done.output
    expected = pq.read_table(single).drop(["elapsed_s"]).to_pylist()
    assert [row["generated_tokens"] for row in expected] == [6, 6]
    assert ray_rows(out) == expected
