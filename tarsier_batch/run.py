"""One captioning run over an output: what `tarsier caption` does, as a library object.

    from tarsier_batch import CaptionRun, CaptionSettings, RunSettings
    outcome = CaptionRun(["./videos"], "results.parquet", RunSettings(CaptionSettings(model="demo"))).execute()

A run takes the output's lock, reads what earlier runs stored, refuses rows made with other
settings, plans what is new, loads the model (only if something is), captions while saving
finished rows in part files, and writes the output once, atomically. Running it again over the
same output continues it. Progress goes to a `RunReporter`; how the run ended comes back as a
`RunOutcome`, never by printing or exiting. Problems the caller can fix (a bad setting, an output
of another kind, other settings than the stored rows', a missing model) raise before anything is
written: `SettingsError`, `OutputError`, `SettingsMismatchError`, `ModelNotFoundError`, `ValueError`,
`fork_server.UnguardedScriptError` (a script without its `__main__` guard); another run writing
the same output raises `OutputLockedError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from .errors import one_line
from .inputs.manifest import Manifest
from .inputs.prompt_sets import PromptSetError, check_prompt_set
from .inputs.segments import SegmentsError
from .inputs.sources import Discovery, MediaItem, discover, row_id_of
from .media import MediaType
from .model.checkpoints import ModelNotFoundError, needs_building, tiny_model_dir
from .outputs.formats import OutputTarget
from .outputs.lock import OutputLock
from .outputs.remote import RemoteOutput, UploadError, output_at
from .outputs.results import CaptionResult
from .outputs.resume import Plan, check_settings, describe_plan, plan_run
from .outputs.schema import OutputColumns
from .outputs.store import OutputWriteError, ResultStore, StoredRows
from .outputs.stream import JsonLinesStream
from .outputs.writer import RowWriter
from .progress import LogReporter, Reporter, RunStats, plural, summary_line, summary_rows
from .settings import CaptionSettings, Resolved, RunSettings, SettingsError, resume_settings, shown
from .storage import redact, redact_text
from .workers.fork_server import check_main_is_guarded, start_decoding_server

if TYPE_CHECKING:
    from .api import Captioner

LOG = logging.getLogger("tarsier_batch")


class Status(str, Enum):
    """How a run ended."""

    DONE = "done"                      # every item of the run was captioned (or there was nothing to do)
    SOME_FAILED = "some_failed"        # some items failed; their rows carry an error
    NO_MEDIA = "no_media"              # the inputs hold no media
    INTERRUPTED = "interrupted"        # KeyboardInterrupt (Ctrl-C): finished rows are saved
    TERMINATED = "terminated"          # `Terminated` (SIGTERM): finished rows are saved
    STDOUT_CLOSED = "stdout_closed"    # the stream's reader went away ('-o - | head')
    CRASHED = "crashed"                # a bug, a failed device, a full disk: finished rows are saved


@dataclass
class RunOutcome:
    """How a run ended, what it wrote and how to go on."""

    status: Status
    message: str                                    # one line: the summary, or why and where rows are
    stats: RunStats | None = None
    summary: list[tuple[str, str]] = field(default_factory=list)   # the closing summary (a finished run)
    error: BaseException | None = None              # what crashed the run, for a traceback

    @property
    def ok(self) -> bool:
        return self.status in (Status.DONE, Status.NO_MEDIA)


class Terminated(BaseException):
    """SIGTERM arrived (a timeout, a scheduler, `docker stop`): the CLI raises it to stop a run like Ctrl-C."""


class LoadingCrashed(Exception):
    """Loading the model failed on a bug of this tool, not on the model given (its cause has the traceback)."""


class RunReporter(Protocol):
    """What a run tells as it goes."""

    def info(self, message: str) -> None:
        """What the run is doing (the model loaded, what it will caption)."""

    def warning(self, message: str) -> None:
        """Something the caller should know (an unreadable folder or part file)."""

    def loading(self, model: str) -> AbstractContextManager[object]:
        """Held while the model loads."""

    def progress(self, stats: RunStats) -> list[Reporter]:
        """The live displays of the captioning, updated through `stats`."""


class LoggingReporter:
    """Reports to the `tarsier_batch` logger (what a pipeline's logging set-up shows; with none, Python shows
    only warnings): what the run does, failures, and a progress line at most every 30 s."""

    def info(self, message: str) -> None:
        LOG.info(message)

    def warning(self, message: str) -> None:
        LOG.warning(message)

    def loading(self, model: str) -> AbstractContextManager[object]:
        LOG.info("loading %s", model)
        return nullcontext()

    def progress(self, stats: RunStats) -> list[Reporter]:
        return [LogReporter(stats, LOG.info)]


class Backend(Protocol):
    """Where a run's captions are made: a `Captioner` in this process, or a Ray cluster (`runners.ray.RayBackend`)."""

    def caption(self, items: Iterable[MediaItem], on_tokens: Callable[[int], None] | None = None,
                in_order: bool = True) -> Iterator[CaptionResult]:
        """One result per item: in input order, or (`in_order=False`) as each finishes."""

    def provenance(self) -> dict[str, Any]:
        """How the captions are made, stored with the output."""

    def resolved_settings(self) -> Resolved:
        """What loading settled that the settings may leave open."""

    def prompt_reuse(self) -> tuple[int, int, int] | None:
        """(prompt positions of the rows admitted, how many came computed from the prefix cache, how many from
        another question of the clip) since loading, or None where not known."""

    def describe(self) -> str:
        """One line for the user: the model and where it runs."""


def load_captioner(settings: CaptionSettings, items: int | None = None) -> Backend:
    """The model, loaded as `settings` say (the one place a run loads it), to caption `items` items."""
    if settings.isolate_decoding:
        start_decoding_server()   # first: its imports overlap this process's (torch, the model's code) and the load
    from .api import Captioner

    return Captioner(settings, items)


class ItemLoop:
    """The loop inside a run: feeds the plan's items to the backend and hands every finished row to the sink.

    An item whose content another item of the run shares (same key: links to one file,
    copies with `--key sha256`) is captioned once; each path still gets its own row.
    """

    def __init__(self, items: list[MediaItem], plan: Plan, store: RowWriter, stats: RunStats, model_name: str,
                 columns: OutputColumns):
        self.items, self.plan, self.store, self.stats = items, plan, store, stats
        self.model_name, self.columns = model_name, columns
        self.new_rows: dict[str, dict[str, Any]] = {}
        self._by_id = {item.row_id: item for item in items}

    def run(self, backend: Backend, reporters: list[Reporter]) -> Iterator[CaptionResult]:
        """Caption the plan's items, yielding each row's result as it is saved (same-content copies too), in the
        order they finish."""
        def on_tokens(count: int) -> None:
            self.stats.streamed_tokens += count
            self.store.flush_if_due()  # rows waiting for a flush are saved even while nothing finishes
            for reporter in reporters:
                reporter.on_tokens()

        # As each finishes, not in input order: a finished row is saved even while an earlier item still
        # generates (the output is put in order at the end; a stream keeps its own order).
        for result in backend.caption(self.plan.todo, on_tokens, in_order=False):
            for copy in [result, *self._copies(result)]:
                self._finish(copy, reporters)
                yield copy

    def final_rows(self) -> list[dict[str, Any]]:
        """Every row of the output; rows of earlier runs get this run's file facts and manifest columns."""
        rows = self.plan.ordered_rows(self.items, self.new_rows)
        return [{**row, **self.columns.item_values(self._by_id[row_id_of(row)])} if row_id_of(row) in self._by_id
                else row for row in rows]

    def _copies(self, result: CaptionResult) -> list[CaptionResult]:
        return [replace(result, path=item.row_path) for item in self.plan.sharing.get(result.key or "", [])]

    def _finish(self, result: CaptionResult, reporters: list[Reporter]) -> None:
        row = self.columns.row(result, self._by_id[result.row_id], self.model_name,
                               self.plan.earlier.get(result.row_id))
        self.new_rows[result.row_id] = row
        self.store.add(row)
        self.stats.record(result)
        for reporter in reporters:
            reporter.on_result(result)


class CaptionRun:
    """Caption `inputs` into `out`, continuing what earlier runs over `out` left.

    `inputs`: paths (files, folders, globs), a `Discovery` or a `Manifest` (its kept columns go
    into the rows). `out`: a .parquet, .jsonl or .csv path or object store URL (s3://, gs://,
    az://), an `OutputTarget` (a folder of shards) or a `RemoteOutput` (shards at a URL), or an
    open text stream that gets JSON Lines in input order and keeps nothing to continue.
    `captioner`: a model loaded earlier, to share between runs (its settings are the
    run's caption settings). `load`: what makes the `Backend` from the caption settings, when
    there is something to caption (default: load the model here; `runners.ray.connect`: a Ray
    cluster). `source` names the inputs in messages.
    """

    def __init__(self, inputs: Iterable[str | Path] | Discovery | Manifest,
                 out: str | Path | OutputTarget | RemoteOutput | TextIO,
                 settings: RunSettings | None = None, reporter: RunReporter | None = None,
                 captioner: Captioner | None = None, load: Callable[[CaptionSettings], Backend] | None = None,
                 source: str | None = None):
        settings = settings or RunSettings()
        if captioner is not None:
            settings = replace(settings, caption=captioner.settings)
        self.settings, self.reporter = settings, reporter or LoggingReporter()
        self._backend: Backend | None = captioner
        self._load_backend = load
        if load is None and settings.caption.isolate_decoding:
            check_main_is_guarded()   # now, not once the model is loaded
        try:
            settings.segments.check_available()
        except SegmentsError as error:
            raise SettingsError(str(error)) from None
        self.stream = out if hasattr(out, "write") else None
        output = None if self.stream is not None else \
            out if isinstance(out, (OutputTarget, RemoteOutput)) else output_at(out)  # type: ignore[arg-type]
        self.remote = output if isinstance(output, RemoteOutput) else None
        if self.stream is not None:
            settings.check_streamable()
        # The store works on a remote output's staged copy as on any local output.
        self.target = self.remote.target if self.remote is not None else output
        kept_fields = []
        if isinstance(inputs, Manifest):
            for name, renamed in inputs.renamed.items():
                self.reporter.warning(f"manifest column {name!r} is an output column too; kept as {renamed!r}")
            inputs, kept_fields = inputs.discovery, inputs.kept_fields
        elif not isinstance(inputs, Discovery):
            listed = [str(path) for path in inputs]   # type: ignore[union-attr]
            source = source or " ".join(listed)
            inputs = discover(listed, key_mode=settings.key)
        self.source = redact_text(source) if source else "the inputs"   # named in messages: no signature in them
        if self.target is not None:
            self.target.check_settings(settings)
            self.target.kind.check_rows([item.path for item in inputs.items])
        for problem in inputs.unreadable:
            self.reporter.warning(f"warning: cannot read {problem}")
        if settings.caption.prompt_set and any(item.prompt is not None for item in inputs.items):
            raise SettingsError("a manifest's prompt column and {prompt_set} do not go together yet: ask the "
                                "manifest's prompts as questions of the set, or leave the set out")
        inputs, settings = _with_own_prompt_sets(inputs, settings)
        if settings.long and not settings.caption.prompt_set:
            raise SettingsError("{long} lays out the answers of several questions, a row per question: ask them "
                                "with {prompt_set} or a manifest's prompts column")
        self.settings = settings
        questions = settings.caption.prompt_set
        if len(questions) > 1 and settings.caption.pruning and settings.caption.prune_method == "fastv":
            self.reporter.info("note: with --prune-method fastv each question prefills its whole prompt (fastv "
                               "ranks the vision tokens by the question's last token, so no prefix is shared); "
                               "--prune-method temporal shares it")
        elif len(questions) > 1 and settings.caption.offload_kv:
            self.reporter.info("note: with --offload-kv each question prefills its whole prompt (an offloaded "
                               "prefill keeps the shared prefix off the device)")
        self.questions = {question.name: question.text for question in questions} or None
        answer_columns = {column for question in questions for column in question.columns(with_token_ids=True)}
        taken = [kept.name for kept in kept_fields if kept.name in answer_columns]
        if taken:
            raise SettingsError(f"the manifest's kept column {taken[0]!r} is also a column of {{prompt_set}}; "
                                f"rename the question or leave the column out of --keep-columns")
        self.columns = OutputColumns(settings.with_token_ids, settings.key == "sha256", tuple(kept_fields),
                                     tuple(question.name for question in questions), settings.long,
                                     spans=settings.segments.mode != "whole"
                                     or any(item.span is not None for item in inputs.items))
        self.all_items = inputs.items
        shard = settings.shard
        self.discovery = (replace(inputs, items=[item for item in inputs.items if shard.holds(item)]) if shard
                          else inputs)
        self.store = self._store(self.target) if self.target is not None else None
        self.outcome: RunOutcome | None = None   # how the run ended, once it has
        self._segmented = False   # the videos were cut into their windows (--segments fixed)

    @property
    def items(self) -> list[MediaItem]:
        """The run's items (its shard's, with `RunSettings.shard`)."""
        return self.discovery.items

    def no_media(self) -> RunOutcome | None:
        """The outcome of a run whose inputs hold no media (None when they hold some)."""
        if self.all_items:
            return None
        message = f"no supported media in {self.source} ({plural(self.discovery.skipped_count, 'other file')} skipped)"
        return RunOutcome(Status.SOME_FAILED if self.settings.fail_on_empty else Status.NO_MEDIA, message)

    def describe(self) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], int]]:
        """What the run would do with each input, loading no model and writing nothing (`--dry-run`):
        (action, path, reason) lines, and counts by (action, kind of reason)."""
        if self.remote is None or self.settings.overwrite:
            stored = self._stored(self.store)
        else:
            with self.remote.peek() as copy:
                stored = self._stored(self._store(copy.target))
        self._cut_into_segments()
        plan = plan_run(self.items, stored, self.settings.retry_errors, self.settings.prune_missing,
                        questions=self.questions)
        limit = self.settings.limit
        later = {item.row_id for item in plan.limit(limit)} if limit else set()
        return describe_plan(self.discovery, stored, plan, later, tuple(self.questions or ()))

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
                self._cut_into_segments(load_meanwhile=not stored.rows)
                plan = plan_run(self.items, stored, self.settings.retry_errors, self.settings.prune_missing,
                                questions=self.questions)
                self.outcome = yield from self._caption(plan, stored)
            except (KeyboardInterrupt, Terminated) as stop:   # while loading, or writing the output
                status, reason = _stopped_by(stop)
                untouched = self._output_untouched() if self.store is not None else "the stream was not changed"
                self.outcome = RunOutcome(status, f"{reason}; {untouched}; run the same command again to continue")

    # --- the steps ------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self.target is None:
            yield
        elif self.remote is not None:
            with self.remote.held():
                if self.remote.lock.taken_over:
                    self.reporter.warning(f"warning: took over the lock of {self.remote.shown} from "
                                          f"{self.remote.lock.taken_over}: its lease ran out (a run that died?)")
                yield
        else:
            self.target.path.parent.mkdir(parents=True, exist_ok=True)
            with OutputLock(self.target.path):
                yield

    def _cut_into_segments(self, load_meanwhile: bool = False) -> None:
        """With `--segments`, each video of the run becomes its spans (once): what cutting needs of a video (its
        length, its shots) is read in decoding workers, where a file that crashes or hangs a decoder costs only
        its probe (and keeps the file whole: its decoding then says what is wrong). `load_meanwhile`: load the
        model while they read, for all the items there may be (the segments are not counted yet)."""
        segmenting = self.settings.segments
        if segmenting.mode == "whole" or self._segmented:
            return
        from .workers.pool import default_workers
        from .workers.probe import video_facts  # here: the decoding modules import torch

        videos = [item for item in self.items if item.media_type is MediaType.VIDEO and item.span is None]
        caption = self.settings.caption
        facts = video_facts(videos, segmenting, caption.workers or default_workers(), caption.decode_timeout_s,
                            meanwhile=partial(self._load, None) if load_meanwhile and videos else None)
        for item, known in zip(videos, facts):
            if known is not None and known.by_frames:
                self.reporter.warning(f"warning: {redact(item.path)}: its timestamps are missing or jump; its "
                                      f"segments are counted in frames at its frame rate ({known.duration_s:g} s)")
        self.discovery = replace(self.discovery, items=segmenting.split(
            self.items, {item.row_id: known for item, known in zip(videos, facts)}))
        self._segmented = True

    def _store(self, target: OutputTarget) -> ResultStore:
        remote = self.remote
        return ResultStore(target, self.columns, self.settings.flush_rows, self.settings.flush_seconds,
                           on_written=remote.written if remote else None, on_removed=remote.removed if remote else None)

    def _stored(self, store: ResultStore | None) -> StoredRows:
        """What earlier runs left (nothing when overwriting or streaming), checked against these settings."""
        stored = StoredRows() if self.settings.overwrite or store is None else store.read()
        check_settings(stored.settings, resume_settings(self.settings))
        return stored

    def _caption(self, plan: Plan, stored: StoredRows) -> Generator[CaptionResult, None, RunOutcome]:
        """Caption what the plan says and write the output; returns the outcome."""
        later = len(plan.limit(self.settings.limit)) if self.settings.limit else 0
        for problem in stored.unreadable_parts:
            self.reporter.warning(f"warning: unreadable part file {problem}")
        stats = RunStats(total=plan.items_to_caption, skipped=self.discovery.skipped_count,
                         already_done=len(plan.done), missing_kept=plan.missing_kept,
                         missing_pruned=plan.missing_pruned, left_for_later=later,
                         prefix_cache=self.settings.caption.prefix_cache)
        sink = self.store or JsonLinesStream(plan.captioned_ids(self.items), self.stream, self.columns)  # type: ignore[arg-type]
        loop = ItemLoop(self.items, plan, sink, stats, self.settings.caption.model, self.columns)
        if not plan.todo:
            # A shard with no items of its own still writes its (empty) output, for `tarsier merge`.
            return self._write_output(loop, stored, stored.provenance or {"settings": resume_settings(self.settings)})
        backend = self._load(len(plan.todo))
        provenance = run_provenance(backend, self.settings)
        check_settings(stored.settings, provenance["settings"])
        reuse_before = backend.prompt_reuse()
        stopped = yield from self._run_loop(backend, loop, provenance)
        reuse = backend.prompt_reuse()
        if reuse is not None and reuse_before is not None:   # this run's share, with a captioner shared by runs
            # (a backend written for the two counts, before questions shared prefixes, shares none)
            stats.prompt_positions, stats.reused_positions, stats.shared_positions = (
                now - then for now, then in zip((*reuse, 0, 0)[:3], (*reuse_before, 0, 0)[:3]))
        # Again: a cluster's actors tell how they captioned once they have
        return stopped or self._write_output(loop, stored, run_provenance(backend, self.settings))

    def _load(self, items: int | None) -> Backend:
        if self._backend is not None:
            return self._backend
        model = self.settings.caption.model
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

    def _run_loop(self, backend: Backend, loop: ItemLoop, provenance: dict[str, Any]
                 ) -> Generator[CaptionResult, None, RunOutcome | None]:
        """Caption the plan's items, saving rows as they finish; returns None when every item got its row,
        else the outcome of the stop."""
        try:
            if self.store is not None:
                # Under the same stop handling as the captioning: once the work directory exists, a stop
                # saves rows and says how to resume.
                self.store.begin(provenance, fresh=self.settings.overwrite)
            loop.stats.start_captioning()
            with _entered(self.reporter.progress(loop.stats)) as reporters:
                yield from loop.run(backend, reporters)
                loop.store.flush()
            return None
        except GeneratorExit:   # the caller left the loop: save what finished, change nothing else
            self.outcome = self._stopped(loop, Status.INTERRUPTED, "stopped by the caller", None)
            raise
        except (KeyboardInterrupt, Terminated) as stop:
            (status, reason), error = _stopped_by(stop), None
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
                and [row_id_of(row) for row in rows] == list(stored.rows) and stored.long == self.columns.long
            if shard:
                provenance = {**provenance, "shard": shard.provenance(self.all_items, rows)}
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
        summary = summary_rows(stats, written, skipped)
        return RunOutcome(Status.SOME_FAILED if stats.failed else Status.DONE, summary_line(summary), stats, summary)


def _with_own_prompt_sets(inputs: Discovery, settings: RunSettings) -> tuple[Discovery, RunSettings]:
    """With manifest rows that carry their own prompt sets: every item with its set (the run's where the row has
    none), and the run's set widened to every question any item asks (one column set for the output; the run's
    own questions keep their token limits)."""
    if all(item.prompt_set is None for item in inputs.items):
        return inputs, settings
    caption = settings.caption
    if caption.prompt is not None:
        raise SettingsError("{prompt} and a manifest's prompts column do not go together: make the prompt a "
                            "question of the rows' sets")
    bare = next((item for item in inputs.items if item.prompt_set is None), None)
    if bare is not None and not caption.prompt_set:
        raise SettingsError(f"{shown(bare.path)} has no questions in the manifest's prompts column: fill its cell, "
                            f"or give the rows without one a set with {{prompt_set}}")
    items = [item if item.prompt_set is not None else replace(item, prompt_set=caption.prompt_set)
             for item in inputs.items]
    named = {question.name: question for question in caption.prompt_set}
    for item in items:
        for question in item.prompt_set or ():
            named.setdefault(question.name, question)
    try:
        check_prompt_set(tuple(named.values()))
    except PromptSetError as error:   # each row's set is fine alone, not with the others' (a and a_prompt)
        raise SettingsError("the questions of the manifest's prompts column and {prompt_set} together: "
                            + shown(error)) from None
    settings = replace(settings, caption=replace(caption, prompt_set=tuple(named.values())))
    return replace(inputs, items=items), settings


def run_provenance(backend: Backend, settings: RunSettings) -> dict[str, Any]:
    """How a run's captions were made, stored with its output; "settings" must match to continue it."""
    # The run's set, which a manifest's rows may have widened beyond a shared captioner's (each row's own texts
    # are in its NAME_prompt columns).
    return {**backend.provenance(), "prompt_set": [asdict(question) for question in settings.caption.prompt_set]
            or None, "settings": resume_settings(settings, backend.resolved_settings())}


def _stopped_by(stop: BaseException) -> tuple[Status, str]:
    return (Status.INTERRUPTED, "interrupted") if isinstance(stop, KeyboardInterrupt) \
        else (Status.TERMINATED, "terminated")


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


__all__ = ["CaptionRun", "LoadingCrashed", "LoggingReporter", "RunOutcome", "RunReporter", "Status", "Terminated",
           "Backend", "load_captioner", "run_provenance"]
