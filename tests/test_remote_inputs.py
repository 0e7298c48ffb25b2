"""Inputs in an object store (a real S3 API: moto's server on loopback) and in WebDataset shards, local and remote.

Captions are compared with those of the same files on local disk (the demo model, which really captions), so a
member or object decoded from the wrong bytes, or in the wrong place, fails.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import tarfile
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import boto3
import pyarrow.parquet as pq
import pytest
import webdataset
from typer.testing import CliRunner

from azure_server import ACCOUNT_KEY
from tarsier_batch.cli import app
from tarsier_batch.inputs.copies import readable_copy
from tarsier_batch.inputs.sources import discover
from tarsier_batch.inputs.tars import ShardError
from tarsier_batch.review.thumbnails import StripJob, make_strip

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
CLIPS = ["demo_blue_square_moves_down.mp4", "demo_green_square_shrinks.mp4", "demo_yellow_circle_grows.mp4"]
runner = CliRunner()


def caption(*args: str) -> list[dict]:
    result = runner.invoke(app, ["caption", *args, "--model", "demo", "--quiet"])
    assert result.exit_code in (0, 1), result.output
    out = args[args.index("-o") + 1]
    return pq.read_table(out).to_pylist()


@pytest.fixture(scope="module")
def local_captions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> caption, of the clips on local disk."""
    out = tmp_path_factory.mktemp("local") / "r.parquet"
    rows = caption(*(str(SAMPLE_DATA / name) for name in CLIPS), str(SAMPLE_DATA / "still.png"), "-o", str(out))
    return {Path(row["path"]).name: row["caption"] for row in rows}


@pytest.fixture(autouse=True)
def own_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def upload(s3, bucket: str, key: str, body: bytes) -> None:
    boto3.client("s3", endpoint_url=s3.endpoint).put_object(Bucket=bucket, Key=key, Body=body)


def test_a_prefix_captions_as_the_files_do_and_resumes(s3, tmp_path: Path, local_captions: dict[str, str]) -> None:
    bucket = s3.new_bucket()
    for name in CLIPS:
        upload(s3, bucket, f"clips/{name}", (SAMPLE_DATA / name).read_bytes())
    upload(s3, bucket, "clips/.hidden/x.mp4", (SAMPLE_DATA / CLIPS[0]).read_bytes())
    upload(s3, bucket, "clips/notes.txt", b"not media")
    out = tmp_path / "r.parquet"
    rows = caption(f"s3://{bucket}/clips", "-o", str(out))
    assert [row["path"] for row in rows] == [f"s3://{bucket}/clips/{name}" for name in CLIPS]
    assert [row["caption"] for row in rows] == [local_captions[name] for name in CLIPS]
    assert all(row["error"] is None and row["size_bytes"] == (SAMPLE_DATA / Path(row["path"]).name).stat().st_size
               for row in rows)

    gets = s3.requests("GET", f"/{bucket}/clips/")
    again = runner.invoke(app, ["caption", f"s3://{bucket}/clips", "-o", str(out), "--model", "demo"])
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 3" in again.output, again.output
    assert s3.requests("GET", f"/{bucket}/clips/") == gets   # nothing fetched again

    upload(s3, bucket, f"clips/{CLIPS[1]}", (SAMPLE_DATA / CLIPS[2]).read_bytes())   # new content, new ETag
    rows = caption(f"s3://{bucket}/clips", "-o", str(out))
    assert [row["caption"] for row in rows] == [local_captions[CLIPS[0]], local_captions[CLIPS[2]],
                                                local_captions[CLIPS[2]]]


def test_a_missing_object_is_an_error_row(s3, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    upload(s3, bucket, "a.png", (SAMPLE_DATA / "still.png").read_bytes())
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["caption", f"s3://{bucket}/a.png", f"s3://{bucket}/gone.mp4", "-o", str(out),
                                 "--model", "demo"])
    assert result.exit_code == 1, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["error"] is None and rows[0]["caption"]
    assert rows[1]["path"] == f"s3://{bucket}/gone.mp4" and "no such object" in rows[1]["error"]
    nothing = runner.invoke(app, ["caption", f"s3://{bucket}/nothing-here", "-o", str(tmp_path / "n.parquet"),
                                  "--model", "demo"])
    assert nothing.exit_code == 2 and "nothing found at s3://" in nothing.output


def test_a_presigned_url_captions_and_its_signature_is_stored_nowhere(s3, tmp_path: Path,
                                                                      local_captions: dict[str, str]) -> None:
    """An http(s) URL that carries its own credentials: the row, the provenance, the log and the messages hold the
    URL without them (and a second signature of the same object is the same row)."""
    bucket = s3.new_bucket()
    upload(s3, bucket, "a.png", (SAMPLE_DATA / "still.png").read_bytes())
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    signed = [client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "a.png"}, ExpiresIn=600 + n)
              for n in range(2)]
    queries = [parse_qs(urlsplit(url).query) for url in signed]   # SigV2 (Signature) or SigV4 (X-Amz-Signature)
    signatures = [(query.get("X-Amz-Signature") or query["Signature"])[0] for query in queries]
    assert signatures[0] != signatures[1]
    out, log = tmp_path / "r.jsonl", tmp_path / "run.log"
    result = runner.invoke(app, ["caption", *signed, "-o", str(out), "--model", "demo", "--log-file", str(log)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["caption"] == local_captions["still.png"]
    assert rows[0]["path"].startswith(f"{s3.endpoint}/{bucket}/a.png?") and "Signature=REDACTED" in rows[0]["path"]
    for text in [out.read_text(), out.with_name("r.jsonl.meta.json").read_text(), log.read_text(), result.output]:
        assert not any(signature in text for signature in signatures)


def write_shard(path: Path, samples: list[tuple[str, str]], with_webdataset: bool = False) -> list[str]:
    """A WebDataset shard: per sample (key, clip name) the clip as `<key>.<ext>` and a JSON sibling; a stray
    README member too. Returns the member names of the clips."""
    members = []
    if with_webdataset:
        with webdataset.TarWriter(str(path)) as sink:
            for key, name in samples:
                ext = name.rsplit(".", 1)[1]
                sink.write({"__key__": key, ext: (SAMPLE_DATA / name).read_bytes(),
                            "json": json.dumps({"source": name}).encode()})
                members.append(f"{key}.{ext}")
        return members
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
        add("README", b"a stray member")
        for key, name in samples:
            add(f"{key}.{name.rsplit('.', 1)[1]}", (SAMPLE_DATA / name).read_bytes())
            add(f"{key}.json", json.dumps({"source": name}).encode())
            members.append(f"{key}.{name.rsplit('.', 1)[1]}")
    return members


def test_local_shards_caption_their_members_with_siblings_kept(tmp_path: Path, local_captions: dict[str, str]
                                                                ) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    first = write_shard(shards / "00000.tar", [("s0", CLIPS[0]), ("s1", "still.png")])
    second = write_shard(shards / "00001.tar", [("s2", CLIPS[2])], with_webdataset=True)
    out = tmp_path / "r.parquet"
    rows = caption(str(shards / "{00000..00001}.tar"), "-o", str(out), "--keep-columns", "json")
    assert [row["path"] for row in rows] == [f"{shards}/00000.tar#{first[0]}", f"{shards}/00000.tar#{first[1]}",
                                             f"{shards}/00001.tar#{second[0]}"]
    assert [row["caption"] for row in rows] == [local_captions[CLIPS[0]], local_captions["still.png"],
                                                local_captions[CLIPS[2]]]
    assert [json.loads(row["json"])["source"] for row in rows] == [CLIPS[0], "still.png", CLIPS[2]]
    found = discover([str(shards)])
    assert len(found.items) == 3 and dict(found.skipped) == {"(no extension)": 1}   # README; the JSONs are siblings


def test_a_remote_shard_is_read_with_one_request(s3, tmp_path: Path, local_captions: dict[str, str]) -> None:
    bucket = s3.new_bucket()
    members = write_shard(tmp_path / "00000.tar", [("a", CLIPS[0]), ("b", CLIPS[1]), ("c", CLIPS[2])])
    upload(s3, bucket, "wds/00000.tar", (tmp_path / "00000.tar").read_bytes())
    url = f"s3://{bucket}/wds/00000.tar"
    discover([url])   # lists it (its headers) into the index cache
    listed = s3.requests("GET", "/wds/00000.tar")
    rows = caption(f"s3://{bucket}/wds/", "-o", str(tmp_path / "r.parquet"))
    assert [row["path"] for row in rows] == [f"{url}#{name}" for name in members]
    assert [row["caption"] for row in rows] == [local_captions[name] for name in CLIPS]
    assert s3.requests("GET", "/wds/00000.tar") - listed == 1   # the index came from the cache; one streamed read


def test_inspect_and_report_read_objects_and_members(s3, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    members = write_shard(tmp_path / "00000.tar", [("a", CLIPS[0]), ("b", "still.png")])
    upload(s3, bucket, "wds/00000.tar", (tmp_path / "00000.tar").read_bytes())
    upload(s3, bucket, "clip.mp4", (SAMPLE_DATA / CLIPS[1]).read_bytes())
    local = runner.invoke(app, ["inspect", "--json", "--model", "demo", str(SAMPLE_DATA / CLIPS[1])])
    for target in [f"s3://{bucket}/clip.mp4", f"s3://{bucket}/wds/00000.tar#{members[0]}",
                   f"{tmp_path / '00000.tar'}#{members[0]}"]:
        shown = runner.invoke(app, ["inspect", "--json", "--model", "demo", target])
        assert shown.exit_code == 0, shown.output
        facts = json.loads(shown.output)
        assert facts["path"] == target and facts["problem"] is None
        assert facts["frame_indices"] == json.loads(local.output)["frame_indices"]
    missing = runner.invoke(app, ["inspect", f"s3://{bucket}/wds/00000.tar#nope.mp4"])
    assert missing.exit_code == 1 and "has no member 'nope.mp4'" in missing.output

    for path, media_type in [(f"s3://{bucket}/wds/00000.tar#{members[0]}", "video"),
                             (f"s3://{bucket}/wds/00000.tar#{members[1]}", "image"),
                             (f"s3://{bucket}/clip.mp4", "video")]:
        strip = make_strip(StripJob(path, media_type, (0, 1) if media_type == "video" else (0,), 32))
        assert strip.uri is not None and strip.uri.startswith("data:image/jpeg"), strip.problem


def test_shards_in_the_store_into_a_parquet_object_and_resumed(s3, tmp_path: Path,
                                                               local_captions: dict[str, str]) -> None:
    """The README's walkthrough: a prefix of shards in, a Parquet object out, run again to resume."""
    bucket = s3.new_bucket()
    for number, samples in enumerate([[("a", CLIPS[0]), ("b", CLIPS[1])], [("c", CLIPS[2]), ("d", "still.png")]]):
        write_shard(tmp_path / f"{number:05d}.tar", samples)
        upload(s3, bucket, f"wds/{number:05d}.tar", (tmp_path / f"{number:05d}.tar").read_bytes())
    out = f"s3://{bucket}/captions.parquet"
    first = runner.invoke(app, ["caption", f"s3://{bucket}/wds/{{00000..00001}}.tar", "--model", "demo", "-o", out,
                                "--keep-columns", "json"])
    assert first.exit_code == 0, first.output
    rows = read_object(s3, bucket, "captions.parquet")
    assert [row["caption"] for row in rows] == [local_captions[name] for name in [*CLIPS, "still.png"]]
    assert rows[3]["path"] == f"s3://{bucket}/wds/00001.tar#d.png" and json.loads(rows[3]["json"]) == \
        {"source": "still.png"}
    again = runner.invoke(app, ["caption", f"s3://{bucket}/wds/", "--model", "demo", "-o", out, "--keep-columns",
                                "json"])
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 4" in again.output, again.output
    assert read_object(s3, bucket, "captions.parquet") == rows


def read_object(s3, bucket: str, key: str) -> list[dict]:
    body = boto3.client("s3", endpoint_url=s3.endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    return [{**row, "elapsed_s": None} for row in pq.read_table(io.BytesIO(body)).to_pylist()]


def test_a_shard_replaced_in_the_store_after_listing_fails_its_reads(s3, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    write_shard(tmp_path / "s.tar", [("a", CLIPS[0])])
    upload(s3, bucket, "s.tar", (tmp_path / "s.tar").read_bytes())
    item = discover([f"s3://{bucket}/s.tar"]).items[0]
    write_shard(tmp_path / "s.tar", [("a", CLIPS[1])])
    upload(s3, bucket, "s.tar", (tmp_path / "s.tar").read_bytes())
    with pytest.raises(ShardError, match="changed since it was listed"), readable_copy(item):
        pass


def test_a_manifest_in_the_store_lists_objects_beside_it(s3, tmp_path: Path, local_captions: dict[str, str]) -> None:
    bucket = s3.new_bucket()
    for name in CLIPS[:2]:
        upload(s3, bucket, f"data/clips/{name}", (SAMPLE_DATA / name).read_bytes())
    upload(s3, bucket, "other/still.png", (SAMPLE_DATA / "still.png").read_bytes())
    manifest = (f"path,label\nclips/{CLIPS[0]},first\n../other/still.png,second\n"
                f"s3://{bucket}/data/clips/{CLIPS[1]},third\n")
    upload(s3, bucket, "data/list.csv", manifest.encode())
    out = tmp_path / "r.parquet"
    rows = caption("--manifest", f"s3://{bucket}/data/list.csv", "--keep-columns", "label", "-o", str(out))
    assert [row["path"] for row in rows] == [f"s3://{bucket}/data/clips/{CLIPS[0]}", f"s3://{bucket}/other/still.png",
                                             f"s3://{bucket}/data/clips/{CLIPS[1]}"]
    assert [row["caption"] for row in rows] == [local_captions[CLIPS[0]], local_captions["still.png"],
                                                local_captions[CLIPS[1]]]
    assert [row["label"] for row in rows] == ["first", "second", "third"]
    missing = runner.invoke(app, ["caption", "--manifest", f"s3://{bucket}/data/nope.csv", "-o", str(out),
                                  "--model", "demo"])
    assert missing.exit_code == 2 and f"cannot read --manifest s3://{bucket}/data/nope.csv" in missing.output


def test_a_shard_at_a_presigned_url_and_an_inspected_shard(s3, tmp_path: Path, local_captions: dict[str, str]) -> None:
    """A shard behind an http(s) URL is listed and read under one version; `tarsier inspect shard.tar` inspects its
    members; a refused http listing is a one-line error, not a traceback."""
    bucket = s3.new_bucket()
    members = write_shard(tmp_path / "s.tar", [("a", CLIPS[0]), ("b", "still.png")])
    upload(s3, bucket, "s.tar", (tmp_path / "s.tar").read_bytes())
    signed = boto3.client("s3", endpoint_url=s3.endpoint).generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "s.tar"}, ExpiresIn=600)
    rows = caption(signed, "-o", str(tmp_path / "r.parquet"))
    assert [row["caption"] for row in rows] == [local_captions[CLIPS[0]], local_captions["still.png"]]
    assert all("#" in row["path"] and "Signature=REDACTED" in row["path"] for row in rows)
    shown = runner.invoke(app, ["inspect", "--json", "--model", "demo", str(tmp_path / "s.tar")])
    assert shown.exit_code == 0, shown.output
    assert [json.loads(line)["path"] for line in shown.output.splitlines()] == \
        [f"{tmp_path / 's.tar'}#{name}" for name in members]


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A web server that refuses everything (403), as a store does for a wrong or expired signature."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET


def test_a_refused_http_shard_is_a_clear_message_not_a_traceback(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/s.tar?sig=SECRET"
        refused = runner.invoke(app, ["caption", url, "-o", str(tmp_path / "n.parquet"), "--model", "demo"])
    finally:
        server.shutdown()
        server.server_close()
    assert not isinstance(refused.exception, Exception) or isinstance(refused.exception, SystemExit), \
        repr(refused.exception)
    assert refused.exit_code == 2 and "s.tar" in refused.output and "SECRET" not in refused.output, \
        refused.output


def test_a_long_objects_windows_download_it_once_per_worker(s3, tmp_path: Path) -> None:
    # One decoding worker takes the 7 windows of a 65 s video in an object store: it keeps the download for the
    # object's windows (was: one download per window). The probe that reads the length downloads it once too.
    from segment_media import write_numbered_video

    bucket = s3.new_bucket()
    upload(s3, bucket, "long/long.mp4", write_numbered_video(tmp_path / "long.mp4", 65).read_bytes())
    out = tmp_path / "windows.parquet"
    rows = caption(f"s3://{bucket}/long/long.mp4", "--segments", "fixed:10s", "--workers", "1", "-o", str(out))
    assert [(row["start_s"], row["error"]) for row in rows] == [(float(start), None) for start in range(0, 65, 10)]
    assert s3.requests("GET", f"/{bucket}/long/long.mp4") == 2


def test_a_web_folder_captions_as_the_files_do_and_resumes_by_etag(http_store, tmp_path: Path,
                                                                   local_captions: dict[str, str]) -> None:
    """http(s):// folder: its index page lists it (hidden entries and non-media left out), each file's size and ETag
    come from a HEAD, so a rerun fetches nothing again, and a file replaced by other bytes of the same size (same
    size, new ETag) is captioned again."""
    clips = http_store.root / "clips"
    (clips / ".hidden").mkdir(parents=True)
    for name in CLIPS:
        (clips / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    (clips / ".hidden" / "x.mp4").write_bytes((SAMPLE_DATA / CLIPS[0]).read_bytes())
    (clips / "notes.txt").write_text("not media")
    folder, out = f"{http_store.url}/clips/", tmp_path / "r.parquet"
    rows = caption(folder, "-o", str(out))
    assert [row["path"] for row in rows] == [f"{folder}{name}" for name in CLIPS]
    assert [row["caption"] for row in rows] == [local_captions[name] for name in CLIPS]
    assert [row["size_bytes"] for row in rows] == [(SAMPLE_DATA / name).stat().st_size for name in CLIPS]

    gets = http_store.requests("GET", "/clips/demo_")
    again = runner.invoke(app, ["caption", folder, "-o", str(out), "--model", "demo"])
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 3" in again.output, again.output
    assert http_store.requests("GET", "/clips/demo_") == gets   # nothing fetched again

    size = (clips / CLIPS[1]).stat().st_size
    (clips / CLIPS[1]).write_bytes((SAMPLE_DATA / CLIPS[2]).read_bytes()[:size].ljust(size, b"\0"))
    changed = runner.invoke(app, ["caption", folder, "-o", str(out), "--model", "demo"])
    assert "done earlier 2" in changed.output, changed.output
    rows = pq.read_table(out).to_pylist()
    assert [row["caption"] for row in rows][::2] == [local_captions[CLIPS[0]], local_captions[CLIPS[2]]]
    assert rows[1]["path"] == f"{folder}{CLIPS[1]}" and rows[1]["caption"] != local_captions[CLIPS[1]]


def test_a_shard_on_a_web_server_is_streamed_and_pinned_to_its_listed_version(http_store, tmp_path: Path,
                                                                              local_captions: dict[str, str]) -> None:
    (http_store.root / "wds").mkdir()
    members = write_shard(http_store.root / "wds" / "00000.tar", [("a", CLIPS[0]), ("b", "still.png")])
    url = f"{http_store.url}/wds/00000.tar"
    rows = caption(f"{http_store.url}/wds/", "-o", str(tmp_path / "r.parquet"))
    assert [row["path"] for row in rows] == [f"{url}#{name}" for name in members]
    assert [row["caption"] for row in rows] == [local_captions[CLIPS[0]], local_captions["still.png"]]

    item = discover([url]).items[0]
    write_shard(http_store.root / "wds" / "00000.tar", [("a", CLIPS[1]), ("b", "still.png")])
    with pytest.raises(ShardError, match="changed since it was listed"), readable_copy(item):
        pass


@pytest.mark.parametrize(("store_fixture", "scheme"), [("gcs", "gs"), ("azure", "az")])
def test_a_prefix_and_a_shard_in_a_store_caption_as_the_files_do_and_resume(
        store_fixture: str, scheme: str, request: pytest.FixtureRequest, tmp_path: Path,
        local_captions: dict[str, str]) -> None:
    """gs:// (the GCS emulator) and az:// (Azurite): a prefix listed like a folder (hidden and non-media names left
    out), a shard streamed, a rerun that captions nothing again, and an object replaced (a new MD5 or ETag) captioned
    again. The stores' settings reach the decoding workers (set after their fork server started)."""
    store = request.getfixturevalue(store_fixture)
    bucket = store.new_bucket()
    for name in CLIPS:
        store.upload(bucket, f"clips/{name}", (SAMPLE_DATA / name).read_bytes())
    store.upload(bucket, "clips/.hidden/x.mp4", (SAMPLE_DATA / CLIPS[0]).read_bytes())
    store.upload(bucket, "clips/notes.txt", b"not media")
    members = write_shard(tmp_path / "00000.tar", [("a", CLIPS[0]), ("b", "still.png")])
    store.upload(bucket, "wds/00000.tar", (tmp_path / "00000.tar").read_bytes())
    inputs, out = [f"{scheme}://{bucket}/clips", f"{scheme}://{bucket}/wds/"], tmp_path / "r.parquet"
    rows = caption(*inputs, "-o", str(out))
    assert [row["path"] for row in rows] == [*(f"{scheme}://{bucket}/clips/{name}" for name in CLIPS),
                                             *(f"{scheme}://{bucket}/wds/00000.tar#{name}" for name in members)]
    assert [row["caption"] for row in rows] == [*(local_captions[name] for name in CLIPS),
                                                local_captions[CLIPS[0]], local_captions["still.png"]]
    assert [row["size_bytes"] for row in rows[:3]] == [(SAMPLE_DATA / name).stat().st_size for name in CLIPS]

    log = tmp_path / "run.log"
    again = runner.invoke(app, ["caption", *inputs, "-o", str(out), "--model", "demo", "--log-file", str(log)])
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 5" in again.output, again.output
    if scheme == "az":   # the account key (the GCS emulator takes no credentials) is in no row, log or message
        assert not [text for text in (out.read_bytes(), log.read_bytes(), again.output.encode())
                    if ACCOUNT_KEY.encode() in text]
    store.upload(bucket, f"clips/{CLIPS[1]}", (SAMPLE_DATA / CLIPS[2]).read_bytes())
    rows = caption(*inputs, "-o", str(out))
    assert [row["caption"] for row in rows[:3]] == [local_captions[CLIPS[0]], local_captions[CLIPS[2]],
                                                    local_captions[CLIPS[2]]]


@pytest.mark.long
def test_a_hub_dataset_folder_and_shard_caption_as_the_files_do_and_resume(hf_hub, tmp_path: Path,
                                                                           local_captions: dict[str, str]) -> None:
    """hf:// against a local server speaking the Hub's API (tests/hf_server.py): a dataset folder listed, a shard
    streamed through `resolve`, a rerun that captions nothing again, and a file replaced (a new git blob id)
    captioned again. The command runs in a process of its own: huggingface_hub reads HF_ENDPOINT on import."""
    import subprocess
    import sys

    (hf_hub.root / "clips").mkdir()
    for name in CLIPS:
        (hf_hub.root / "clips" / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    (hf_hub.root / "wds").mkdir()
    members = write_shard(hf_hub.root / "wds" / "00000.tar", [("a", CLIPS[0]), ("b", "still.png")])
    repo = f"hf://datasets/{hf_hub.repo}"
    out = tmp_path / "r.parquet"
    env = {**os.environ, "HF_ENDPOINT": hf_hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)

    def run() -> str:
        done = subprocess.run([sys.executable, "-m", "tarsier_batch.cli", "caption", f"{repo}/clips", f"{repo}/wds/",
                               "-o", str(out), "--model", "demo"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stderr

    run()
    rows = pq.read_table(out).to_pylist()
    assert [row["path"] for row in rows] == [*(f"{repo}/clips/{name}" for name in CLIPS),
                                             *(f"{repo}/wds/00000.tar#{name}" for name in members)]
    assert [row["caption"] for row in rows] == [*(local_captions[name] for name in CLIPS),
                                                local_captions[CLIPS[0]], local_captions["still.png"]]
    assert hf_hub.requests("GET", "/resolve/main/wds/00000.tar") >= 1
    assert "captioned 0; failed 0; done earlier 5" in run()
    (hf_hub.root / "clips" / CLIPS[1]).write_bytes((SAMPLE_DATA / CLIPS[2]).read_bytes())
    assert "captioned 1; failed 0; done earlier 4" in run()
    rows = pq.read_table(out).to_pylist()
    assert [row["caption"] for row in rows[:3]] == [local_captions[CLIPS[0]], local_captions[CLIPS[2]],
                                                    local_captions[CLIPS[2]]]
