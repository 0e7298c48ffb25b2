"""Transient store failures (a proxy in front of the local S3 server fails on purpose): retried, nothing lost."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest
import s3fs

from flaky_proxy import Fault, flaky_proxy
from tarsier_batch.inputs.copies import readable_copy
from tarsier_batch.inputs.sources import discover
from tarsier_batch.inputs.tars import ShardReader, TarMember
from tarsier_batch.media import MediaType, load_media

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
MEDIA = ["ball_h264.mp4", "still.png", "ball_vp9.webm"]

def read_member(reader: ShardReader, member: TarMember) -> bytes:
    """A member's bytes, as `ShardReader.copy_to` hands them on."""
    data = bytearray()
    reader.copy_to(member, data.extend)
    return bytes(data)



@pytest.fixture
def through(s3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator:
    """`through(fault)`: a context in which this process reaches the S3 server through a proxy failing as `fault`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def proxied(fault: Fault):
        return _proxied(s3.endpoint, fault, monkeypatch)

    yield proxied
    s3fs.S3FileSystem.clear_instance_cache()   # no later test may reach the proxy


class _proxied:
    def __init__(self, endpoint: str, fault: Fault, monkeypatch: pytest.MonkeyPatch):
        self.endpoint, self.fault, self.monkeypatch = endpoint, fault, monkeypatch

    def __enter__(self) -> Fault:
        self._proxy = flaky_proxy(self.endpoint, self.fault)
        url = self._proxy.__enter__()
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):   # (the service's own one comes first)
            self.monkeypatch.setenv(name, url)
        s3fs.S3FileSystem.clear_instance_cache()   # filesystems made earlier keep the endpoint they were made with
        return self.fault

    def __exit__(self, *exc: object) -> None:
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            self.monkeypatch.setenv(name, self.endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        self._proxy.__exit__(*exc)


def put(s3, bucket: str, key: str, body: bytes) -> None:
    boto3.client("s3", endpoint_url=s3.endpoint).put_object(Bucket=bucket, Key=key, Body=body)


@pytest.mark.parametrize("kind", ["slow-down", "cut"])
def test_an_object_read_that_fails_once_is_read_again(s3, through, kind: str) -> None:
    bucket = s3.new_bucket()
    clip = SAMPLE_DATA / "ball_h264.mp4"
    put(s3, bucket, "clip.mp4", clip.read_bytes())
    item = discover([f"s3://{bucket}/clip.mp4"]).items[0]
    with through(Fault(kind, "/clip.mp4")) as fault, readable_copy(item) as path:
        assert Path(path).read_bytes() == clip.read_bytes()
        decoded = load_media(path, MediaType.VIDEO, 4)
    assert fault.times == 0   # the fault happened
    assert len([get for get in fault.gets if "/clip.mp4" in get[0]]) >= 2   # the failed read, then the good one
    local = load_media(str(clip), MediaType.VIDEO, 4)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(decoded.frames, local.frames))


def test_a_shard_stream_cut_midway_is_opened_again_where_it_broke(s3, through, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:
        for number, name in enumerate(MEDIA):
            tar.add(SAMPLE_DATA / name, arcname=f"{number:05d}.{name.rsplit('.', 1)[1]}")
    put(s3, bucket, "s.tar", shard.getvalue())
    items = discover([f"s3://{bucket}/s.tar"]).items
    with (through(Fault("cut", "/s.tar")) as fault,
          ShardReader(f"s3://{bucket}/s.tar", items[0].shard_version) as reader):
        members = [read_member(reader, item.member) for item in items]
    assert [bytes(member) for member in members] == [(SAMPLE_DATA / name).read_bytes() for name in MEDIA]
    reads = [get for get in fault.gets if get[0].endswith("/s.tar")]
    assert len(reads) == 2 and reader.opens == 2
    assert reads[1][1] is not None and int(reads[1][1].split("=")[1].rstrip("-")) > 0   # from where it broke
