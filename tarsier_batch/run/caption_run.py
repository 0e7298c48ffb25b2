"""One captioning run over an output: what `tarsier caption` does, as a library object.

    from tarsier_batch import CaptionRun, CaptionSettings, RunSettings
    outcome = CaptionRun(["./videos"], "results.parquet", RunSettings(CaptionSettings(model="demo"))).execute()

A run takes the output's lock, reads what earlier runs stored, refuses rows made with other
settings, plans what is new, loads the model (only if something is), captions while saving
finished rows in part files, and writes the output once, atomically. Running it again over the
same output continues it. Progress goes to a `RunReporter`; how the run ended comes back as a
`RunOutcome`, never by printing or exiting. Problems the caller can fix (a bad setting, an output
of another kind or in a folder that refuses writes, other settings than the stored rows', a missing
model) raise before anything is written: `SettingsError`, `OutputError`, `SettingsMismatchError`,
`ModelNotFoundError`, `ValueError`, `fork_server.UnguardedScriptError` (a script without its `__main__`
guard); another run writing the same output raises `OutputLockedError`.
"""


from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import pyarrow as pa

from ..errors import one_line
from ..inputs.manifest import Manifest
from ..inputs.segments import SegmentsError
from ..inputs.sources import Discovery, MediaItem, discover, row_id_of
from ..media import MediaType, Span
from ..model.checkpoints import ModelNotFoundError, local_checkpoint, needs_building, tiny_model_dir
from ..model.collector import collection_paused
from ..outputs.formats import OutputError, OutputTarget
from ..outputs.lock import OutputLock
from ..outputs.remote import RemoteOutput, UploadError, output_at
from ..outputs.results import CaptionResult
from ..outputs.resume import Plan, check_settings, describe_plan, settings_match, stored_spans
from ..outputs.store import OutputWriteError, ResultStore, StoredRows
from ..outputs.stream import JsonLinesStream
from ..progress import Reporter, RunStats, plural, summary_line, summary_rows
from ..settings import CaptionSettings, RunSettings, SettingsError, resume_settings
from ..storage import redact, redact_text
from ..workers.fork_server import check_main_is_guarded, start_decoding_server
from .backend import Backend, LoggingReporter, RunReporter, run_provenance
from .loop import ItemLoop
from .outcome import LoadingCrashed, RunOutcome, Status, Terminated, stopped_by
from .plan import RunFacts, plan_of

if TYPE_CHECKING:
    from ..api import Captioner


def start_decoding_for(settings: CaptionSettings) -> None:
    """Start the decoding fork server, preloading the processor of the model's family where the model is on this
    disk already (which it reads from its config.json)."""
    start_decoding_server(local_checkpoint(settings.model))


def load_captioner(settings: CaptionSettings, items: int | None = None) -> Backend:
    """The model, loaded as `settings` say (the one place a run loads it), to caption `items` items."""
    if settings.isolate_decoding:
        start_decoding_for(settings)   # first: its imports overlap this process's (torch, the model's code), the load
    with collection_paused():   # torch's import (the Captioner pauses the collector itself while it loads)
        from ..api import Captioner
    return Captioner(settings, items)


class CaptionRun:
    """Caption `inputs` into `out`, continuing what earlier runs over `out` left.

    `inputs`: paths (files, folders, globs), a `Discovery` or a `Manifest` (its kept columns go
    into the rows). `out`: a .parquet, .jsonl or .csv path or object store URL (s3://, gs://,
    az://), an `OutputTarget` (a folder of shards) or a `RemoteOutput` (shards at a URL), or an
    open text stream that gets JSON Lines in input order and keeps nothing to continue.
    `captioner`: a model loaded earlier, to share between runs (its settings are the
    run's caption settings). `load`: what makes the `Backend` from the caption settings, when
    there is something to caption (default: load the model here; `runners.ray.connect`: a Ray
    cluster). `source` names the inputs in messages. `started`: when the run's wall time begins, a
    `time.perf_counter()` reading (default: now; the command's is when its process started).
    """

    def __init__(self, inputs: Iterable[str | Path] | Discovery | Manifest,
                 out: str | Path | OutputTarget | RemoteOutput | TextIO,
                 settings: RunSettings | None = None, reporter: RunReporter | None = None,
                 captioner: Captioner | None = None, load: Callable[[CaptionSettings], Backend] | None = None,
                 source: str | None = None, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        self._loading_started: float | None = None   # when the model began to load, once it has
        settings = settings or RunSettings()
        if captioner is not None:
            settings = replace(settings, caption=captioner.settings)
        self.reporter = reporter or LoggingReporter()
        self._backend: Backend | None = captioner
        self._load_backend = load
        if load is None and settings.caption.isolate_decoding:
            check_main_is_guarded()   # now, not once the model is loaded
        try:
            settings.segments.check_available()
        except SegmentsError as error:
            raise SettingsError.of(error) from None
        self.stream = out if hasattr(out, "write") else None
        output = None if self.stream is not None else \
            out if isinstance(out, (OutputTarget, RemoteOutput)) else output_at(out)  # type: ignore[arg-type]
        found, kept_fields, source = self._found(inputs, settings.key, source)
        self.source = redact_text(source) if source else "the inputs"   # named in messages: no signature in them
        self.plan = plan_of(RunFacts(settings, found, output, kept_fields))
        for note in self.plan.notes:
            self.reporter.info(note)
        self.settings, self.columns, self.remote = self.plan.settings, self.plan.columns, self.plan.remote
        self.discovery = self.plan.discovery   # its videos cut into their segments before captioning
        # The store works on a remote output's staged copy as on any local output.
        self.store = self._store(self.plan.target) if self.plan.target is not None else None
        self.outcome: RunOutcome | None = None   # how the run ended, once it has
        self._segmented = False   # the videos were cut into their windows (--segments fixed)
        self._no_cut = 0          # videos the scene detector found no cut in (`Segmenting.found_no_cut`)

    def _found(self, inputs: Iterable[str | Path] | Discovery | Manifest, key_mode: str, source: str | None
               ) -> tuple[Discovery, tuple[pa.Field, ...], str | None]:
        """The inputs' items (discovered, when they are paths), a manifest's kept columns, and what names the
        inputs in messages; warns of manifest columns renamed, folders that could not be read and named inputs
        without media."""
        kept_fields: tuple[pa.Field, ...] = ()
        if isinstance(inputs, Manifest):
            for name, renamed in inputs.renamed.items():
                self.reporter.warning(f"manifest column {name!r} is an output column too; kept as {renamed!r}")
            inputs, kept_fields = inputs.discovery, tuple(inputs.kept_fields)
        elif not isinstance(inputs, Discovery):
            listed = [str(path) for path in inputs]
            source = source or " ".join(listed)
            inputs = discover(listed, key_mode=key_mode)
        if inputs.items:   # otherwise the run's outcome says why the inputs hold no media
            for problem in inputs.unreadable:
                self.reporter.warning(f"warning: cannot read {problem}")
            for named in inputs.without_media:
                self.reporter.warning(f"warning: no supported media in {named}")
        return inputs, kept_fields, source

    @property
    def items(self) -> list[MediaItem]:
        """The run's items (its shard's, with `RunSettings.shard`)."""
        return self.discovery.items

    def no_media(self) -> RunOutcome | None:
        """The outcome of a run whose inputs hold no media (None when they hold some)."""
        if self.plan.all_items:
            return None
        found = self.discovery
        # An unreadable folder is the reason; that the rest holds no media is news only if there is a rest.
        reasons = [f"cannot read {problem}" for problem in found.unreadable]
        if not reasons or found.skipped_count or found.without_media:
            reasons.append(f"no supported media in {self.source} "
                           f"({plural(found.skipped_count, 'other file')} skipped)")
        message = "; ".join(reasons)
        return RunOutcome(Status.SOME_FAILED if self.settings.fail_on_empty or self.failed_inputs else Status.NO_MEDIA,
                          message)

    @property
    def failed_inputs(self) -> int:
        """Inputs that gave no rows although they should have: folders that could not be read, and inputs named
        (not piped) that hold no media."""
        return len(self.discovery.unreadable) + len(self.discovery.without_media)

    def describe(self) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], int]]:
        """What the run would do with each input, loading no model and writing nothing (`--dry-run`):
        (action, path, reason) lines, and counts by (action, kind of reason)."""
        if self.remote is None:
            stored = self._stored(self.store)
        else:
            with self.remote.peek(outputs=not self.settings.overwrite) as copy:
                stored = self._stored(self._store(copy.target))
        self._cut_into_segments(stored)
        plan, later = self.plan.resume(self.items, stored)
        return describe_plan(self.discovery, stored, plan, {item.row_id for item in later},
                             tuple(self.plan.questions or ()))

    def execute(self) -> RunOutcome:
        """Run to the end."""
        results = self.results()
        try:
            for _ in results:
                pass
        except (KeyboardInterrupt, Terminated) as stop:
            if results.gi_frame is None:   # raised by the run before it could handle stops (taking the lock)
                raise
            # It arrived here, between two results: the run handles it where it stands.
            for _ in _thrown(results, stop):
                pass
        assert self.outcome is not None
        return self.outcome

    def results(self) -> Generator[CaptionResult, None, None]:
        """Run, yielding each item's result as its row is saved (in the order items finish); `outcome` says
        how the run ended.

        Leaving the loop early stops the run as Ctrl-C does: the finished rows are saved for the
        next run and the output is not changed.
        """
        self.outcome = self.no_media()
        if self.outcome is not None:
            return
        with self._locked():
            try:
                if self.remote is not None:   # under the lock: what the store holds now is the truth
                    self.remote.pull(outputs=not self.settings.overwrite)
                stored = self._stored(self.store)
                # Nothing stored: every row is to caption, so the model is wanted whatever the probe finds, and
                # loads while the workers read the videos.
                self._cut_into_segments(stored, load_meanwhile=not stored.rows)
                plan, later = self.plan.resume(self.items, stored)
                self.outcome = yield from self._caption(plan, len(later), stored)
            except (KeyboardInterrupt, Terminated) as stop:   # while loading, or writing the output
                status, reason = stopped_by(stop)
                untouched = self._output_untouched() if self.store is not None else "the stream was not changed"
                self.outcome = RunOutcome(status, f"{reason}; {untouched}; run the same command again to continue")

    # --- the steps ------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        target = self.plan.target
        if target is None:
            yield
        elif self.remote is not None:
            with self.remote.held():
                if self.remote.lock.taken_over:
                    self.reporter.warning(f"warning: took over the lock of {self.remote.shown} from "
                                          f"{self.remote.lock.taken_over}: its lease ran out (a run that died?)")
                yield
        else:
            lock = OutputLock(target.path)
            try:
                target.path.parent.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except OSError as error:   # the first write beside the output: a folder that refuses it says so here
                raise target.unwritable(error) from None
            try:
                yield
            finally:
                lock.release()

    def _cut_into_segments(self, stored: StoredRows, load_meanwhile: bool = False) -> None:
        """With `--segments`, each video of the run becomes its spans (once). A video whose every segment is
        `stored`, from the same version of the file, is cut as it was (a re-run opens no video it has all the rows
        of). What cutting the others needs of them (their length, their shots) is read in decoding workers, where
        a file that crashes or hangs a decoder costs only its probe (and keeps the file whole: its decoding then
        says what is wrong). `load_meanwhile`: load the model while they read, for all the items there may be
        (the segments are not counted yet)."""
        segmenting = self.settings.segments
        if segmenting.mode == "whole" or self._segmented:
            return
        videos = [item for item in self.items if item.media_type is MediaType.VIDEO and item.span is None]
        spans = stored_spans(videos, stored.rows.values())
        if segmenting.mode == "scenes":
            self._no_cut = sum(segmenting.cut_nowhere(known) for known in spans.values())
        unknown = [item for item in videos if item.row_id not in spans]
        if unknown:
            spans |= self._probed_spans(unknown, load_meanwhile)
        self.discovery = replace(self.discovery, items=segmenting.split(self.items, spans))
        self._segmented = True

    def _probed_spans(self, videos: list[MediaItem], load_meanwhile: bool) -> dict[str, list[Span]]:
        """The spans of `videos` (by row id) from what decoding workers read of them; a video they could not read
        has none."""
        from ..workers.probe import video_facts  # here: the decoding modules import torch
        from ..workers.sizing import default_workers

        segmenting, caption = self.settings.segments, self.settings.caption
        facts = video_facts(videos, segmenting, caption.workers or default_workers(), caption.decode_timeout_s,
                            meanwhile=partial(self._load, None) if load_meanwhile else None)
        spans: dict[str, list[Span]] = {}
        for item, known in zip(videos, facts):
            if known is None or known.duration_s <= 0:
                continue
            if known.by_frames:
                self.reporter.warning(f"warning: {redact(item.path)}: its timestamps are missing or jump; its "
                                      f"segments are counted in frames at its frame rate ({known.duration_s:g} s)")
            if segmenting.mode == "scenes":
                self._no_cut += segmenting.found_no_cut(known)
            spans[item.row_id] = segmenting.spans(known)
        return spans

    def _store(self, target: OutputTarget) -> ResultStore:
        remote = self.remote
        return ResultStore(target, self.columns, self.settings.flush_rows, self.settings.flush_seconds,
                           on_written=remote.written if remote else None, on_removed=remote.removed if remote else None)

    def _stored(self, store: ResultStore | None) -> StoredRows:
        """What earlier runs left, checked against these settings: nothing when streaming, nor when overwriting
        unless an overwriting run with the same settings was stopped part way (its rows, continued)."""
        if store is None:
            return StoredRows()
        stored = store.read(output=not self.settings.overwrite)
        if self.settings.overwrite and not (stored.replaces_output
                                            and settings_match(stored.settings, resume_settings(self.settings))):
            return StoredRows()
        check_settings(stored.settings, resume_settings(self.settings))
        return stored

    def _caption(self, plan: Plan, later: int, stored: StoredRows) -> Generator[CaptionResult, None, RunOutcome]:
        """Caption what the plan says (`later` items are left for a later run) and write the output; returns the
        outcome."""
        for problem in stored.unreadable_parts:
            self.reporter.warning(f"warning: unreadable part file {problem}")
        stats = RunStats(total=plan.items_to_caption, skipped=self.discovery.skipped_count,
                         already_done=len(plan.done), failed_earlier=plan.failed_rows,
                         failed_inputs=self.failed_inputs, missing_kept=plan.missing_kept,
                         missing_pruned=plan.missing_pruned, left_for_later=later,
                         prefix_cache=self.settings.caption.prefix_cache, started=self.started)
        sink = self.store or JsonLinesStream(plan.captioned_ids(self.items), self.stream, self.columns)  # type: ignore[arg-type]
        loop = ItemLoop(self.items, plan, sink, stats, self.settings.caption.model, self.columns)
        if not plan.todo:
            # A shard with no items of its own still writes its (empty) output, for `tarsier merge`.
            return self._write_output(loop, stored, stored.provenance or {"settings": resume_settings(self.settings)})
        backend = self._load(len(plan.todo))
        stats.loading_started = self._loading_started
        provenance = run_provenance(backend, self.settings)
        if self.settings.overwrite and not settings_match(stored.settings, provenance["settings"]):
            # The stopped overwriting run it continues had its model resolve otherwise (another revision): over.
            fresh, later_items = self.plan.resume(self.items, StoredRows())
            return (yield from self._caption(fresh, len(later_items), StoredRows()))
        check_settings(stored.settings, provenance["settings"])
        reuse_before = backend.prompt_reuse()
        stopped = yield from self._run_loop(backend, loop, provenance, stored.replaces_output)
        reuse = backend.prompt_reuse()
        if reuse is not None and reuse_before is not None:   # this run's share, with a captioner shared by runs
            stats.prompt_positions, stats.reused_positions, stats.shared_positions = (
                now - then for now, then in zip(reuse, reuse_before))
        # Again: a cluster's actors tell how they captioned once they have
        return stopped or self._write_output(loop, stored, run_provenance(backend, self.settings))

    def _load(self, items: int | None) -> Backend:
        if self._loading_started is None:   # the first call's: later ones find the model loaded (or loading)
            self._loading_started = time.perf_counter()
        if self._backend is not None:
            return self._backend
        model = self.settings.caption.model
        if self.store is not None:
            self.store.check_room({"settings": resume_settings(self.settings)})   # before the minutes of loading
        if needs_building(model):
            self.reporter.info(f"building the random-weight model {model} (first use; cached in "
                               f"{tiny_model_dir(model)}; its captions are noise)")
        try:
            with self.reporter.loading(model):
                backend = (self._load_backend or partial(load_captioner, items=items))(self.settings.caption)
        except (ModelNotFoundError, ValueError):
            raise
        except (OSError, RuntimeError) as error:   # unreadable files, weights of other shapes, a device too small:
            raise ValueError(one_line(error)) from error   # the caller's to fix
        except Exception as error:   # a bug of ours while loading: its cause carries the traceback
            raise LoadingCrashed(one_line(error)) from error
        self.reporter.info(backend.describe())
        self._backend = backend
        return backend

    def _run_loop(self, backend: Backend, loop: ItemLoop, provenance: dict[str, Any], continues_replacing: bool
                 ) -> Generator[CaptionResult, None, RunOutcome | None]:
        """Caption the plan's items, saving rows as they finish; returns None when every item got its row,
        else the outcome of the stop. `continues_replacing`: the stored rows are a stopped overwriting run's."""
        try:
            if self.store is not None:
                # Under the same stop handling as the captioning: once the work directory exists, a stop
                # saves rows and says how to resume.
                overwrite = self.settings.overwrite
                self.store.begin(provenance, fresh=overwrite and not continues_replacing,
                                 replaces_output=overwrite or continues_replacing)
            loop.stats.start_captioning()
            with _entered(self.reporter.progress(loop.stats)) as reporters:
                yield from loop.run(backend, reporters)
                loop.store.flush()
            return None
        except OutputError:   # the work directory could not be made: nothing of this run was saved
            raise
        except GeneratorExit:   # the caller left the loop: save what finished, change nothing else
            self.outcome = self._stopped(loop, Status.INTERRUPTED, "stopped by the caller", None)
            raise
        except (KeyboardInterrupt, Terminated) as stop:
            (status, reason), error = stopped_by(stop), None
        except BrokenPipeError:  # `-o - | head`: the reader has all it wants
            status, reason, error = Status.STDOUT_CLOSED, "stdout was closed", None
        except Exception as crash:  # a bug, a dead device or a full disk: keep what finished, say what happened
            status, error = Status.CRASHED, crash
            reason = f"crashed ({crash if isinstance(crash, OutputWriteError) else one_line(crash)})"
        if self.store is not None:
            # What the next run reads if it has nothing left to caption: a cluster's actors may have told more by now.
            with suppress(OSError):
                self.store.record_provenance(run_provenance(backend, self.settings))
        return self._stopped(loop, status, reason, error)

    def _stopped(self, loop: ItemLoop, status: Status, reason: str, error: BaseException | None) -> RunOutcome:
        """Save the rows that finished before a stop; the outcome says where they are."""
        stats = loop.stats
        if self.store is None:
            return RunOutcome(status, f"{reason}; {plural(loop.store.saved_rows, 'row')} went to stdout", stats,
                              error=error)
        unsent = 0   # rows saved in parts that did not reach the object store
        try:
            self.store.flush()
            if self.remote is not None:
                self.remote.drain()
            lost = ""
        except OutputWriteError as write_error:
            lost = f"; {write_error}"
            unsent = write_error.rows if isinstance(write_error, UploadError) else 0
        saved = self.store.saved_rows - unsent + stats.already_done
        return RunOutcome(status, f"{reason}{lost}; {plural(saved, 'finished row')} {'is' if saved == 1 else 'are'} "
                                  f"saved in {self.store.work_shown} and {self._output_untouched()}; run the same "
                                  f"command again to resume", stats, error=error)

    def _output_untouched(self) -> str:
        """What a stop left of --out: an earlier run's output unchanged, or none yet (a first run's rows wait in the
        work directory until every item has one)."""
        assert self.store is not None
        if self.store.output_existed is False:
            return f"{self.store.out_shown} is not written yet"
        if self.store.replaces_output and self.store.holds_parts():
            return f"{self.store.out_shown} was not changed yet (a run with the same settings goes on replacing it)"
        return f"{self.store.out_shown} was not changed"

    def _write_output(self, loop: ItemLoop, stored: StoredRows, provenance: dict[str, Any]) -> RunOutcome:
        """Write the output with every row (unless nothing changed); the outcome carries the summary.

        A shard's output also records where its rows go among all the run's items, so it is written
        again whenever it runs: the inputs may have grown.
        """
        stats, store, shard = loop.stats, self.store, self.settings.shard
        if store is None:
            written = f"stdout ({plural(loop.store.saved_rows, 'row')})"
        else:
            rows = loop.final_rows()
            unchanged = store.target.exists() and not stored.parts and not stats.done and shard is None \
                and [row_id_of(row) for row in rows] == list(stored.rows) and stored.long == self.columns.long \
                and _same_segment_counts(rows, stored)
            if shard:
                provenance = {**provenance, "shard": shard.provenance(self.plan.all_items, rows)}
            if not unchanged:
                try:
                    store.commit(rows, provenance, {"complete": True, **stats.as_dict()})
                    if self.remote is not None:
                        self.remote.publish()
                except OutputWriteError as error:
                    return RunOutcome(Status.CRASHED, f"crashed ({error}); the finished rows are saved in "
                                      f"{store.work_shown}; free space and run the same command again to write "
                                      f"{store.out_shown}", stats, error=error)
            counted = plural(len(rows), 'row') if not self.columns.long else \
                f"{plural(len(rows), 'item')}, a row per question"
            written = f"{store.out_shown} ({counted}{', unchanged' if unchanged else ''})"
        skipped = ", ".join(f"{count} {suffix}" for suffix, count in sorted(self.discovery.skipped.items()))
        notes = [("no scene cut", f"{plural(self._no_cut, 'video')}: {self.settings.segments.without_cuts()}")] \
            if self._no_cut else []
        summary = summary_rows(stats, written, skipped, notes)
        return RunOutcome(Status.SOME_FAILED if stats.failed or stats.failed_inputs else Status.DONE,
                          summary_line(summary), stats, summary, output=store.out_shown if store else None)


def _same_segment_counts(rows: list[dict[str, Any]], stored: StoredRows) -> bool:
    """Whether `rows` (in the stored rows' order) count their files' segments as the stored rows do: rows of an
    output written before they were counted get their counts written, so that the next run need not open their
    videos."""
    return all(row.get("num_segments") == old.get("num_segments") for row, old in zip(rows, stored.rows.values()))


def _thrown(results: Generator[Any, None, None], stop: BaseException) -> Iterator[Any]:
    """`stop` raised in `results` where it is suspended, then what it yields after handling it."""
    try:
        yield results.throw(stop)
    except StopIteration:
        return
    yield from results


@contextmanager
def _entered(reporters: list[Reporter]) -> Iterator[list[Reporter]]:
    """The reporters, each entered (their displays shown) until the block ends."""
    with ExitStack() as displays:
        for reporter in reporters:
            displays.enter_context(reporter)
        yield reporters
