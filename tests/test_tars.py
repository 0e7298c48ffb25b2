"""tars.py on real tar files: brace patterns, WebDataset keys, member paths, the header-only listing
and its cache, and the shard reader (one stream per shard), for local paths and fsspec URLs (memory://)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import braceexpand
import fsspec
import pytest
import webdataset as wds
from webdataset.tariterators import base_plus_ext

from tarsier_batch.inputs.tars import (
    REOPEN_GAP,
    SIBLING_LIMIT,
    ReadStopped,
    ShardError,
    ShardIndex,
    ShardReader,
    TarMember,
    default_cache_dir,
    expand_braces,
    list_shard,
    member_path,
    split_member_path,
    wds_key,
)

MTIME = 1_700_000_000
BIG_TEXT = b"y" * (SIBLING_LIMIT + 1)
# (name, data) in tar order; None is a directory entry. Media members, text siblings, a binary
# sibling, an oversized sibling, a text file of a key without media, a nested path, two dots, a
# name that is not UTF-8 (tarfile gives it with surrogate escapes), no dot.
ENTRIES: list[tuple[str, bytes | None]] = [
    ("dir", None),
    ("sample00000.mp4", b"x" * 1000),
    ("sample00000.json", b'{"caption": "a cat"}'),
    ("sample00000.npy", b"\x93NUMPY\x01\x00v\x00"),
    ("sample00001.jpg", bytes(range(256)) * 4),
    ("sample00001.txt", "caption \u00fc, then bad UTF-8: \xff".encode("utf-8")[:-2] + b"\xff"),
    ("dir/sample00002.mp4", b"z" * 3000),
    ("dir/sample00002.json", b"[1, 2]"),
    ("clip.v2.mp4", b"c" * 10),
    ("clip.txt", b"two dots"),
    ("big.webm", b"b" * 600),
    ("big.json", BIG_TEXT),
    ("notes.txt", b"no media has this key"),
    ("caf\udce9.jpg", b"a name in Latin-1, not UTF-8"),
    ("README", b"no dot"),
]
FILES = [(name, data) for name, data in ENTRIES if data is not None]
SIBLINGS = {"sample00000": {"json": '{"caption": "a cat"}'},
            "sample00001": {"txt": "caption \u00fc, then bad UTF-8: \ufffd"},
            "dir/sample00002": {"json": "[1, 2]"},
            "clip": {"txt": "two dots"}}

def read_member(reader: ShardReader, member: TarMember) -> bytes:
    """A member's bytes, as `ShardReader.copy_to` hands them on."""
    data = bytearray()
    reader.copy_to(member, data.extend)
    return bytes(data)



def write_tar(path: Path, entries: list[tuple[str, bytes | None]], tar_format: int = tarfile.GNU_FORMAT) -> Path:
    with tarfile.open(path, "w", format=tar_format) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime = MTIME
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link.mp4")
        link.type, link.linkname = tarfile.SYMTYPE, "sample00000.mp4"
        tar.addfile(link)
    return path


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_tar(tmp_path / "shard-000.tar", ENTRIES)


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[tuple[object, str]]:
    """A folder of fsspec's in-memory store (global to the process), emptied afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def assert_index_matches(index: ShardIndex, raw: bytes, files: list[tuple[str, bytes]]) -> None:
    """Names in tar order, and each offset and size pick exactly the written bytes out of the raw tar."""
    assert [member.name for member in index.members] == [name for name, _ in files]
    for member, (_, data) in zip(index.members, files):
        assert member.size == len(data)
        assert raw[member.offset_data:member.offset_data + member.size] == data


# ------------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize("pattern", [
    "shard.tar", "s3://bucket/train/shard-000007.tar", "",
    "shard-{00000..00003}.tar", "s-{7..10}.tar", "s-{07..10}.tar", "s-{0..10}.tar", "s-{10..7}.tar",
    "s-{1..9..3}.tar", "s-{9..1..-4}.tar", "s-{2..-1}.tar", "s-{-3..-1}.tar", "s-{-03..1}.tar", "s-{-0..2}.tar",
    "s-{1..3..0}.tar", "{a..e}", "{e..a..2}", "{C..A}", "{X..c}",
    "{a,b,c}.tar", "index{,.backup}", "{,}", "{a}", "{}", "x{a{b,c}}y",
    "s3://b/{train,val}/shard-{000..002}.tar", "{a,b}{1..2}{x,y}", "python{2.{5..7},3.{2,3}}",
    "{a,{b,{c,d}}}", r"{1\{2,3}", r"a\,b{c\,d,e}", r"lit\{eral\}",
])
def test_expand_braces_matches_braceexpand(pattern: str) -> None:
    assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


def test_expand_braces_examples() -> None:
    assert expand_braces("s3://b/shard-{00008..00011}.tar") == [
        "s3://b/shard-00008.tar", "s3://b/shard-00009.tar", "s3://b/shard-00010.tar", "s3://b/shard-00011.tar"]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("plain/shard.tar") == ["plain/shard.tar"]


@pytest.mark.parametrize("pattern", ["shard-{000..009.tar", "shard-000..009}.tar", "{a,{b,c}", "}{", "a}b{c}",
                                     "{a}}", "{{a}"])
def test_expand_braces_refuses_unbalanced_braces(pattern: str) -> None:
    with pytest.raises(ValueError, match="unbalanced braces in"):
        expand_braces(pattern)


@pytest.mark.parametrize("name, expected", [
    ("sample00000.mp4", ("sample00000", "mp4")),
    ("a/b.c.mp4", ("a/b", "c.mp4")),
    ("dir.v1/sample.json", ("dir.v1/sample", "json")),
    ("a/b/c.tar.gz", ("a/b/c", "tar.gz")),
    ("trailing.", ("trailing", "")),
    ("README", None),
    (".hidden", None),
    ("dir/.hidden.mp4", ("dir/", "hidden.mp4")),   # verbatim, odd as it is
    ("dir.d/noext", None),
])
def test_wds_key_follows_webdataset(name: str, expected: tuple[str, str] | None) -> None:
    assert wds_key(name) == expected
    assert base_plus_ext(name) == (expected or (None, None))


@pytest.mark.parametrize("path, expected", [
    ("shard.tar#sample.mp4", ("shard.tar", "sample.mp4")),
    ("s3://b/x/shard-001.TAR#dir/a.b.mp4", ("s3://b/x/shard-001.TAR", "dir/a.b.mp4")),
    ("run#2/shard.tar#sample.mp4", ("run#2/shard.tar", "sample.mp4")),
    ("shard.tar#take#2.mp4", ("shard.tar", "take#2.mp4")),
    ("a#b.mp4", None),
    ("shard.tar", None),
    ("shard.tar#", None),
    ("#shard.tar", None),
    ("shard.tar.gz#a.mp4", None),
    ("x.tarball#a.mp4", None),
])
def test_split_member_path(path: str, expected: tuple[str, str] | None) -> None:
    assert split_member_path(path) == expected
    if expected is not None:
        assert member_path(*expected) == path


# ------------------------------------------------------------------------------------------------
# Listing


def test_list_shard_lists_regular_members_by_headers(shard: Path) -> None:
    index = list_shard(str(shard))
    assert index.shard == str(shard)
    assert_index_matches(index, shard.read_bytes(), FILES)
    assert all(member.mtime == MTIME for member in index.members)
    assert index.siblings == SIBLINGS
    stat = shard.stat()
    assert index.version == f"{stat.st_size}-{stat.st_mtime_ns}"


def test_list_shard_reads_webdataset_pax_shards(tmp_path: Path) -> None:
    path = tmp_path / "wds-000.tar"
    with wds.TarWriter(str(path), mtime=MTIME + 0.75) as writer:
        writer.write({"__key__": "sample00000", "mp4": b"v" * 5000, "json": {"caption": "a dog"}, "txt": "running"})
        writer.write({"__key__": "dir/sample00001", "jpg": b"j" * 700, "cls": "3"})
    raw = path.read_bytes()
    assert b"mtime=1700000000.75" in raw   # a float mtime makes tarfile write a PAX header per member
    index = list_shard(str(path))
    assert_index_matches(index, raw, [
        ("sample00000.json", json.dumps({"caption": "a dog"}).encode()), ("sample00000.mp4", b"v" * 5000),
        ("sample00000.txt", b"running"), ("dir/sample00001.cls", b"3"), ("dir/sample00001.jpg", b"j" * 700)])
    assert {member.mtime for member in index.members} == {MTIME}
    assert index.siblings == {"sample00000": {"json": '{"caption": "a dog"}', "txt": "running"},
                              "dir/sample00001": {"cls": "3"}}


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write sparse members")
@pytest.mark.parametrize("tar_format", ["gnu", "pax"])
def test_sparse_members_are_left_out(tmp_path: Path, tar_format: str) -> None:
    (tmp_path / "a.mp4").write_bytes(b"clip")
    with open(tmp_path / "holes.mp4", "wb") as out:
        out.seek(3_000_000)
        out.write(b"end")
    subprocess.run(["tar", "--sparse", f"--format={tar_format}", "-cf", "s.tar", "a.mp4", "holes.mp4"],
                   cwd=tmp_path, check=True, timeout=120)
    with tarfile.open(tmp_path / "s.tar") as tar:
        assert tar.getmember("holes.mp4").issparse()
    index = list_shard(str(tmp_path / "s.tar"))
    assert_index_matches(index, (tmp_path / "s.tar").read_bytes(), [("a.mp4", b"clip")])


def cut_points(shard: Path) -> dict[str, int]:
    """Places to cut `shard` (GNU format, one 512-byte header per member): in a member's data, in a header."""
    members = list_shard(str(shard)).members
    second_header = members[1].offset_data - tarfile.BLOCKSIZE
    return {"in member data": members[0].offset_data + 500, "in a later header": second_header + 100,
            "in the first header": 100, "empty": 0}


@pytest.mark.parametrize("where", ["in the first header", "empty"])
def test_a_shard_cut_before_its_first_member_is_refused(shard: Path, where: str) -> None:
    cut = shard.with_name("cut.tar")
    cut.write_bytes(shard.read_bytes()[:cut_points(shard)[where]])
    with pytest.raises(ShardError, match=f"^{re.escape(str(cut))}: "):
        list_shard(str(cut))


@pytest.mark.parametrize("where, listed", [("in member data", 1), ("in a later header", 1)])
def test_a_shard_cut_later_lists_the_members_before_the_cut_and_is_not_cached(
        shard: Path, tmp_path: Path, where: str, listed: int) -> None:
    """What was written before the cut is captioned; the member cut in its data is listed (reading it fails)."""
    whole = list_shard(str(shard))
    cut = shard.with_name("cut.tar")
    cut.write_bytes(shard.read_bytes()[:cut_points(shard)[where]])
    index = list_shard(str(cut), tmp_path / "cache")
    assert index.members == whole.members[:listed]
    assert index.problem is not None and ("cut" in index.problem or "damaged" in index.problem)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    if where == "in member data":
        with pytest.raises(ShardError, match="before the end of member"), ShardReader(str(cut)) as reader:
            read_member(reader, index.members[0])


def test_a_damaged_header_stops_the_listing_there_and_a_non_tar_is_refused(shard: Path, tmp_path: Path) -> None:
    damaged = bytearray(shard.read_bytes())
    whole = list_shard(str(shard))
    third_header = whole.members[2].offset_data - tarfile.BLOCKSIZE
    damaged[third_header:third_header + 16] = b"not a tar header"
    (tmp_path / "damaged.tar").write_bytes(bytes(damaged))
    index = list_shard(str(tmp_path / "damaged.tar"))
    assert index.members == whole.members[:2] and index.problem == f"a damaged or cut tar header at byte {third_header}"
    (tmp_path / "text.tar").write_text("just some text, not a tar archive\n" * 40)
    with pytest.raises(ShardError, match="text.tar: not a tar file"):
        list_shard(str(tmp_path / "text.tar"))


def test_a_missing_shard_raises_file_not_found(tmp_path: Path, memory: tuple) -> None:
    _, root = memory
    for missing in (str(tmp_path / "none.tar"), f"memory://{root}/none.tar"):
        for cache_dir in (None, tmp_path / "cache"):
            with pytest.raises(FileNotFoundError):
                list_shard(missing, cache_dir)
            with pytest.raises(FileNotFoundError), ShardReader(missing) as reader:
                read_member(reader, TarMember("a.mp4", 512, 1, 0))


# ------------------------------------------------------------------------------------------------
# The index cache


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.json"))


def replace_keeping_stat(path: Path, data: bytes) -> None:
    """New content of the same size with the old mtime: the same version, so only a read could tell."""
    stat = path.stat()
    assert len(data) == stat.st_size
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_cache_answers_without_reading_the_tar(shard: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache" / "tar-index"
    first = list_shard(str(shard), cache_dir)
    digest = hashlib.sha256
    name = f"{digest(str(shard).encode()).hexdigest()[:16]}-{digest(first.version.encode()).hexdigest()[:16]}.json"
    assert cache_files(cache_dir) == [cache_dir / name]
    assert str(shard) not in (cache_dir / name).read_text()   # a URL may carry a credential: only its hash is kept

    replace_keeping_stat(shard, b"\xff" * shard.stat().st_size)
    with pytest.raises(ShardError):
        list_shard(str(shard))          # the content is no tar any more...
    assert list_shard(str(shard), cache_dir) == first   # ...so this answer came from the cache alone


def test_a_changed_shard_is_listed_again(shard: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    first = list_shard(str(shard), cache_dir)
    write_tar(shard, [("other.mp4", b"o" * 10), ("other.txt", b"new")])
    second = list_shard(str(shard), cache_dir)
    assert [member.name for member in second.members] == ["other.mp4", "other.txt"]
    assert second.siblings == {"other": {"txt": "new"}}
    assert second.version != first.version
    assert len(cache_files(cache_dir)) == 2


@pytest.mark.parametrize("corruption", ["empty", "cut", "not json", "no members", "string offset", "other format"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(shard: Path, tmp_path: Path, corruption: str) -> None:
    cache_dir = tmp_path / "cache"
    fresh = list_shard(str(shard), cache_dir)
    [cached] = cache_files(cache_dir)
    good = cached.read_text()
    data = json.loads(good)
    wrong = {"empty": "", "cut": good[:len(good) // 2], "not json": "\x00\x01",
             "no members": json.dumps({**data, "members": None}),
             "string offset": json.dumps({**data, "members": [[data["members"][0][0], "1536", 8, MTIME]]}),
             "other format": json.dumps({**data, "format": 0, "members": []})}[corruption]
    cached.write_text(wrong)
    assert list_shard(str(shard), cache_dir) == fresh
    assert cached.read_text() == good
    assert not [path for path in cached.parent.iterdir() if path.name.endswith(".tmp")]


def test_an_unwritable_cache_does_not_fail_the_listing(shard: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("the cache dir would be below a file")
    assert list_shard(str(shard), blocker / "cache") == list_shard(str(shard))


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The tool's one cache folder: $TARSIER_BATCH_CACHE first, then an absolute $XDG_CACHE_HOME, then ~/.cache.
    monkeypatch.setenv("TARSIER_BATCH_CACHE", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "own" / "tar-index"
    monkeypatch.delenv("TARSIER_BATCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tarsier-batch" / "tar-index"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tarsier-batch" / "tar-index"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tarsier-batch" / "tar-index"


# ------------------------------------------------------------------------------------------------
# Reading members


def test_members_read_in_order_take_one_stream(shard: Path) -> None:
    index = list_shard(str(shard))
    with ShardReader(str(shard), index.version) as reader:
        assert [read_member(reader, member) for member in index.members] == [data for _, data in FILES]
        assert reader.opens == 1


def test_members_are_read_through_small_gaps(shard: Path) -> None:
    index = list_shard(str(shard))
    media = [(member, data) for member, (_, data) in zip(index.members, FILES) if member.name.endswith(".mp4")]
    with ShardReader(str(shard)) as reader:
        assert [read_member(reader, member) for member, _ in media] == [data for _, data in media]
        assert reader.opens == 1


@pytest.fixture
def gapped(tmp_path: Path) -> Path:
    """Small members behind 7 MiB and 9 MiB members of zeros: gaps on either side of REOPEN_GAP."""
    entries = [("a.mp4", b"a" * 100)]
    for name, size in (("g7", 7 * 2**20), ("g9", 9 * 2**20)):
        entries += [(f"{name}.mp4", bytes(size)), (f"after-{name}.mp4", name.encode() * 50)]
    return write_tar(tmp_path / "gapped.tar", entries)


def test_a_far_member_opens_a_new_stream_and_a_near_one_does_not(gapped: Path) -> None:
    members = {member.name: member for member in list_shard(str(gapped)).members}
    assert members["after-g7.mp4"].offset_data - members["g7.mp4"].offset_data < REOPEN_GAP
    assert members["after-g9.mp4"].offset_data - members["g9.mp4"].offset_data > REOPEN_GAP
    with ShardReader(str(gapped)) as reader:
        assert read_member(reader, members["a.mp4"]) == b"a" * 100
        assert read_member(reader, members["after-g7.mp4"]) == b"g7" * 50
        assert reader.opens == 1
        assert read_member(reader, members["after-g9.mp4"]) == b"g9" * 50
        assert reader.opens == 2
        assert read_member(reader, members["a.mp4"]) == b"a" * 100      # behind the stream
        assert reader.opens == 3
    with ShardReader(str(gapped)) as reader:
        sizes = [len(read_member(reader, member)) for member in members.values()]
        assert sizes == [100, 7 * 2**20, 100, 9 * 2**20, 100]
        assert reader.opens == 1


class StopAfter(threading.Event):
    """An event that sets itself after `checks` looks at it: a stop that arrives in the middle of a member."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks = checks

    def is_set(self) -> bool:
        if self.checks == 0:
            self.set()
        self.checks -= 1
        return super().is_set()


def test_a_stop_event_ends_a_read_between_chunks(gapped: Path) -> None:
    members = {member.name: member for member in list_shard(str(gapped)).members}
    stop = threading.Event()
    stop.set()
    with ShardReader(str(gapped), stop=stop) as reader:
        with pytest.raises(ReadStopped):
            read_member(reader, members["a.mp4"])
        stop.clear()
        assert read_member(reader, members["a.mp4"]) == b"a" * 100
    stop = StopAfter(checks=3)
    with ShardReader(str(gapped), stop=stop) as reader:
        with pytest.raises(ReadStopped, match="gapped.tar#g7.mp4: read stopped"):
            read_member(reader, members["g7.mp4"])
        assert stop.checks == -1   # looked at before each chunk: three 1 MiB chunks were read, the fourth refused
        stop.clear()
        assert read_member(reader, members["g7.mp4"]) == bytes(7 * 2**20)


def test_a_shard_cut_after_listing_is_a_shard_error(shard: Path) -> None:
    index = list_shard(str(shard))
    last = index.members[-1]
    with open(shard, "r+b") as out:
        out.truncate(last.offset_data + 3)
    with ShardReader(str(shard), stop=threading.Event()) as reader:
        assert read_member(reader, index.members[0]) == FILES[0][1]
        expected = f"^{re.escape(str(shard))}: the shard ends at byte {last.offset_data + 3}, before the end of member"
        with pytest.raises(ShardError, match=f"{expected} 'README'"):
            read_member(reader, last)


def test_a_shard_changed_since_listing_is_refused(shard: Path) -> None:
    index = list_shard(str(shard))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with ShardReader(str(shard), index.version) as reader:
        with pytest.raises(ShardError, match="the shard changed since it was listed"):
            read_member(reader, index.members[0])
    with ShardReader(str(shard)) as reader:   # without a version nothing is compared
        assert read_member(reader, index.members[0]) == FILES[0][1]


# ------------------------------------------------------------------------------------------------
# URLs: fsspec's in-memory store runs the same code as s3://


def test_a_url_shard_is_listed_and_read_like_a_local_one(shard: Path, memory: tuple) -> None:
    fs, root = memory
    fs.pipe_file(f"{root}/shard-000.tar", shard.read_bytes())
    url = f"memory://{root}/shard-000.tar"
    index = list_shard(url)
    local = list_shard(str(shard))
    assert (index.shard, index.members, index.siblings) == (url, local.members, local.siblings)
    with ShardReader(url, index.version) as reader:
        assert [read_member(reader, member) for member in index.members] == [data for _, data in FILES]
        assert reader.opens == 1
    with ShardReader(url, "another version") as reader:
        with pytest.raises(ShardError, match=f"^{re.escape(url)}: the shard changed since it was listed"):
            read_member(reader, index.members[0])


def test_a_url_shard_index_is_cached_by_version(shard: Path, memory: tuple, tmp_path: Path) -> None:
    fs, root = memory
    path = f"{root}/shard-000.tar"
    fs.pipe_file(path, shard.read_bytes())
    url = f"memory://{path}"
    first = list_shard(url, tmp_path / "cache")
    created = fs.store[path].created
    fs.pipe_file(path, b"\xff" * shard.stat().st_size)
    with pytest.raises(ShardError):
        list_shard(url, tmp_path / "cache")     # a new object: a new version, listed again, and no tar
    fs.store[path].created = created            # the same version as the first listing
    assert list_shard(url, tmp_path / "cache") == first


def test_a_cut_url_shard_lists_what_came_before_the_cut(shard: Path, memory: tuple) -> None:
    fs, root = memory
    fs.pipe_file(f"{root}/cut.tar", shard.read_bytes()[:cut_points(shard)["in a later header"]])
    index = list_shard(f"memory://{root}/cut.tar")
    assert index.members == list_shard(str(shard)).members[:1] and "damaged or cut" in index.problem


def test_importing_tars_loads_neither_fsspec_nor_torch() -> None:
    code = "import sys, tarsier_batch.inputs.tars; print(sorted({'fsspec', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]"
