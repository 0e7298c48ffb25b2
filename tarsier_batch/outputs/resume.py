"""Decide what a run must still caption, given the rows earlier runs left for the same output."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import Worded
from ..inputs.segments import as_stored_now
from ..inputs.sources import Discovery, MediaItem, row_id_of, row_source_exists, skipped_kind, with_span
from ..media import MediaType, Span
from .store import StoredRows

# With greedy decoding these do not change a caption.
SAMPLING_ONLY = ("top_p", "seed")


class SettingsMismatchError(Exception):
    """The stored rows were made with other settings than this run's."""


def check_settings(stored: dict[str, dict[str, Any]], now: dict[str, Any]) -> None:
    """Refuse to mix rows made with different settings; only the settings present in `now` are compared.

    `now` is `settings.resume_settings`: a run compares twice, before loading the model with what
    its settings say (so a mismatch is answered at once), and after, with what the model resolved
    (frames and repetition penalty defaults, the checkpoint revision).
    """
    for where, old in stored.items():
        if isinstance(old.get("prompt_set"), list):   # outputs of the first prompt sets kept the names alone
            old = {**old, "prompt_set": dict.fromkeys(old["prompt_set"])}
        if isinstance(old.get("segments"), str):
            old = {**old, "segments": as_stored_now(old["segments"])}
        greedy = old.get("temperature") == 0 and now.get("temperature", 0) == 0
        differences = [_difference(name, old.get(name), now[name])
                       for name in now
                       if _differs(name, old.get(name), now[name]) and not (greedy and name in SAMPLING_ONLY)]
        if differences:
            raise SettingsMismatchError(Worded(
                "{where} holds rows made with other settings ({differences}); run with the same settings to "
                "continue it, pass {overwrite} to caption everything again, or choose another {out}", where=where,
                differences="; ".join(differences)))


def settings_match(stored: dict[str, dict[str, Any]], now: dict[str, Any]) -> bool:
    """Whether rows made with the `stored` settings may be continued with `now` (`check_settings` refuses none)."""
    try:
        check_settings(stored, now)
    except SettingsMismatchError:
        return False
    return True


def _difference(name: str, old: Any, now: Any) -> str:
    if name == "prompt_set" and old and now:
        dropped = [question for question in old if question not in now]
        if dropped:
            which, them = (f"the question {dropped[0]}", "it") if len(dropped) == 1 else \
                (f"the questions {', '.join(dropped)}", "them")
            return (f"answers to {which}, which this run does not ask: ask {them} again, as continuing without "
                    f"{them} would drop those answers")
        return "; ".join(f"question {question} answered in at most {_shown(limit)} tokens there, "
                         f"{_shown(now[question])} now"
                         for question, limit in old.items() if now[question] != limit)
    return f"{name} {_shown(old)} there, {_shown(now)} now"


def _differs(name: str, old: Any, now: Any) -> bool:
    """A prompt set may gain questions (asked of the stored rows too), not lose them (their answers would go)."""
    if name == "prompt_set" and old and now:   # {question: its own max_new_tokens}
        return any(question not in now or now[question] != limit for question, limit in old.items())
    return old != now


@dataclass
class Plan:
    """Rows that need no work, items to caption, and what happens to the other stored rows."""

    done: dict[str, dict[str, Any]] = field(default_factory=dict)         # row id -> finished row
    todo: list[MediaItem] = field(default_factory=list)                   # one item per key
    sharing: dict[str, list[MediaItem]] = field(default_factory=dict)     # key -> more items with that content
    reused: list[str] = field(default_factory=list)   # paths in `done` whose row copies another path's caption
    kept: list[dict[str, Any]] = field(default_factory=list)              # stored rows of paths not in this run
    missing_kept: int = 0     # of `kept`, rows whose file no longer exists
    missing_pruned: int = 0   # rows dropped by --prune-missing
    retried: int = 0          # error rows captioned again (--retry-errors)
    changed: int = 0          # stored rows whose file changed since (captioned again)
    # Stored rows of a video (by row id, with why they go) that this run's rows of the same video take the place of:
    # with `--segments`, its rows from before it was cut otherwise (`_superseded`).
    superseded: dict[str, tuple[str, str]] = field(default_factory=dict)   # row id -> (why, kind of why)
    # Stored rows of items captioned again with the same key (errors retried; with a prompt set, items asked
    # only some questions, whose other answers the new rows keep): the row stays if the item is put off.
    earlier: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def failed_rows(self) -> int:
        """Of the rows that need no work, those that hold an error (kept as they are without `retry_errors`)."""
        return sum(row.get("error") is not None for row in self.done.values())

    @property
    def items_to_caption(self) -> int:
        return len(self.todo) + sum(len(more) for more in self.sharing.values())

    def limit(self, count: int) -> list[MediaItem]:
        """Caption only the first `count` items that need it (`--limit`); returns the items left for later."""
        later = self.todo[count:]
        self.todo = self.todo[:count]
        return later + [more for item in later for more in self.sharing.pop(item.stable_key, [])]

    def captioned_ids(self, items: list[MediaItem]) -> list[str]:
        """The rows (by `MediaItem.row_id`) this run captions, in input order."""
        planned = {item.row_id for item in self.todo} | \
            {item.row_id for more in self.sharing.values() for item in more}
        return [item.row_id for item in items if item.row_id in planned]

    def ordered_rows(self, items: list[MediaItem], new_rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The final rows: this run's items in input order, then the kept rows in their stored order."""
        rows = [self.done.get(item.row_id) or new_rows.get(item.row_id) or self.earlier.get(item.row_id)
                for item in items]
        return [row for row in rows if row is not None] + self.kept


def plan_run(items: list[MediaItem], stored: StoredRows, retry_errors: bool = False, prune_missing: bool = False,
             exists: Callable[[str], bool] = row_source_exists, questions: dict[str, str] | None = None) -> Plan:
    """Match this run's items to the stored rows by path and key.

    An item whose path has a row with the same key is done (unless the row is an error and
    `retry_errors`). An item whose content (key) was captioned under another path gets a copy
    of that row. Items sharing a key are captioned once (`todo`) and the others listed in
    `sharing`. Stored rows of paths not in this run are kept, except with `prune_missing`
    those whose file no longer exists, and rows of a video that this run's rows of it replace
    (`superseded`). With a prompt set (`questions`: name -> text), a row is
    done when it answers every question of the set with its current text; otherwise the item is
    asked only the others (its row keeps the answers it has).
    """
    plan = Plan()
    # Items with their own prompt set have it in their key: a key asks the same questions whatever the path.
    questions_by_key = {item.stable_key: _asked(item, questions) for item in items}
    captioned_content = {row["key"]: row for row in stored.rows.values()
                         if row["error"] is None and not _unanswered(row, questions_by_key.get(row["key"], questions))}
    planned: dict[str, int] = {}   # key -> its item's place in `todo`
    for item in items:
        key = item.stable_key
        item_questions = questions_by_key[key]
        row = stored.rows.get(item.row_id)
        if row is not None and row["key"] == key:
            retry = retry_errors and row["error"] is not None
            unanswered = _unanswered(row, item_questions)
            if (item_questions and not unanswered) or not (retry or (row["error"] is None and unanswered)):
                plan.done[item.row_id] = row
                continue
            plan.retried += retry
            plan.earlier[item.row_id] = row
            if item_questions:
                item = replace(item, questions=unanswered)
        elif row is not None:
            plan.changed += 1
        if key in captioned_content:
            plan.done[item.row_id] = {**captioned_content[key], "path": item.row_path}
            plan.reused.append(item.row_id)
        elif key in planned:
            plan.sharing.setdefault(key, []).append(item)
            # The item captioned for this content answers what any of its paths still needs.
            first = plan.todo[planned[key]]
            if first.questions is not None and first.questions != item.questions:
                asked = None if item.questions is None else \
                    tuple(name for name in item_questions or () if name in first.questions + item.questions)
                plan.todo[planned[key]] = replace(first, questions=asked)
        else:
            planned[key] = len(plan.todo)
            plan.todo.append(item)
    paths = {item.row_id for item in items}
    plan.superseded = _superseded(items, {path: row for path, row in stored.rows.items() if path not in paths})
    for path, row in stored.rows.items():
        if path in paths or path in plan.superseded:
            continue
        if exists(path):
            plan.kept.append(row)
        elif prune_missing:
            plan.missing_pruned += 1
        else:
            plan.kept.append(row)
            plan.missing_kept += 1
    return plan


def _superseded(items: list[MediaItem], others: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Of the stored rows that this run does not write again (`others`, by row id), those of a video whose rows this
    run writes in other spans, with why each goes.

    A video cut into segments (`--segments`) takes the place of its whole-file row (an earlier run could not read
    its length) and of segments cut otherwise (it changed since). A video `--segments` leaves whole (its length
    cannot be read now) takes the place of segments of another version of it; those of its current version stay:
    a length that cannot be read this time (a timeout) does not make their captions wrong. A manifest's spans
    (rows without `num_segments`) are the manifest's to keep.
    """
    cut = {item.row_path for item in items if item.num_segments is not None}
    whole = {item.row_path: item.stable_key for item in items
             if item.media_type is MediaType.VIDEO and item.span is None}
    superseded: dict[str, tuple[str, str]] = {}
    for row_id, row in others.items():
        path, segment = row["path"], row.get("num_segments") is not None
        if path in cut and segment:
            superseded[row_id] = ("its file changed and is cut anew", "file cut anew")
        elif path in cut and row.get("start_s") is None:
            superseded[row_id] = ("its file is cut into segments now", "file cut now")
        elif path in whole and segment and row["key"] != with_span(whole[path], Span(row["start_s"], row["end_s"])):
            superseded[row_id] = ("its file changed and is captioned whole", "file whole now")
    return superseded


def stored_spans(videos: list[MediaItem], rows: Iterable[dict[str, Any]]) -> dict[str, list[Span]]:
    """The spans of each of `videos` (by row id) whose every segment is among the stored `rows`, made from the
    same version of its file (its key): a run continuing the output cuts such a video as it was cut, without
    opening it again. A video with a segment missing (a run stopped in its middle, or `--limit`), changed since,
    or without a key (no version to trust) is not among them: its length and shots are read again."""
    by_path: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("num_segments") is not None:
            by_path.setdefault(row["path"], []).append(row)
    spans: dict[str, list[Span]] = {}
    for item in videos:
        segments = by_path.get(item.row_path, [])
        if item.key is None or not segments:
            continue
        count = segments[0]["num_segments"]
        by_number = {row["segment"]: Span(row["start_s"], row["end_s"]) for row in segments}
        if len(segments) == count and sorted(by_number) == list(range(count)) \
                and all(row["num_segments"] == count and row["key"] == with_span(item.key, by_number[row["segment"]])
                        for row in segments):
            spans[item.row_id] = [by_number[number] for number in range(count)]
    return spans


def _asked(item: MediaItem, questions: dict[str, str] | None) -> dict[str, str] | None:
    """The questions (name -> text) `item` is asked: its own set's, or the run's."""
    return questions if item.prompt_set is None else {question.name: question.text for question in item.prompt_set}


def _unanswered(row: dict[str, Any], questions: dict[str, str] | None) -> tuple[str, ...]:
    """The questions of a prompt set that `row` has no answer to: never asked, asked with another text, or
    failed."""
    return tuple(name for name, text in (questions or {}).items()
                 if row.get(name + "_prompt") != text or row.get(name + "_finish_reason") in (None, "error"))


def _shown(value: Any) -> str:
    return "(default)" if value is None else repr(value)


def describe_plan(discovery: Discovery, stored: StoredRows, plan: Plan, later: set[str],
                  questions: tuple[str, ...] = (), exists: Callable[[str], bool] = row_source_exists
                  ) -> tuple[list[tuple[str, str, str]], Counter[tuple[str, str]]]:
    """What a run would do with each input, for --dry-run: (action, path, reason) lines, and counts.

    Actions: `caption`, `later` (beyond --limit), `skip` (done earlier, or not media), and for
    stored rows of paths not in this run, `keep` or `drop` (--prune-missing). With a prompt set
    (`questions`), the counts also say how many items each question is asked of (`ask`).
    """
    shared_with = {item.row_id: first.row_id
                   for first in plan.todo for item in plan.sharing.get(first.stable_key, [])}
    todo = {item.row_id: item for item in plan.todo}
    lines: list[tuple[str, str, str]] = []
    counts: Counter[tuple[str, str]] = Counter()   # (action, kind of reason)

    def add(action: str, path: str, reason: str, kind: str | None = None) -> None:
        lines.append((action, path, reason))
        counts[action, kind or reason] += 1

    for item in discovery.items:
        path = item.row_id
        row = stored.rows.get(path)
        if path in plan.done:
            add("skip", path, "done earlier" if row is not None else "same content done earlier")
        elif path in later:
            add("later", path, Worded("beyond {limit}"))
        elif path in shared_with:
            add("caption", path, f"same content as {shared_with[path]}", "same content as another")
        elif path in todo:
            asked = todo[path].questions
            add("caption", path, "new" if row is None else "changed since" if row["key"] != item.stable_key
                else "retry error" if row["error"] is not None else f"ask {', '.join(asked or ())}",
                "questions to ask" if row is not None and row["key"] == item.stable_key and row["error"] is None
                else None)
            every = questions if item.prompt_set is None else tuple(question.name for question in item.prompt_set)
            for question in asked if asked is not None else every:
                counts["ask", question] += 1
    for path in discovery.skipped_paths:
        add("skip", path, f"not media ({skipped_kind(path)})", "not media")
    kept = {row_id_of(row) for row in plan.kept}
    for path in stored.rows:
        if path in kept:
            add("keep", path, "not in this run, row kept" if exists(path) else "file gone, row kept")
        elif path in plan.superseded:
            add("drop", path, *plan.superseded[path])
        elif path not in plan.done and path not in todo and path not in shared_with and path not in later:
            add("drop", path, Worded("file gone ({prune_missing})"))
    return lines, counts
