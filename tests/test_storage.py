"""storage: URL naming and redaction, listing a real S3 API (moto on loopback), downloads into unnamed files."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
from botocore.exceptions import ClientError

from tarsier_batch import storage
from tarsier_batch.media import MediaType, load_media
from tarsier_batch.version import install_extra_command

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"


@pytest.mark.parametrize("url, shown", [
    ("s3://bucket/clips/a.mp4", "s3://bucket/clips/a.mp4"),
    ("https://user:pa55@host.example/x.mp4", "https://host.example/x.mp4"),
    ("https://host/x.mp4?X-Amz-Signature=abc&X-Amz-Credential=AKIA%2F1&id=7",
     "https://host/x.mp4?X-Amz-Signature=REDACTED&X-Amz-Credential=REDACTED&id=7"),
    ("https://acct.blob.core.windows.net/c/x.mp4?sv=2022&sig=SECRET&se=2030", "https://acct.blob.core.windows.net/c/"
     "x.mp4?sv=2022&sig=REDACTED&se=REDACTED"),
    ("https://host/get?key=clip-7&api_key=K", "https://host/get?key=clip-7&api_key=REDACTED"),   # an object id stays
    ("https://host/x.mp4?token=t0k&page=2", "https://host/x.mp4?token=REDACTED&page=2"),
    ("s3://key:secret@bucket/a.mp4", "s3://bucket/a.mp4"),
    ("/local/path?with=query.mp4", "/local/path?with=query.mp4"),
])
def test_redact_removes_what_grants_access_and_keeps_the_rest(url: str, shown: str) -> None:
    assert storage.redact(url) == shown
    assert storage.redact(storage.redact(url)) == shown


def test_redact_text_redacts_every_url_in_a_message() -> None:
    message = "GET https://u:p@h/x?sig=S failed, then s3://k:s@b/y"
    assert storage.redact_text(message) == "GET https://h/x?sig=REDACTED failed, then s3://b/y"


@pytest.mark.parametrize("text, expected", [("s3://b/k", True), ("hf://datasets/x/y.tar", True),
                                            ("file:///tmp/a.mp4", False), ("/tmp/a.mp4", False),
                                            ("C:/x.mp4", False), ("clips/s3://x", False)])
def test_is_url(text: str, expected: bool) -> None:
    assert storage.is_url(text) is expected


def test_a_scheme_without_its_backend_names_the_extra_to_install() -> None:
    """In a fresh interpreter where gcsfs cannot be imported (as without the gcs extra; the test extra has it)."""
    script = ("import sys\nsys.modules['gcsfs'] = None   # an import of it raises ImportError\n"
              "from tarsier_batch import storage\n"
              "try:\n    storage.filesystem('gs://bucket/a.mp4')\nexcept storage.StorageError as error:\n"
              "    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert f"gs:// needs a storage backend that is not installed: {install_extra_command('gcs')}" in done.stdout


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize("error, transient", [
    (_client_error("SlowDown", 503), True), (_client_error("InternalError", 500), True),
    (_client_error("AccessDenied", 403), False), (_client_error("NoSuchKey", 404), False),
    (ConnectionResetError(), True), (OSError(errno.ECONNRESET, "reset"), True), (TimeoutError(), True),
    (FileNotFoundError("s3://b/k"), False), (PermissionError("denied"), False), (ValueError("x"), False),
])
def test_which_errors_are_worth_another_try(error: BaseException, transient: bool) -> None:
    assert storage.is_transient(error) is transient
    wrapped = OSError("the store failed")
    wrapped.__cause__ = error
    assert storage.is_transient(wrapped) is transient


def test_with_retries_tries_again_only_while_the_error_is_transient() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("dropped")
        return "ok"

    assert storage.with_retries(flaky, delays_s=(0, 0, 0)) == "ok" and len(calls) == 3
    calls.clear()

    def denied() -> None:
        calls.append(1)
        raise PermissionError("denied")

    with pytest.raises(PermissionError):
        storage.with_retries(denied, delays_s=(0, 0, 0))
    assert len(calls) == 1


def test_listing_a_prefix_behaves_like_a_folder(s3) -> None:
    bucket = s3.new_bucket()
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for key in ["clips/b.mp4", "clips/a.mp4", "clips/sub/c.gif", "clips/.hidden/d.mp4", "clips/.e.mp4",
                "clips2/f.mp4", "clips/dir/"]:
        client.put_object(Bucket=bucket, Key=key, Body=b"x" * 10)
    listed = storage.list_objects(f"s3://{bucket}/clips")
    assert [url for url, _ in listed] == [f"s3://{bucket}/clips/a.mp4", f"s3://{bucket}/clips/b.mp4",
                                          f"s3://{bucket}/clips/sub/c.gif"]
    assert all(facts.size_bytes == 10 and facts.version for _, facts in listed)
    assert [url for url, _ in storage.list_objects(f"s3://{bucket}/clips/", recursive=False)] == \
        [f"s3://{bucket}/clips/a.mp4", f"s3://{bucket}/clips/b.mp4"]
    assert [url for url, _ in storage.list_objects(f"s3://{bucket}/**/*.mp4")] == \
        [f"s3://{bucket}/clips/a.mp4", f"s3://{bucket}/clips/b.mp4", f"s3://{bucket}/clips2/f.mp4"]
    assert storage.list_objects(f"s3://{bucket}/cli") is None
    assert storage.stat_url(f"s3://{bucket}/clips") is None
    facts = storage.stat_url(f"s3://{bucket}/clips/a.mp4")
    assert facts.size_bytes == 10 and facts.version == listed[0][1].version


def test_a_fetched_object_decodes_as_the_file_does_and_leaves_nothing_behind(s3) -> None:
    bucket = s3.new_bucket()
    clip = SAMPLE_DATA / "ball_h264.mp4"
    boto3.client("s3", endpoint_url=s3.endpoint).upload_file(str(clip), bucket, "ball.mp4")
    with storage.fetch(f"s3://{bucket}/ball.mp4") as spooled:
        assert os.path.getsize(spooled.path) == clip.stat().st_size
        assert unnamed_files() == [os.readlink(spooled.path)]
        fetched = load_media(spooled.path, MediaType.VIDEO, 4)
    assert unnamed_files() == []
    local = load_media(str(clip), MediaType.VIDEO, 4)
    assert fetched.frame_indices == local.frame_indices
    assert len(fetched.frames) == 4 and all(np.array_equal(np.asarray(a), np.asarray(b))
                                            for a, b in zip(fetched.frames, local.frames))
    with pytest.raises(FileNotFoundError):
        storage.fetch(f"s3://{bucket}/missing.mp4")


def unnamed_files() -> list[str]:
    """The in-memory files (memfds) this process holds open (pytest keeps deleted files of its own open)."""
    targets = []
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        except OSError:   # the listing's own descriptor, closed by now
            continue
    return [target for target in targets if target.startswith("/memfd:")]


def test_a_spool_on_disk_is_freed_when_its_process_is_killed(tmp_path: Path) -> None:
    """Big objects spill to an unnamed file on disk: a SIGKILL leaves no file behind."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
        "from tarsier_batch import storage\n"
        "spooled = storage.Spooled(storage.SPILL_TO_DISK_BYTES + 1)\n"
        "spooled.write(b'x' * 2**20); print(os.readlink(spooled.path), flush=True); input()"), str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        shown = child.stdout.readline()
        assert shown.startswith(str(tmp_path)) and "(deleted)" in shown   # on disk, in the folder, unnamed
        assert list(tmp_path.iterdir()) == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert list(tmp_path.iterdir()) == []


def test_other_machines_get_store_settings_and_our_own_workers_the_credentials_too(monkeypatch) -> None:
    """A cluster is given endpoints and regions only; this process's own children (forked from a server that kept
    an older environment) get what a program set since, credentials included, and no repr shows them."""
    from tarsier_batch.review.thumbnails import StripJob

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-key")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=a;AccountKey=s3cr3t-account")
    monkeypatch.setenv("PATH_OF_SOMETHING_ELSE", "/x")
    shared, local = storage.environment(), storage.environment(credentials=True)
    assert shared["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert not any("s3cr3t" in value for value in shared.values())
    assert local["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-key"
    assert "AccountKey=s3cr3t" in local["AZURE_STORAGE_CONNECTION_STRING"]
    assert "PATH_OF_SOMETHING_ELSE" not in local
    job = StripJob("s3://b/a.mp4", "video", (0,), 32)
    assert job.storage_environment == local and "s3cr3t" not in repr(job)
