"""Shard members through the decoding pool: read once in tar order, a crash costs its member only, a shard that
changed after it was listed fails its members (never decodes the wrong bytes), nothing leaks, whole tars per
--shard."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from tarsier_batch.families.loading import load_processor
from tarsier_batch.inputs.sharding import Shard
from tarsier_batch.inputs.sources import discover
from tarsier_batch.workers.pool import DecodeJob, DecodePool

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
MEDIA = ["ball_h264.mp4", "still.png", "ball.gif", "ball_short.mkv"]


def write_tar(path: Path, names: list[str], prefix: str = "") -> Path:
    with tarfile.open(path, "w") as tar:
        for number, name in enumerate(names):
            data = (SAMPLE_DATA / name).read_bytes()
            info = tarfile.TarInfo(f"{prefix}{number:05d}.{name.rsplit('.', 1)[1]}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(autouse=True)
def own_index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def job(tiny_model_dir: Path) -> DecodeJob:
    return DecodeJob(load_processor(tiny_model_dir), 4, None)


def decode_all(job: DecodeJob, items: list, isolate: bool = True) -> list:
    with DecodePool(job, 2, isolate=isolate, timeout_s=60 if isolate else None) as pool:
        futures = [pool.submit(index, item) for index, item in enumerate(items)]
        return [future.result(timeout=120) for future in futures]


@pytest.mark.parametrize("isolate", [True, False])
def test_members_decode_as_their_files_do(job: DecodeJob, tmp_path: Path, isolate: bool) -> None:
    shard = write_tar(tmp_path / "a.tar", MEDIA)
    members = decode_all(job, discover([str(shard)]).items, isolate)
    files = decode_all(job, discover([str(SAMPLE_DATA / name) for name in MEDIA]).items, isolate)
    assert [one.error for one in members] == [None] * len(MEDIA)
    for member, file in zip(members, files):
        assert member.media.frame_indices == file.media.frame_indices
        assert member.prompt.pixel_values.equal(file.prompt.pixel_values)
        assert member.item.local_copy is None   # the copy of its bytes is not handed back


def test_a_crashing_member_costs_only_itself_and_nothing_leaks(job: DecodeJob, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    shard = write_tar(tmp_path / "a.tar", MEDIA)
    monkeypatch.setenv("TARSIER_BATCH_FAULT", "segfault:#00001.png")
    descriptors = len(os.listdir("/proc/self/fd"))
    decoded = decode_all(job, discover([str(shard)]).items)
    assert [one.error is None for one in decoded] == [True, False, True, True]
    assert "crashed" in decoded[1].error
    assert len(os.listdir("/proc/self/fd")) <= descriptors + 1   # (+1: the fork server's pipe, if it started now)


def test_a_shard_changed_after_listing_fails_its_members_instead_of_decoding_other_bytes(
        job: DecodeJob, tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "a.tar", MEDIA[:2])
    items = discover([str(shard)]).items
    write_tar(shard, MEDIA[2:])   # same name, other content
    decoded = decode_all(job, items)
    assert all(one.error is not None and "changed since it was listed" in one.error for one in decoded)


def test_a_truncated_shard_keeps_what_came_before_the_cut(job: DecodeJob, tmp_path: Path) -> None:
    """A download cut short: the members before the cut decode, the cut one is an error row, and the run says the
    rest of the shard could not be listed."""
    shard = write_tar(tmp_path / "a.tar", MEDIA)
    whole = discover([str(shard)]).items
    shard.write_bytes(shard.read_bytes()[:whole[2].member.offset_data + 100])   # in the third member's data
    found = discover([str(shard)])
    assert [item.path for item in found.items] == [item.path for item in whole[:3]]
    assert len(found.unreadable) == 1 and found.unreadable[0].startswith(f"{shard}: ")
    decoded = decode_all(job, found.items)
    assert [one.error is None for one in decoded] == [True, True, False]
    assert "before the end of member" in decoded[2].error


def test_a_shard_of_the_run_holds_whole_tars(tmp_path: Path) -> None:
    # The shard of a tar is a hash of its path (under a random tmp_path): with 6 tars all fell in
    # one shard 1 run in 243; with 24, 1 in 3**23.
    shards = [write_tar(tmp_path / f"{number:05d}.tar", MEDIA, prefix=f"s{number}-") for number in range(24)]
    items = discover([str(path) for path in shards]).items
    holders = {}
    for item in items:
        tar = item.path.split("#")[0]
        owners = [index for index in range(3) if Shard(index, 3).holds(item)]
        assert len(owners) == 1
        assert holders.setdefault(tar, owners[0]) == owners[0]   # every member of a tar in the same shard
    assert len(set(holders.values())) > 1   # and the tars spread over the shards


def test_members_reach_workers_as_unnamed_files_closed_once_decoded(tmp_path: Path) -> None:
    """The pool's shard reader writes each member into an unnamed in-memory file and hands on its path (what a
    worker opens): the bytes are never an object of the parent to pickle. Releasing the item closes the file."""
    import threading

    from tarsier_batch.workers.member_lane import MemberLane

    shard = write_tar(tmp_path / "a.tar", MEDIA)
    items = discover([str(shard)]).items
    handed: list = []
    done = threading.Semaphore(0)

    def hand_on(item, ticket) -> None:
        handed.append((item, ticket))
        done.release()

    lane = MemberLane(hand_on, lambda item, ticket, message: pytest.fail(message))
    try:
        for ticket, item in enumerate(items):
            lane.read(item, ticket)
        for _ in items:
            assert done.acquire(timeout=60)
        for (item, ticket), name in zip(handed, MEDIA):
            assert item.local_copy.startswith(f"/proc/{os.getpid()}/fd/")
            link = os.readlink(item.local_copy)
            assert link.startswith("/memfd:")   # in memory, with no name on disk
            with open(item.local_copy, "rb") as copy:
                assert copy.read() == (SAMPLE_DATA / name).read_bytes()
            lane.release(ticket)
            try:
                assert os.readlink(item.local_copy) != link, "released: the file is closed"
            except FileNotFoundError:
                pass
    finally:
        lane.close()
