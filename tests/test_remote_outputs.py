"""Outputs at object store URLs, against real servers on loopback (moto's S3, the GCS emulator, Azurite): written
whole, resumed after kill -9 and SIGTERM, locked."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.outputs.lock import LEASE_ENV, OutputLockedError, RemoteLock

runner = CliRunner()
SAMPLES = ["ball.gif", "portrait.JPG", "still.png"]
STABLE = ["path", "key", "caption", "num_frames", "frame_indices", "generated_tokens", "finish_reason", "error"]
WAIT_S = 120


def caption(*args: str):
    return runner.invoke(app, ["caption", *args])


def stable(rows: list[dict]) -> list[dict]:
    """The rows without timings, which differ between runs."""
    return [{name: row[name] for name in STABLE} for row in rows]


@dataclass
class Bucket:
    """A fresh bucket (or container) of one store, looked at through a client of the test's own."""

    scheme: str
    server: Any
    name: str

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{self.name}/{key}"

    def keys(self) -> list[str]:
        return sorted(path.partition("/")[2] for path in self.server.filesystem().find(self.name))

    def cat(self, key: str) -> bytes:
        return self.server.filesystem().cat_file(f"{self.name}/{key}")

    def rows(self, key: str) -> list[dict]:
        """The rows of a Parquet object, or of the shards under a prefix in name order, read through a file
        object (pyarrow's own wrapper of an fsspec filesystem can abort the interpreter at exit)."""
        fs = self.server.filesystem()
        path = f"{self.name}/{key}"
        files = sorted(name for name in fs.find(path) if name.rpartition("/")[2].startswith("part-")) \
            if fs.isdir(path) else [path]
        rows = []
        for name in files:
            with fs.open(name, "rb") as handle:
                rows += pq.read_table(handle).to_pylist()
        return rows

    def parts(self, output: str = "r.parquet") -> list[str]:
        return [key for key in self.keys() if key.startswith(f".{output}.tarsier/part-")]

    def rows_in(self, keys_: list[str]) -> int:
        return sum(len(self.rows(key)) for key in keys_)


STORES = {"s3": "s3", "gs": "gcs", "az": "azure"}   # scheme: the fixture of its local server


@pytest.fixture(params=list(STORES))
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """A fresh bucket of each store in turn: moto's S3, the GCS emulator, Azurite."""
    server = request.getfixturevalue(STORES[request.param])
    return Bucket(request.param, server, server.new_bucket())


@pytest.fixture
def s3_bucket(s3) -> Bucket:
    return Bucket("s3", s3, s3.new_bucket())


def no_secret(*texts: str | bytes) -> None:
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    for text in texts:
        assert secret not in (text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("in")
    for name in SAMPLES:
        shutil.copy(SAMPLE_DATA / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def reference(inputs: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The rows a run over the same inputs writes to a local file."""
    out = tmp_path_factory.mktemp("reference") / "r.parquet"
    result = caption(str(inputs), "--model", str(tiny_model_dir), "--max-new-tokens", "3", "-o", str(out))
    assert result.exit_code == 0, result.output
    return stable(pq.read_table(out).to_pylist())


@pytest.fixture
def args(inputs: Path, tiny_model_dir: Path) -> list[str]:
    return [str(inputs), "--model", str(tiny_model_dir), "--max-new-tokens", "3"]


@pytest.fixture
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache folder the runs stage outputs in (each test its own)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tarsier-batch" / "staging"


def nothing_staged(staging: Path) -> bool:
    return not staging.exists() or not any(staging.iterdir())


def test_parquet_at_a_url_is_the_local_run_s_rows_with_nothing_left_behind(bucket: Bucket, args: list[str],
                                                                           staging: Path, reference: list[dict],
                                                                           tmp_path: Path) -> None:
    url = bucket.url("r.parquet")
    log = tmp_path / "run.log"
    result = caption(*args, "-o", url, "--log-file", str(log))
    assert result.exit_code == 0, result.output
    assert f"{url} (3 rows)" in result.output and str(staging) not in result.output
    assert bucket.keys() == ["r.parquet"]   # no part objects, no settings, no lock object
    if bucket.scheme == "s3":   # moto's log counts the requests: the output arrived whole, in one PUT
        assert bucket.server.requests("PUT", f"/{bucket.name}/r.parquet") == 1
    assert stable(bucket.rows("r.parquet")) == reference
    assert nothing_staged(staging)
    no_secret(result.output, log.read_text(), bucket.cat("r.parquet"))


def test_jsonl_at_a_url_is_continued_and_previewed_from_the_store(s3_bucket: Bucket, args: list[str], staging: Path,
                                                                 reference: list[dict]) -> None:
    bucket = s3_bucket
    url = bucket.url("r.jsonl")
    first = caption(*args, "-o", url)
    assert first.exit_code == 0, first.output
    assert bucket.keys() == ["r.jsonl", "r.jsonl.meta.json"]
    rows = [json.loads(line) for line in bucket.cat("r.jsonl").decode().splitlines()]
    assert [(row["path"], row["caption"]) for row in rows] == [(row["path"], row["caption"]) for row in reference]
    meta = bucket.cat("r.jsonl.meta.json")
    assert json.loads(meta)["tarsier_batch"]["settings"]["max_new_tokens"] == 3
    # Continued from the objects alone (the staging folder is gone): nothing to do, nothing rewritten.
    again = caption(*args, "-o", url)
    assert again.exit_code == 0 and "captioned 0" in again.output and f"{url} (3 rows, unchanged)" in again.output
    preview = caption(*args, "-o", url, "--dry-run")
    assert preview.exit_code == 0 and preview.output.count("skip\t") == 3, preview.output
    assert bucket.server.requests("PUT", f"/{bucket.name}/r.jsonl") == 2   # the meta file, then the rows: once each
    assert bucket.keys() == ["r.jsonl", "r.jsonl.meta.json"] and nothing_staged(staging)
    no_secret(first.output, again.output, preview.output, meta, bucket.cat("r.jsonl"))


def test_out_dir_at_a_url_writes_shards_and_drops_those_beyond_a_new_count(bucket: Bucket, args: list[str],
                                                                          staging: Path,
                                                                          reference: list[dict]) -> None:
    url = bucket.url("shards/")
    first = caption(*args, "--out-dir", url, "--shard-rows", "2")
    assert first.exit_code == 0, first.output
    assert bucket.keys() == ["shards/part-00000.parquet", "shards/part-00001.parquet"]
    assert stable(bucket.rows("shards")) == reference
    fewer = caption(*args, "--out-dir", url, "--shard-rows", "3", "--overwrite")
    assert fewer.exit_code == 0, fewer.output
    assert bucket.keys() == ["shards/part-00000.parquet"]
    assert stable(bucket.rows("shards")) == reference
    bucket.server.upload(bucket.name, "shards/notes.txt", b"mine")
    refused = caption(*args, "--out-dir", url)
    assert refused.exit_code == 2 and f"--out-dir {url} holds other objects (notes.txt)" in refused.output
    assert nothing_staged(staging)


def started_until_parts(args: list[str], bucket: Bucket, count: int) -> subprocess.Popen:
    """`tarsier caption ARGS` in a process group of its own, once `count` part objects are in the bucket.

    The last input hangs its decoder, so the run is still going then; a short lease lets a later run
    take over the lock of a killed one soon.
    """
    env = {**os.environ, "TARSIER_BATCH_FAULT": f"hang:{SAMPLES[-1]}", LEASE_ENV: "1"}
    run = subprocess.Popen([sys.executable, "-m", "tarsier_batch.cli", "caption", *args, "--flush-rows", "1"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while len(bucket.parts()) < count:
            assert run.poll() is None, f"the run ended first: {run.communicate(timeout=10)}"
            assert time.monotonic() < deadline, f"no {count} part objects after {WAIT_S} s"
            time.sleep(0.05)
    except BaseException:
        stop(run, signal.SIGKILL)
        raise
    return run


def stop(run: subprocess.Popen, signal_number: int) -> tuple[str, str]:
    """Send `signal_number` to the run (SIGKILL: to its process group, fork server and hung decoder too)."""
    if signal_number == signal.SIGKILL:
        os.killpg(run.pid, signal.SIGKILL)
    else:
        run.send_signal(signal_number)
    try:
        return run.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)   # whatever of the group outlived the run


@pytest.mark.kill
def test_a_run_killed_mid_way_is_resumed_from_its_uploaded_parts(bucket: Bucket, args: list[str], staging: Path,
                                                                reference: list[dict]) -> None:
    """kill -9 once rows reached the store, then run again: only the rest is captioned."""
    url = bucket.url("r.parquet")
    killed = started_until_parts([*args, "-o", url, "--quiet"], bucket, 2)
    stop(killed, signal.SIGKILL)
    saved = bucket.rows_in(bucket.parts())
    assert 2 <= saved < 3 and "r.parquet" not in bucket.keys()
    lease = json.loads(bucket.cat(".r.parquet.tarsier.lock"))
    time.sleep(max(0.0, lease["lease_until"] - time.time()))   # the dead run's lease runs out
    resumed = caption(*args, "-o", url)
    assert resumed.exit_code == 0, resumed.output
    assert f"took over the lock of {url} from pid {killed.pid} on " in resumed.output
    assert f"captioned {3 - saved}" in resumed.output and f"done earlier {saved}" in resumed.output
    assert stable(bucket.rows("r.parquet")) == reference
    assert bucket.keys() == ["r.parquet"] and nothing_staged(staging)


@pytest.mark.kill
def test_sigterm_uploads_the_saved_rows_and_releases_the_lock(s3_bucket: Bucket, args: list[str],
                                                              staging: Path) -> None:
    bucket = s3_bucket   # the uploads are the kill -9 test's, run against every store
    url = bucket.url("r.parquet")
    run = started_until_parts([*args, "-o", url], bucket, 1)
    _, stderr = stop(run, signal.SIGTERM)
    assert run.returncode == 143, stderr
    said = re.search(r"tarsier: terminated; (\d+) finished rows? (?:is|are) saved in (\S+) and (\S+) is not "
                     r"written yet", stderr)
    assert said is not None, stderr
    saved = int(said.group(1))
    assert said.group(2, 3) == (bucket.url(".r.parquet.tarsier"), url)
    assert bucket.rows_in(bucket.parts()) == saved >= 1   # every row the message counts is in the store
    assert ".r.parquet.tarsier.lock" not in bucket.keys() and nothing_staged(staging)


def test_a_locked_output_exits_75_naming_its_holder_whose_lease_is_renewed(s3_bucket: Bucket, args: list[str],
                                                                          staging: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_bucket
    url = bucket.url("r.parquet")
    with RemoteLock(url):
        locked = caption(*args, "-o", url)
    assert locked.exit_code == 75
    assert locked.output.startswith(f"Error: another run is writing {url} (pid {os.getpid()} on ")
    assert "loading" not in locked.output and bucket.keys() == []   # released: the object is gone
    monkeypatch.setenv(LEASE_ENV, "3")
    holder = RemoteLock(url)
    holder.acquire()
    try:
        first = json.loads(bucket.cat(".r.parquet.tarsier.lock"))["lease_until"]
        time.sleep(max(0.0, first + 0.5 - time.time()))   # past the first lease: only renewals keep it
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()} on "):
            RemoteLock(url).acquire()
    finally:
        holder.release()
    assert bucket.keys() == [] and not any(thread.name == "tarsier-lock-lease" for thread in threading.enumerate())


def test_merge_writes_the_joined_shards_to_a_url(s3_bucket: Bucket, args: list[str], staging: Path,
                                                 reference: list[dict], tmp_path: Path) -> None:
    bucket = s3_bucket   # an output written whole, as the Parquet test writes one to every store
    for index in range(2):
        shard = caption(*args, "--shard", f"{index}/2", "-o", str(tmp_path / "shards" / f"shard-{index}.parquet"))
        assert shard.exit_code == 0, shard.output
    url = bucket.url("merged.parquet")
    merged = runner.invoke(app, ["merge", str(tmp_path / "shards"), "-o", url])
    assert merged.exit_code == 0 and f"merged 2 shards into {url} (3 rows, " in merged.output, merged.output
    assert bucket.keys() == ["merged.parquet"] and nothing_staged(staging)
    assert stable(bucket.rows("merged.parquet")) == reference


@pytest.mark.parametrize(("flag", "url"), [("--out", "https://example.com/r.parquet"),
                                           ("--out-dir", "hf://datasets/someone/captions")])
def test_a_read_only_url_is_refused_at_once(flag: str, url: str, tmp_path: Path) -> None:
    # A missing input and model: reaching either would end the command with another error.
    result = caption(str(tmp_path / "missing"), "--model", str(tmp_path / "no-model"), flag, url)
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"Error: {flag} {url}: {url.split(':')[0]}:// is read-only; write to "
                                          f"s3://, gs://, az:// or a local path"]


@pytest.mark.parametrize(("store_fixture", "scheme"), [("s3", "s3"), ("azure", "az"), ("gcs", "gs")])
def test_a_remote_lock_is_renewed_and_taken_over_only_once_its_holder_is_dead(
        store_fixture: str, scheme: str, request: pytest.FixtureRequest) -> None:
    """Against each store's own conditional writes (S3 If-None-Match / If-Match; Azure's ETag conditions; on GCS,
    which gcsfs gives none, a look at the version before each write): a holder killed with SIGKILL stops renewing,
    and its lock is refused while its lease runs, then taken over, naming it; a live holder renews its lease, so a
    second run is refused past the first lease."""
    store = request.getfixturevalue(store_fixture)
    bucket, lease_s = store.new_bucket(), 4.0
    dead_url, live_url = f"{scheme}://{bucket}/dead/r.parquet", f"{scheme}://{bucket}/live/r.parquet"
    script = (f"from tarsier_batch.outputs.lock import RemoteLock\nRemoteLock({dead_url!r}, {lease_s}).acquire()\n"
              f"print('held', flush=True)\nimport time\ntime.sleep(600)\n")
    dead = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert dead.stdout.readline().strip() == "held"
    finally:
        dead.kill()
        dead.wait()
    with pytest.raises(OutputLockedError, match=f"pid {dead.pid} on "):
        RemoteLock(dead_url, lease_s).acquire()
    holder = RemoteLock(live_url, lease_s)
    holder.acquire()
    try:
        time.sleep(lease_s + 0.5)   # past the first lease of both: only renewals keep one
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()} on "):
            RemoteLock(live_url, lease_s).acquire()
        assert holder.lost is None
        successor = RemoteLock(dead_url, lease_s)
        successor.acquire()
        successor.release()
        assert successor.taken_over is not None and f"pid {dead.pid} on " in successor.taken_over
    finally:
        holder.release()
