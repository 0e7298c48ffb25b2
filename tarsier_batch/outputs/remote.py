"""Outputs at object store URLs (s3://, gs://, az://): a local staging mirror of the output and its work prefix.

`ResultStore`, the formats and resume work on local paths. For `--out s3://b/r.parquet` they work
on a staging copy, `$XDG_CACHE_HOME/tarsier-batch/staging/<hash of the URL>/r.parquet` (with its
`.r.parquet.tarsier/` work directory beside it), and this module keeps the store in step:

- `held`: the lock object (`lock.RemoteLock`) is taken, the staging directory emptied (the store is
  the truth, not what a killed run left here), and `pull` downloads the output and the parts and
  settings an unfinished run left under `s3://b/.r.parquet.tarsier/`;
- while the run goes, every file the store writes in its work directory is uploaded under the same
  name by one background thread (`written`; the run never waits for the network where it
  saves rows), and parts that compaction replaced are deleted after the part replacing them is up;
- `publish`: the committed output is uploaded, each object with one `put_file` (an object is
  visible only once whole, so a reader never sees a torn one), then the work prefix is deleted.

A run killed at any point leaves the output as it was and the uploaded parts, which the next
run pulls and resumes from.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import Worded, one_line, plural
from ..storage import READ_ONLY_SCHEMES, cache_home, filesystem, is_url, redact, redact_text, scheme, with_retries
from .formats import META_SUFFIX, OutputError, OutputTarget, TextWithMeta
from .lock import RemoteLock
from .store import SETTINGS_FILE, OutputWriteError, work_name

DRAIN_TIMEOUT_S = 300.0   # the longest a run waits for its queued uploads when it stops or ends
_STOP_TIMEOUT_S = 10.0


class UploadError(OutputWriteError):
    """Parts saved in the staging directory did not reach the store: `rows` finished rows are not there."""

    def __init__(self, message: str, rows: int):
        super().__init__(message)
        self.rows = rows


def staging_root() -> Path:
    """Where outputs at URLs are staged: a cache (a killed run's copy is only ever replaced, never read)."""
    return cache_home() / "staging"


def output_at(location: str | Path, shard_rows: int | None = None,
              webdataset: bool = False) -> OutputTarget | RemoteOutput:
    """The output at `location`: a local path, or an object store URL staged locally (a read-only scheme or a
    missing storage backend raises `OutputError` or `StorageError` here, before anything is read or written).
    With `shard_rows`, a folder (or prefix) of Parquet shards; with `webdataset`, of WebDataset shards."""
    if isinstance(location, str) and is_url(location):
        return RemoteOutput(location, shard_rows, webdataset=webdataset)
    if isinstance(location, str) and location.endswith(("/", os.sep)) and not (shard_rows or webdataset):
        raise OutputError(Worded("{out} {location} names a folder; give a file in it, such as {example}, or "
                                 "{out_dir} {location} for shards", location=location,
                                 example=f"{location}results.parquet"))
    return OutputTarget(Path(location), shard_rows, webdataset=webdataset)


class RemoteOutput:
    """`--out URL` (one file) or, with `shard_rows` or `webdataset`, `--out-dir URL` (a prefix of shards), staged
    locally.

    `target` is the staged `OutputTarget` a `ResultStore` works on (it names the URL in messages);
    give the store `written` and `removed` as its `on_written` and `on_removed`.
    Construction only names things: nothing is read or written before `held`.
    """

    def __init__(self, url: str, shard_rows: int | None = None, staging: Path | None = None,
                 webdataset: bool = False):
        self.url, self.shown = url, redact(url)
        folder = bool(shard_rows) or webdataset
        setting = Worded("{out_dir}" if folder else "{out}")
        if scheme(url) in READ_ONLY_SCHEMES:
            raise OutputError(Worded("{setting} {shown}: {scheme}:// is read-only; write to s3://, gs://, az:// or a "
                                     "local path", setting=setting, shown=self.shown, scheme=scheme(url)))
        self.fs, path = filesystem(url)
        self.parent, _, name = path.rstrip("/").rpartition("/")
        if not self.parent or not name:
            raise OutputError(Worded("{setting} {shown} names a bucket; give an object in it, such as {example}",
                                     setting=setting, shown=self.shown, example=self.shown.rstrip("/") + "/" +
                                     ("captions" if folder else "captions.parquet")))
        self.staging = staging or staging_root() / hashlib.sha256(self.shown.encode()).hexdigest()[:16]
        self.target = OutputTarget(self.staging / name, shard_rows, url=self.shown, webdataset=webdataset)
        self.lock = RemoteLock(url)
        self._uploads = _Uploader()

    @contextmanager
    def held(self) -> Iterator[RemoteOutput]:
        """The lock held and the staging directory empty and ours; on leaving (however: a stop, a crash), the
        queued uploads drained, the lock released and the staging directory removed."""
        self.lock.acquire()
        try:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging.mkdir(parents=True, exist_ok=True)
            yield self
        finally:
            try:
                self._uploads.close()
            finally:
                shutil.rmtree(self.staging, ignore_errors=True)
                self.lock.release()

    @contextmanager
    def peek(self, outputs: bool = True) -> Iterator[RemoteOutput]:
        """This output pulled into a private temporary directory (as `pull`), without the lock (`--dry-run`: it
        writes nothing, and a run over the same URL on this host may be using the staging directory)."""
        with tempfile.TemporaryDirectory(prefix="tarsier-peek-") as directory:
            copy = RemoteOutput(self.url, self.target.shard_rows, Path(directory), self.target.webdataset)
            copy.pull(outputs)
            yield copy

    def pull(self, outputs: bool = True) -> None:
        """Download the output (unless not `outputs`: a run that overwrites it never reads it) and the parts
        and settings an unfinished run left, so the store reads locally what the object store holds."""
        if outputs:
            for key in self._output_objects():
                self._download(key)
        self.fs.invalidate_cache(self._key(self._work_dir))
        try:
            found = with_retries(lambda: self.fs.find(self._key(self._work_dir)))
        except FileNotFoundError:
            found = []
        for key in found:
            name = key.rpartition("/")[2]
            if name == SETTINGS_FILE or fnmatch.fnmatch(name, "part-*.parquet"):
                self._download(key)

    def written(self, path: Path) -> None:
        """Queue the upload of a file the store wrote in its work directory (a part, the settings)."""
        key = self._key(path)

        def upload() -> None:
            try:
                self.fs.put_file(str(path), key)
            except FileNotFoundError:
                if path.exists():
                    raise
                # Compacted before its turn: the merged part holding its rows is queued after it.
        self._uploads.submit(self._shown(path), upload, path)

    def removed(self, paths: list[Path]) -> None:
        """Queue the deletion of parts the store replaced (after the uploads queued before: the merged part)."""
        keys = [self._key(path) for path in paths]
        self._uploads.submit(f"old parts in {self._shown(self._work_dir)}", lambda: self.fs.rm(keys), removal=True)

    def drain(self) -> None:
        """Wait for the queued uploads; raise UploadError, counting the rows not in the store, if some failed or
        were still unfinished after DRAIN_TIMEOUT_S."""
        try:
            failed = self._uploads.drain()
        except OutputWriteError as error:
            failed = str(error)
        if failed:
            raise UploadError(failed, self._uploads.unsent_rows())

    def publish(self) -> None:
        """Upload the output the store committed in the staging directory, each object whole, then delete the
        work prefix. A failure raises OutputWriteError and leaves the output as it was and the parts in place."""
        try:
            self.drain()
            unsent = ""
        except UploadError as error:   # the output holds those rows: they reach the store with it
            unsent = f"; {plural(error.rows, 'finished row')} had not reached the store either ({error})"
        self.lock.check()
        target, uploaded = self.target, ""
        try:
            files = target.shards() if target.is_folder else \
                [path for path in (target.meta_path, target.path) if path.exists()]   # as written: the meta first
            for path in files:
                uploaded = self._shown(path)
                with_retries(lambda: self.fs.put_file(str(path), self._key(path)))
            uploaded = self.shown
            if target.is_folder:   # shards beyond the new count
                stale = [key for key in self._output_objects() if key not in {self._key(p) for p in files}]
                if stale:
                    with_retries(lambda: self.fs.rm(stale))
            with suppress(FileNotFoundError):   # no parts: nothing was saved before the end (a merge)
                with_retries(lambda: self.fs.rm(self._key(self._work_dir), recursive=True))
        except OSError as error:
            raise OutputWriteError(f"cannot upload {uploaded}: {redact_text(one_line(error))}{unsent}") from error

    @property
    def _work_dir(self) -> Path:
        return self.target.path.parent / work_name(self.target.path.name)

    def _key(self, path: Path) -> str:
        """The object a staged file mirrors: the staging directory stands for the output's parent prefix."""
        return f"{self.parent}/{path.relative_to(self.staging).as_posix()}"

    def _shown(self, path: Path) -> str:
        return self.target.shown_beside(path.relative_to(self.staging).as_posix())

    def _output_objects(self) -> list[str]:
        """The keys of the output as the store holds it: the file (and its meta file), or the shards."""
        key = self._key(self.target.path)
        self.fs.invalidate_cache(key)
        if not self.target.is_folder:
            if not _is_object(self.fs, key, self.shown):
                return []
            meta = key + META_SUFFIX   # JSON Lines and CSV keep their provenance beside them
            has_meta = isinstance(self.target.kind, TextWithMeta) and _is_object(self.fs, meta, self.shown)
            return [key, meta] if has_meta else [key]
        try:
            listed = with_retries(lambda: self.fs.ls(key, detail=True))
        except FileNotFoundError:
            return []
        shards, strangers = [], []
        for entry in listed:
            name = entry["name"].rstrip("/").rpartition("/")[2]
            if name.startswith("."):
                continue
            (shards if entry.get("type") == "file" and self.target.kind.owns(name) else strangers).append(
                entry["name"])
        if strangers:
            names = ", ".join(sorted(name.rpartition("/")[2] for name in strangers)[:3])
            raise OutputError(Worded("{out_dir} {shown} holds other objects ({names}); give an empty or new prefix, "
                                     "or the prefix of an earlier sharded run", shown=self.shown, names=names))
        return sorted(shards)

    def _download(self, key: str) -> None:
        local = self.staging / key[len(self.parent) + 1:]
        local.parent.mkdir(parents=True, exist_ok=True)
        with_retries(lambda: self.fs.get_file(key, str(local)))


def _is_object(fs: Any, key: str, shown: str) -> bool:
    """Whether `key` is an object; a prefix holding objects (a "folder") is refused as a file output."""
    try:
        info = with_retries(lambda: fs.info(key))
    except FileNotFoundError:
        return False
    if info.get("type") == "directory":
        raise OutputError(Worded("{out} {shown} is a prefix holding objects; give an object name such as "
                                 "{prefix}/results.parquet, or use {out_dir}", shown=shown, prefix=shown.rstrip("/")))
    return True


class _Uploader:
    """One daemon thread that runs queued uploads and deletions in order, each tried again on transient errors.

    After a failed upload, later deletions are skipped: the parts they would remove may hold rows the
    failed one was to carry (extra parts are harmless: the newest row of a path wins).
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[str, Callable[[], None], Path | None, bool] | None] = \
            queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._failed: str | None = None
        self._unsent: set[Path] = set()   # files queued or failed, not yet in the store
        self._thread: threading.Thread | None = None

    def submit(self, what: str, task: Callable[[], None], path: Path | None = None, removal: bool = False) -> None:
        """Queue `task`; `path` is the file it uploads, counted as unsent until it succeeds."""
        with self._idle:
            self._pending += 1
            if path is not None:
                self._unsent.add(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True, name="tarsier-upload")
                self._thread.start()
        self._tasks.put((what, task, path, removal))

    def unsent_rows(self) -> int:
        """The rows of the parts not in the store (a part compacted since is counted in the part that merged it)."""
        with self._idle:
            unsent = [path for path in self._unsent if fnmatch.fnmatch(path.name, "part-*.parquet")]
        rows = 0
        for path in unsent:
            with suppress(OSError, pa.ArrowException):   # gone: compacted into a later part
                rows += pq.read_metadata(path).num_rows
        return rows

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> str | None:
        """Wait until every queued task ran; the first failure, if any. Raises OutputWriteError on a timeout."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout_s):
                raise OutputWriteError(f"{self._pending} uploads still unfinished after {timeout_s:g} s")
            return self._failed

    def close(self) -> None:
        """Drain (bounded) and stop the thread."""
        if self._thread is None:
            return
        try:
            self.drain()
        finally:
            self._tasks.put(None)
            self._thread.join(_STOP_TIMEOUT_S)
            self._thread = None

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            what, run, path, removal = task
            sent = False
            try:
                if not (removal and self._failed):
                    with_retries(run)
                sent = True
            except Exception as error:  # noqa: BLE001 - kept for the run to report; the thread goes on
                self._failed = self._failed or f"cannot upload {what}: {redact_text(one_line(error))}"
            finally:
                with self._idle:
                    if sent and path is not None:
                        self._unsent.discard(path)
                    self._pending -= 1
                    self._idle.notify_all()
