"""A run's plan as data: what a run will do is made from facts gathered before (items, output, settings) by a
pure function, so these tests build the facts by hand and read the plan, touching no file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from tarsier_batch.inputs.prompt_sets import Question
from tarsier_batch.inputs.sharding import Shard
from tarsier_batch.inputs.sources import Discovery, MediaItem
from tarsier_batch.media import MediaType
from tarsier_batch.media.timeline import Span
from tarsier_batch.outputs.formats import OutputTarget
from tarsier_batch.outputs.store import StoredRows
from tarsier_batch.run.plan import RunFacts, RunPlan, plan_of
from tarsier_batch.settings import CaptionSettings, RunSettings, SettingsError

OUT = OutputTarget(Path("/nowhere/r.parquet"))   # named, never opened: planning reads no file
A, B = Question("a", "What happens?", 5), Question("b", "Who is there?")


def clip(name: str, **fields: object) -> MediaItem:
    return MediaItem(f"/media/{name}", MediaType.VIDEO, key=f"/media/{name}|k", **fields)  # type: ignore[arg-type]


def planned(items: list[MediaItem], output: OutputTarget | None = OUT, kept: tuple[pa.Field, ...] = (),
            **settings: object) -> RunPlan:
    caption = settings.pop("caption", CaptionSettings(model="m"))
    return plan_of(RunFacts(RunSettings(caption, **settings), Discovery(items), output, kept))  # type: ignore[arg-type]


def stored_row(item: MediaItem, error: str | None = None, key: str | None = None, **answers: str) -> dict:
    """A row an earlier run left for `item`; `answers`: question name -> the text it was asked with."""
    row = {"path": item.path, "key": key or item.key, "error": error, "caption": None if error else "c"}
    for name, text in answers.items():
        row |= {f"{name}_prompt": text, f"{name}_finish_reason": "stop", name: "an answer"}
    return row


def stored(*rows: dict) -> StoredRows:
    return StoredRows(rows={row["path"]: row for row in rows})


def test_a_shard_plans_its_share_of_the_items_in_input_order_and_keeps_every_input_for_merge() -> None:
    items = [clip(f"{number}.mp4") for number in range(12)]
    shares = [planned(items, shard=Shard(index, 3)) for index in range(3)]
    assert all(plan.all_items == items for plan in shares)   # where each row goes among all, for `tarsier merge`
    mine = [[item.path for item in plan.discovery.items] for plan in shares]
    assert all(share for share in mine), mine   # twelve names spread over three shards
    assert sorted(path for share in mine for path in share) == sorted(item.path for item in items)
    assert all(share == sorted(share, key=lambda path: int(Path(path).stem)) for share in mine)
    assert [item.path for item in planned(items).discovery.items] == [item.path for item in items]


def test_the_output_is_the_target_the_rows_are_stored_in_and_a_stream_has_none() -> None:
    plan = planned([clip("x.mp4")])
    assert plan.target is OUT and plan.remote is None
    streamed = planned([clip("x.mp4")], output=None)
    assert streamed.output is None and streamed.target is None


def test_a_stream_refuses_the_settings_that_continue_an_output() -> None:
    with pytest.raises(SettingsError, match="overwrite, prune_missing continue an output file"):
        planned([clip("x.mp4")], output=None, overwrite=True, prune_missing=True)
    assert planned([clip("x.mp4")], overwrite=True, prune_missing=True).settings.overwrite


def test_manifest_rows_with_their_own_questions_widen_the_runs_set_and_the_others_get_the_runs() -> None:
    own = (replace(A, max_new_tokens=50), Question("c", "Where is it?"))
    items = [clip("own.mp4", prompt_set=own), clip("bare.mp4")]
    plan = planned(items, caption=CaptionSettings(model="m", prompt_set=(A, B)))
    assert plan.settings.caption.prompt_set == (A, B, own[1])   # the run's `a` keeps its own token limit
    assert plan.questions == {"a": "What happens?", "b": "Who is there?", "c": "Where is it?"}
    assert plan.columns.questions == ("a", "b", "c")
    assert [item.prompt_set for item in plan.discovery.items] == [own, (A, B)]
    assert plan.all_items == plan.discovery.items


@pytest.mark.parametrize(("items", "caption", "run", "kept", "refused"), [
    ([clip("x.mp4", prompt="Describe.")], CaptionSettings(model="m", prompt_set=(A,)), {}, (),
     "a manifest's prompt column and prompt_set do not go together"),
    ([clip("x.mp4")], CaptionSettings(model="m"), {"long": True}, (),
     "long lays out the answers of several questions"),
    ([clip("x.mp4", prompt_set=(B,))], CaptionSettings(model="m", prompt="Describe."), {}, (),
     "prompt and a manifest's prompts column do not go together"),
    ([clip("x.mp4", prompt_set=(B,)), clip("y.mp4")], CaptionSettings(model="m"), {}, (),
     "/media/y.mp4 has no questions in the manifest's prompts column"),
    ([clip("x.mp4", prompt_set=(Question("a_prompt", "?"),))], CaptionSettings(model="m", prompt_set=(A,)), {}, (),
     "the questions of the manifest's prompts column and prompt_set together"),
    ([clip("x.mp4")], CaptionSettings(model="m", prompt_set=(A, B)), {}, (pa.field("b_finish_reason", pa.string()),),
     "the manifest's kept column 'b_finish_reason' is also a column of prompt_set"),
])
def test_settings_that_do_not_go_with_the_inputs_are_refused(items: list[MediaItem], caption: CaptionSettings,
                                                              run: dict, kept: tuple, refused: str) -> None:
    with pytest.raises(SettingsError) as raised:
        planned(items, kept=kept, caption=caption, **run)
    assert str(raised.value).startswith(refused), raised.value


def test_a_kept_column_of_another_name_goes_into_the_rows() -> None:
    kept = (pa.field("label", pa.string()),)
    plan = planned([clip("x.mp4")], kept=kept, caption=CaptionSettings(model="m", prompt_set=(A, B)))
    assert plan.columns.kept == kept and "label" in plan.columns.schema().names


@pytest.mark.parametrize(("caption", "note"), [
    (CaptionSettings(model="m", prompt_set=(A, B), prune_vision=0.5, prune_method="fastv"),
     "note: with prune_method fastv each question prefills its whole prompt"),
    (CaptionSettings(model="m", prompt_set=(A, B), offload_kv=True),
     "note: with offload_kv each question prefills its whole prompt"),
    (CaptionSettings(model="m", prompt_set=(A, B), prune_vision=0.5, prune_method="temporal"), None),
    (CaptionSettings(model="m", prompt_set=(A,), prune_vision=0.5, prune_method="fastv"), None),
    (CaptionSettings(model="m", prompt_set=(A, B)), None),
])
def test_the_notes_say_when_a_clips_questions_cannot_share_their_prefill(caption: CaptionSettings,
                                                                         note: str | None) -> None:
    notes = planned([clip("x.mp4")], caption=caption).notes
    assert [text[:len(note)] for text in notes] == ([note] if note else [])


def test_the_columns_follow_the_settings_and_the_items() -> None:
    plain = planned([clip("x.mp4")]).columns
    assert (plain.hashed, plain.with_token_ids, plain.spans, plain.long) == (False, False, False, False)
    hashed = planned([clip("x.mp4")], key="sha256", with_token_ids=True).columns
    assert (hashed.hashed, hashed.with_token_ids) == (True, True)
    assert planned([clip("x.mp4"), clip("x.mp4", span=Span(0.0, 10.0))]).columns.spans   # a manifest's spans
    long = planned([clip("x.mp4")], long=True, caption=CaptionSettings(model="m", prompt_set=(A, B))).columns
    assert long.long and long.questions == ("a", "b")


def test_resume_skips_what_is_done_and_captions_the_new_the_changed_and_up_to_the_limit() -> None:
    done, changed, failed, new, newer = (clip(name) for name in ("done.mp4", "changed.mp4", "failed.mp4",
                                                                  "new.mp4", "newer.mp4"))
    items = [done, changed, failed, new, newer]
    rows = stored(stored_row(done), stored_row(changed, key="/media/changed.mp4|old"),
                  stored_row(failed, error="boom"))
    resume, later = planned(items).resume(items, rows, exists=lambda path: True)
    assert list(resume.done) == ["/media/done.mp4", "/media/failed.mp4"]   # an error row is done unless retried
    assert [item.path for item in resume.todo] == ["/media/changed.mp4", "/media/new.mp4", "/media/newer.mp4"]
    assert later == [] and resume.changed == 1
    limited, later = planned(items, limit=2, retry_errors=True).resume(items, rows, exists=lambda path: True)
    assert [item.path for item in limited.todo] == ["/media/changed.mp4", "/media/failed.mp4"]
    assert [item.path for item in later] == ["/media/new.mp4", "/media/newer.mp4"] and limited.retried == 1


def test_resume_keeps_or_prunes_the_rows_of_files_gone_as_the_settings_say() -> None:
    here, gone, elsewhere = clip("here.mp4"), clip("gone.mp4"), clip("elsewhere.mp4")
    rows = stored(stored_row(here), stored_row(gone), stored_row(elsewhere))
    exists = {elsewhere.path}.__contains__
    kept, _ = planned([here]).resume([here], rows, exists)
    assert [row["path"] for row in kept.kept] == [gone.path, elsewhere.path] and kept.missing_kept == 1
    pruned, _ = planned([here], prune_missing=True).resume([here], rows, exists)
    assert [row["path"] for row in pruned.kept] == [elsewhere.path] and pruned.missing_pruned == 1


def test_resume_asks_an_item_only_the_questions_its_row_has_no_answer_to() -> None:
    answered, half, reworded = clip("answered.mp4"), clip("half.mp4"), clip("reworded.mp4")
    rows = stored(stored_row(answered, a=A.text, b=B.text), stored_row(half, a=A.text),
                  stored_row(reworded, a="What happened before?", b=B.text))
    plan = planned([answered, half, reworded], caption=CaptionSettings(model="m", prompt_set=(A, B)))
    resume, _ = plan.resume(plan.discovery.items, rows, exists=lambda path: True)
    assert list(resume.done) == [answered.path]
    assert [(item.path, item.questions) for item in resume.todo] == [(half.path, ("b",)), (reworded.path, ("a",))]
    assert set(resume.earlier) == {half.path, reworded.path}   # their other answers stay in the new rows
