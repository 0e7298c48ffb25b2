"""What a run will do, made from what was gathered before it: the inputs found, the output named, the settings.

From those facts alone come the run's items (its shard's share), its prompt set (widened by a manifest's
rows), its output columns, the notes for the caller, and, once the stored rows are read, what is left to
caption. Nothing here reads or writes a file: a plan is data, built and checked without touching the disk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pyarrow as pa

from ..errors import Worded
from ..inputs.prompt_sets import PromptSetError, Question, check_prompt_set
from ..inputs.sources import Discovery, MediaItem, row_source_exists
from ..outputs.formats import OutputTarget
from ..outputs.remote import RemoteOutput
from ..outputs.resume import Plan, plan_run
from ..outputs.schema import OutputColumns
from ..outputs.store import StoredRows
from ..settings import RunSettings, SettingsError, shown


@dataclass(frozen=True)
class RunFacts:
    """What a run is planned from, gathered before (the inputs discovered, the output named)."""

    settings: RunSettings
    found: Discovery                                   # every item of the inputs, in input order
    output: OutputTarget | RemoteOutput | None         # None: the rows go to a stream
    kept_fields: tuple[pa.Field, ...] = ()             # a manifest's columns carried into the rows


@dataclass(frozen=True)
class RunPlan:
    """What a run will do with its inputs and its output."""

    settings: RunSettings            # as given, the prompt set widened by the questions of a manifest's rows
    all_items: list[MediaItem]       # every item of the inputs, each with its prompt set
    discovery: Discovery             # the run's items: its shard's, with `RunSettings.shard`
    output: OutputTarget | RemoteOutput | None
    columns: OutputColumns
    questions: dict[str, str] | None   # the prompt set's questions, name -> text
    notes: tuple[str, ...] = ()        # what the caller should know of how the run goes

    @property
    def remote(self) -> RemoteOutput | None:
        return self.output if isinstance(self.output, RemoteOutput) else None

    @property
    def target(self) -> OutputTarget | None:
        return stored_at(self.output)

    def resume(self, items: list[MediaItem], stored: StoredRows,
               exists: Callable[[str], bool] = row_source_exists) -> tuple[Plan, list[MediaItem]]:
        """What is left to caption of `items` (the run's, its videos cut into segments) after the rows earlier
        runs `stored`: the plan, and the items `RunSettings.limit` leaves for a later run. `exists` says whether
        a stored row's file is still there."""
        settings = self.settings
        plan = plan_run(items, stored, settings.retry_errors, settings.prune_missing, exists, self.questions)
        return plan, plan.limit(settings.limit) if settings.limit else []


def stored_at(output: OutputTarget | RemoteOutput | None) -> OutputTarget | None:
    """Where the rows are stored: the output, or a remote output's local copy (None: a stream)."""
    return output.target if isinstance(output, RemoteOutput) else output


def plan_of(facts: RunFacts) -> RunPlan:
    """The plan of a run over `facts`; settings that do not go with these inputs or this output raise
    `SettingsError`."""
    settings, found = facts.settings, facts.found
    target = stored_at(facts.output)
    if target is None:
        settings.check_streamable()
    else:   # the output's own rules (a shard's format, what rows it can hold), for every caller
        target.check_settings(settings)
        target.kind.check_rows([item.path for item in found.items])
    if settings.caption.prompt_set and any(item.prompt is not None for item in found.items):
        raise SettingsError("a manifest's prompt column and {prompt_set} do not go together: ask the "
                            "manifest's prompts as questions of the set, or leave the set out")
    found, settings = _with_own_prompt_sets(found, settings)
    if settings.long and not settings.caption.prompt_set:
        raise SettingsError("{long} lays out the answers of several questions, a row per question: ask them "
                            "with {prompt_set} or a manifest's prompts column")
    questions = settings.caption.prompt_set
    _check_kept_columns(questions, facts.kept_fields)
    spans = settings.segments.mode != "whole" or any(item.span is not None for item in found.items)
    columns = OutputColumns(settings.with_token_ids, settings.key == "sha256", facts.kept_fields,
                            tuple(question.name for question in questions), settings.long, spans=spans)
    shard = settings.shard
    discovery = replace(found, items=[item for item in found.items if shard.holds(item)]) if shard else found
    return RunPlan(settings, found.items, discovery, facts.output, columns,
                   {question.name: question.text for question in questions} or None, _notes(settings))


def _with_own_prompt_sets(found: Discovery, settings: RunSettings) -> tuple[Discovery, RunSettings]:
    """With manifest rows that carry their own prompt sets: every item with its set (the run's where the row has
    none), and the run's set widened to every question any item asks (one column set for the output; the run's
    own questions keep their token limits)."""
    if all(item.prompt_set is None for item in found.items):
        return found, settings
    caption = settings.caption
    if caption.prompt is not None:
        raise SettingsError("{prompt} and a manifest's prompts column do not go together: make the prompt a "
                            "question of the rows' sets")
    bare = next((item for item in found.items if item.prompt_set is None), None)
    if bare is not None and not caption.prompt_set:
        raise SettingsError(f"{shown(bare.path)} has no questions in the manifest's prompts column: fill its cell, "
                            f"or give the rows without one a set with {{prompt_set}}")
    items = [item if item.prompt_set is not None else replace(item, prompt_set=caption.prompt_set)
             for item in found.items]
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
    return replace(found, items=items), settings


def _check_kept_columns(questions: tuple[Question, ...], kept_fields: tuple[pa.Field, ...]) -> None:
    """A manifest's kept column may not take the name of a column the prompt set writes."""
    answer_columns = {column for question in questions for column in question.columns(with_token_ids=True)}
    taken = [kept.name for kept in kept_fields if kept.name in answer_columns]
    if taken:
        raise SettingsError(f"the manifest's kept column {taken[0]!r} is also a column of {{prompt_set}}; "
                            f"rename the question or leave the column out of {{keep_columns}}")


def _notes(settings: RunSettings) -> tuple[str, ...]:
    """What settings that work against each other cost: a clip's questions prefill their prompts apart."""
    caption = settings.caption
    if len(caption.prompt_set) < 2:
        return ()
    if caption.pruning and caption.prune_method == "fastv":
        return (Worded("note: with {prune_method} fastv each question prefills its whole prompt (fastv ranks the "
                       "vision tokens by the question's last token, so no prefix is shared); {prune_method} temporal "
                       "shares it"),)
    if caption.offload_kv:
        return (Worded("note: with {offload_kv} each question prefills its whole prompt (an offloaded prefill "
                       "keeps the shared prefix off the device)"),)
    return ()
