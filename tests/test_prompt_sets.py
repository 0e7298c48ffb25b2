"""Prompt sets through the run: each question's answer in its own columns equals that question asked alone
(both families, greedy and sampled), resume asks only new or changed questions, the CLI's --ask and
--prompts, the report, and the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch import (
    CaptionRun,
    CaptionSettings,
    Question,
    RunSettings,
    SamplingParams,
    SettingsMismatchError,
    Status,
)
from tarsier_batch.cli import app
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.inputs.prompt_sets import PromptSetError, parse_asks, read_prompt_set

runner = CliRunner()
FILES = [SAMPLE_DATA / name for name in ("ball.gif", "still.png", "demo_green_square_shrinks.mp4")]
MAX_NEW = 8
QUESTIONS = (Question("caption", "Describe the video in detail."),
             Question("objects", "List the objects that appear.", max_new_tokens=5),
             Question("camera", "How does the camera move?"))


@pytest.fixture(scope="module", params=["tarsier", "tarsier2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)


def run(model_dir: Path, out: Path, questions: tuple[Question, ...] = (), prompt: str | None = None,
        max_new: int = MAX_NEW, temperature: float = 0.0, **run_settings):
    sampling = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=0.9 if temperature else 1.0,
                              seed=3)
    caption = CaptionSettings(model=str(model_dir), device="cpu", dtype="float32", prompt=prompt, prompt_set=questions,
                              sampling=sampling)
    return CaptionRun(FILES, out, RunSettings(caption, with_token_ids=True, **run_settings))


def by_path(out: Path) -> dict[str, dict]:
    return {row["path"]: row for row in pq.read_table(out).to_pylist()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_answer_equals_its_question_asked_alone(model_dir: Path, tmp_path: Path, temperature: float) -> None:
    outcome = run(model_dir, tmp_path / "set.parquet", QUESTIONS, temperature=temperature).execute()
    assert outcome.status is Status.DONE, outcome.message
    rows = by_path(tmp_path / "set.parquet")
    assert len(rows) == len(FILES)
    for question in QUESTIONS:
        alone_out = tmp_path / f"{question.name}.parquet"
        run(model_dir, alone_out, prompt=question.text, max_new=question.max_new_tokens or MAX_NEW,
            temperature=temperature).execute()
        for path, alone in by_path(alone_out).items():
            row = rows[path]
            assert row[question.name] == alone["caption"], (question.name, path)
            assert row[question.name + "_generated_ids"] == alone["generated_ids"]
            assert (row[question.name + "_prompt"], row[question.name + "_prompt_tokens"],
                    row[question.name + "_generated_tokens"], row[question.name + "_finish_reason"]) == \
                (question.text, alone["prompt_tokens"], alone["generated_tokens"], alone["finish_reason"])
            assert alone["generated_tokens"] <= (question.max_new_tokens or MAX_NEW)
    assert any(len({row[q.name] for q in QUESTIONS}) == len(QUESTIONS) for row in rows.values()), \
        "the questions should get different answers"
    provenance = json.loads(pq.read_schema(tmp_path / "set.parquet").metadata[b"tarsier_batch"])
    assert [question["name"] for question in provenance["prompt_set"]] == ["caption", "objects", "camera"]
    # The summary says how much of the prompts the questions shared (the clip's frames, most of each prompt):
    # the second and third question of each clip take at least half their prompt from the first.
    stats, prompts = outcome.stats, [row[q.name + "_prompt_tokens"] for row in rows.values() for q in QUESTIONS]
    assert stats.prompt_positions == sum(prompts)
    later = sum(row[q.name + "_prompt_tokens"] for row in rows.values() for q in QUESTIONS[1:])
    assert later / 2 <= stats.shared_positions < later, (stats.shared_positions, later)
    assert dict(outcome.summary)["shared prefixes"] == (
        f"{stats.shared_positions:,} of {stats.prompt_positions:,} prompt positions shared between a clip's "
        f"questions ({stats.shared_positions / stats.prompt_positions:.1%})")


def test_resume_asks_only_new_and_changed_questions(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "set.parquet"
    first = run(tiny_model_dir, out, QUESTIONS[:2]).execute()
    assert first.status is Status.DONE
    before = by_path(out)
    # A question added: only it is asked (its tokens are all this run generated), the others' answers stay.
    added = run(tiny_model_dir, out, QUESTIONS)
    assert [line[2] for line in added.describe()[0]] == ["ask camera"] * len(FILES)
    outcome = added.execute()
    after = by_path(out)
    assert (outcome.stats.generated_tokens == len(FILES) * MAX_NEW
            == sum(r["camera_generated_tokens"] for r in after.values()))
    for path, row in after.items():
        assert (row["caption"], row["objects"]) == (before[path]["caption"], before[path]["objects"])
        assert row["camera"] and row["camera_prompt"] == QUESTIONS[2].text
    # A question's text changed: only it is asked again.
    changed = (QUESTIONS[0], Question("objects", "Which objects are there?", max_new_tokens=5), QUESTIONS[2])
    outcome = run(tiny_model_dir, out, changed).execute()
    again = by_path(out)
    assert outcome.stats.generated_tokens == len(FILES) * 5
    for path, row in again.items():
        assert row["objects_prompt"] == "Which objects are there?" and row["objects"] != after[path]["objects"]
        assert (row["caption"], row["camera"]) == (after[path]["caption"], after[path]["camera"])
    # Nothing left to ask; a question left out would lose its answers, a changed limit would mix limits: refused.
    assert run(tiny_model_dir, out, changed).execute().stats.generated_tokens == 0
    with pytest.raises(SettingsMismatchError, match="answers to the question camera, which this run does not ask: "
                       "ask it again, as continuing without it would drop those answers"):
        run(tiny_model_dir, out, changed[:2]).execute()
    with pytest.raises(SettingsMismatchError, match="question objects answered in at most 5 tokens there, 6 now"):
        run(tiny_model_dir, out, (changed[0], Question("objects", changed[1].text, max_new_tokens=6), changed[2])
            ).execute()
    assert by_path(out) == again
    # A question added with --limit 1: the files put off keep their rows and answers.
    limited = run(tiny_model_dir, out, (*changed, Question("tags", "Tags?")), limit=1).execute()
    assert limited.stats.generated_tokens == MAX_NEW
    rows = by_path(out)
    assert [path for path, row in rows.items() if row["tags"]] == [str(FILES[0])]
    assert all({k: v for k, v in rows[path].items() if not k.startswith("tags")} ==
               {k: v for k, v in again[path].items() if k != "elapsed_s"} | {"elapsed_s": rows[path]["elapsed_s"]}
               for path in map(str, FILES[1:]))


def test_same_content_under_a_new_path_gets_every_answer(tmp_path: Path, tiny_model_dir: Path) -> None:
    """--key sha256: a copy added with a new question shares the captioned file's run, which asks what either
    path still needs."""
    first, copy = tmp_path / "a.gif", tmp_path / "copy.gif"
    first.write_bytes(FILES[0].read_bytes())
    out = tmp_path / "out.parquet"

    def caption(paths: list[Path], questions: tuple[Question, ...]):
        settings = RunSettings(CaptionSettings(model=str(tiny_model_dir), prompt_set=questions,
                                               sampling=SamplingParams(max_new_tokens=MAX_NEW)), key="sha256")
        return CaptionRun(paths, out, settings).execute()

    caption([first], QUESTIONS[:1])
    copy.write_bytes(FILES[0].read_bytes())
    assert caption([first, copy], QUESTIONS[:2]).status is Status.DONE
    rows = by_path(out)
    assert rows[str(copy)]["caption"] == rows[str(first)]["caption"] and rows[str(copy)]["objects"]
    assert rows[str(copy)]["objects"] == rows[str(first)]["objects"]


def test_a_question_may_not_take_a_kept_manifest_column(tmp_path: Path, tiny_model_dir: Path) -> None:
    manifest = tmp_path / "list.csv"
    manifest.write_text(f"path,objects\n{FILES[0]},a ball\n")
    done = runner.invoke(app, ["caption", "--manifest", str(manifest), "--keep-columns", "objects", "-o",
                               str(tmp_path / "out.parquet"), "--model", str(tiny_model_dir), "--ask", "objects=What?"])
    assert done.exit_code == 2 and "the manifest's kept column 'objects' is also a column of --ask/--prompts" in \
        done.output, done.output


def test_the_cli_reads_a_prompt_file_and_asks_and_the_report_shows_every_answer(tmp_path: Path,
                                                                               tiny_model_dir: Path) -> None:
    questions = tmp_path / "questions.toml"
    questions.write_text('caption = "Describe the video in detail."\n'
                         'objects = { text = "List the objects.", max_new_tokens = 3 }\n')
    out = tmp_path / "out.jsonl"
    args = ["caption", *map(str, FILES), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "6",
            "--prompts", str(questions), "--ask", "mood=Is it calm? Answer yes=1 or no=0.", "-q"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["caption_generated_tokens"], r["objects_generated_tokens"], r["mood_generated_tokens"]) for r in rows] \
        == [(6, 3, 6)] * len(FILES)
    assert rows[0]["mood_prompt"] == "Is it calm? Answer yes=1 or no=0."
    assert "caption" in rows[0] and "prompt" not in rows[0] and "generated_tokens" not in rows[0]
    report = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(out), "-o", str(report)]).exit_code == 0
    data = json.loads(re.search(r'<script type="application/json" id=data>(.*?)</script>', report.read_text(),
                                re.S).group(1))
    assert [item["answers"] for item in data["items"]] == \
        [[[name, row[name], row[name + "_prompt"]] for name in ("caption", "objects", "mood")] for row in rows]


@pytest.mark.parametrize("flags, message", [
    (["--ask", "objects"], "--ask 'objects': give NAME=TEXT"),
    (["--ask", "Objects=x"], "question name 'Objects': use lowercase letters"),
    (["--ask", "error=x"], "question name 'error' gives a column 'error', which every row has already"),
    (["--ask", "finish_reason=x"], "question name 'finish_reason' gives a column 'finish_reason'"),
    (["--ask", "a=x", "--ask", "a=y"], "question 'a' is given twice"),
    (["--ask", "a_prompt=x", "--ask", "a=y"], "questions 'a_prompt' and 'a' both give a column 'a_prompt'"),
    (["--ask", "a=x", "--prompt", "y"], "--prompt and --ask/--prompts do not go together"),
    (["--ask", "a= "], "question 'a' has no text"),
    (["--prompts", "missing.toml"], "--prompts: cannot read missing.toml"),
])
def test_a_bad_prompt_set_stops_before_loading_with_one_line(tmp_path: Path, flags: list[str], message: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    done = runner.invoke(app, ["caption", str(SAMPLE_DATA), "-o", "out.parquet", "--model", "no-such-model", *flags])
    assert done.exit_code == 2 and message in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1 and not (tmp_path / "out.parquet").exists()


def test_prompt_set_files_and_asks_parse_as_written(tmp_path: Path) -> None:
    assert parse_asks(["note=a=b"]) == (Question("note", "a=b"),)
    table = tmp_path / "set.json"
    table.write_text(json.dumps({"caption": "Describe.", "tags": {"text": "Tags?", "max_new_tokens": 16}}))
    assert read_prompt_set(table) == (Question("caption", "Describe."), Question("tags", "Tags?", 16))
    for text, problem in [("[]", "holds no questions"), ('{"a": 1}', "must be a text or a table"),
                          ('{"a": {"text": "x", "max_new_tokens": "9"}}', "must be a whole number"),
                          ("{", "is not valid JSON")]:
        table.write_text(text)
        with pytest.raises(PromptSetError, match=problem):
            read_prompt_set(table)


def test_a_manifest_prompt_column_and_a_prompt_set_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    manifest = tmp_path / "list.csv"
    manifest.write_text(f"path,prompt\n{FILES[0]},Name the colours.\n")
    done = runner.invoke(app, ["caption", "--manifest", str(manifest), "-o", str(tmp_path / "out.parquet"),
                               "--model", str(tiny_model_dir), "--ask", "tags=Tags?"])
    assert done.exit_code == 2, done.output
    assert "a manifest's prompt column and --ask/--prompts do not go together" in done.output
    assert not (tmp_path / "out.parquet").exists()


def long_rows(out: Path) -> list[dict]:
    if out.suffix == ".parquet":
        return pq.read_table(out).to_pylist()
    return [json.loads(line) for line in out.read_text().splitlines()]


def assert_long_matches_wide(long: list[dict], wide: dict[str, dict], questions: tuple[Question, ...]) -> None:
    """Each (file, question) row of the long layout holds what the wide row's question columns hold."""
    assert [(row["path"], row["question"]) for row in long] == \
        [(path, question.name) for path in wide for question in questions]
    for row in long:
        item, name = wide[row["path"]], row["question"]
        assert (row["caption"], row["prompt"], row["prompt_tokens"], row["generated_tokens"], row["finish_reason"],
                row["generated_ids"]) == \
            (item[name], item[name + "_prompt"], item[name + "_prompt_tokens"], item[name + "_generated_tokens"],
             item[name + "_finish_reason"], item[name + "_generated_ids"])
        assert (row["key"], row["num_frames"], row["error"]) == (item["key"], item["num_frames"], None)


def test_long_layout_holds_a_row_per_file_and_question_and_resumes_in_either_layout(tmp_path: Path,
                                                                                   tiny_model_dir: Path) -> None:
    wide_out, long_out = tmp_path / "wide.parquet", tmp_path / "long.parquet"
    assert run(tiny_model_dir, wide_out, QUESTIONS).execute().status is Status.DONE
    wide = by_path(wide_out)
    assert run(tiny_model_dir, long_out, QUESTIONS[:2], long=True).execute().status is Status.DONE
    schema = pq.read_schema(long_out)
    assert schema.names[:5] == ["path", "key", "media_type", "question", "caption"]
    assert {"prompt", "generated_tokens", "finish_reason", "generated_ids"} <= set(schema.names)
    assert not {"objects", "caption_prompt"} & set(schema.names)
    assert_long_matches_wide(long_rows(long_out), wide, QUESTIONS[:2])
    # Resumed with a question added: only it is asked, and the file stays long.
    added = run(tiny_model_dir, long_out, QUESTIONS, long=True)
    assert [line[2] for line in added.describe()[0]] == ["ask camera"] * len(FILES)
    assert added.execute().stats.generated_tokens == len(FILES) * MAX_NEW
    assert_long_matches_wide(long_rows(long_out), wide, QUESTIONS)
    # Continued without --long, nothing is asked again and the file becomes the wide layout of the same answers.
    assert run(tiny_model_dir, long_out, QUESTIONS).execute().stats.generated_tokens == 0
    assert {path: {k: v for k, v in row.items() if k != "elapsed_s"} for path, row in by_path(long_out).items()} == \
        {path: {k: v for k, v in row.items() if k != "elapsed_s"} for path, row in wide.items()}


def test_long_layout_in_text_formats_the_stream_and_an_undecodable_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    args = ["caption", str(FILES[0]), str(broken), "--model", str(tiny_model_dir), "--max-new-tokens", "4", "-q",
            "--ask", "caption=Describe.", "--ask", "tags=Tags?", "--long", "--with-token-ids"]
    out = tmp_path / "out.jsonl"
    assert runner.invoke(app, [*args, "-o", str(out)]).exit_code == 1   # one item failed
    rows = long_rows(out)
    assert [(Path(row["path"]).name, row["question"]) for row in rows] == \
        [("ball.gif", "caption"), ("ball.gif", "tags"), ("broken.mp4", "caption"), ("broken.mp4", "tags")]
    assert all(row["error"] is None and row["generated_tokens"] == 4 for row in rows[:2])
    assert all(row["error"] and row["caption"] is None and row["finish_reason"] == "error" for row in rows[2:])
    # Resumed: nothing to do (the failed file is retried only with --retry-errors), the file as it was.
    again = runner.invoke(app, [*args, "-o", str(out), "--dry-run"])
    assert "skip 2 (2 done earlier)" in again.output, again.output
    assert runner.invoke(app, [*args, "-o", str(out)]).exit_code == 0 and long_rows(out) == rows
    streamed = runner.invoke(app, [*args, "-o", "-"])
    lines = [json.loads(line) for line in streamed.stdout.splitlines()]
    assert [(line["question"], line["caption"], line["error"]) for line in lines] == \
        [(row["question"], row["caption"], row["error"]) for row in rows]


def test_long_shards_merge_into_one_long_output(tmp_path: Path, tiny_model_dir: Path) -> None:
    shards = tmp_path / "shards"
    common = [*map(str, FILES), "--model", str(tiny_model_dir), "--max-new-tokens", "4", "-q", "--long",
              "--ask", "caption=Describe.", "--ask", "tags=Tags?"]
    for index in range(2):
        done = runner.invoke(app, ["caption", *common, "--shard", f"{index}/2",
                                   "-o", str(shards / f"s{index}.parquet")])
        assert done.exit_code == 0, done.output
    merged = tmp_path / "merged.parquet"
    assert runner.invoke(app, ["merge", str(shards), "-o", str(merged)]).exit_code == 0
    single = tmp_path / "single.parquet"
    assert runner.invoke(app, ["caption", *common, "-o", str(single)]).exit_code == 0
    drop = {"elapsed_s"}
    assert [{k: v for k, v in row.items() if k not in drop} for row in long_rows(merged)] == \
        [{k: v for k, v in row.items() if k not in drop} for row in long_rows(single)]
    assert len(long_rows(merged)) == 2 * len(FILES)


def test_long_without_a_prompt_set_is_refused_at_once(tmp_path: Path) -> None:
    done = runner.invoke(app, ["caption", str(SAMPLE_DATA), "-o", str(tmp_path / "o.parquet"), "--model",
                               "someone/nope", "--long"])
    assert done.exit_code == 2 and "--long lays out the answers of several questions, a row per question: ask " \
        "them with --ask/--prompts or a manifest's prompts column" in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1


def manifest_with_own_sets(folder: Path, cells: list[str]) -> Path:
    """A CSV manifest of FILES with a `prompts` column holding `cells` (JSON objects, or empty)."""
    import csv

    manifest = folder / "list.csv"
    with open(manifest, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "prompts"])
        writer.writerows(zip(map(str, FILES), cells))
    return manifest


def test_manifest_rows_ask_their_own_prompt_sets(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Each row is asked its own set (or the run's, for an empty cell), and each answer is that question's asked
    alone; the output's columns are every question any row asks; resume follows each row's set."""
    cells = ['{"caption": "Describe this.", "tags": "List three tags."}', "", '{"colour": "What colour is it?"}']
    manifest = manifest_with_own_sets(tmp_path, cells)
    out = tmp_path / "out.parquet"
    common = ["--model", str(tiny_model_dir), "--max-new-tokens", str(MAX_NEW), "-q", "--with-token-ids"]
    args = ["caption", "--manifest", str(manifest), "-o", str(out), *common, "--ask", "caption=Describe the video."]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    rows = by_path(out)
    schema = pq.read_schema(out)
    assert [name for name in schema.names if name + "_prompt" in schema.names] == ["caption", "tags", "colour"]
    asked = {str(FILES[0]): {"caption": "Describe this.", "tags": "List three tags."},
             str(FILES[1]): {"caption": "Describe the video."},
             str(FILES[2]): {"colour": "What colour is it?"}}
    for path, questions in asked.items():
        row = rows[path]
        assert {name: row[name + "_prompt"] for name in ("caption", "tags", "colour") if row[name + "_prompt"]} == \
            questions
        assert all(row[name] is None for name in ("caption", "tags", "colour") if name not in questions)
        for name, text in questions.items():
            alone = tmp_path / f"alone-{name}.jsonl"
            single = runner.invoke(app, ["caption", path, "-o", str(alone), *common, "--prompt", text, "--overwrite"])
            assert single.exit_code == 0, single.output
            expected = json.loads(alone.read_text())
            assert (row[name], row[name + "_generated_ids"]) == (expected["caption"], expected["generated_ids"])
    # Resumed with the run's set grown and one row's own set changed: the row of the run's set is asked only the
    # new question, the changed row all of its own again, the other row nothing.
    cells[2] = '{"colour": "Which colours are there?"}'
    manifest_with_own_sets(tmp_path, cells)
    dry = runner.invoke(app, [*args, "--ask", "mood=Is it calm?", "--dry-run"])
    lines = {Path(line.split("\t")[1]).name: line.split("\t")[2] for line in dry.output.splitlines() if "\t" in line}
    assert lines == {FILES[0].name: "done earlier", FILES[1].name: "ask mood", FILES[2].name: "changed since"}, \
        dry.output
    assert runner.invoke(app, [*args, "--ask", "mood=Is it calm?"]).exit_code == 0
    again = by_path(out)
    untouched = again[str(FILES[0])]
    assert {name: value for name, value in untouched.items() if not name.startswith("mood")} == rows[str(FILES[0])]
    assert all(value is None for name, value in untouched.items() if name.startswith("mood"))
    assert again[str(FILES[1])]["mood"] and again[str(FILES[1])]["caption"] == rows[str(FILES[1])]["caption"]
    assert again[str(FILES[2])]["colour_prompt"] == "Which colours are there?"


@pytest.mark.parametrize("cell, flags, message", [
    ("{not json", ["--ask", "a=x"], "row 1, column 'prompts': not a JSON object of question name -> text"),
    ('{"Bad": "x"}', ["--ask", "a=x"], "row 1, column 'prompts': question name 'Bad': use lowercase"),
    ('["x"]', ["--ask", "a=x"], "row 1, column 'prompts': give a JSON object of question name -> text"),
    ("", [], "has no questions in the manifest's prompts column: fill its cell, or give the rows without one a "
             "set with --ask/--prompts"),
    ('{"a": "x"}', ["--prompt", "Describe."], "--prompt and a manifest's prompts column do not go together"),
])
def test_a_bad_prompts_cell_stops_at_once_with_one_line(tmp_path: Path, tiny_model_dir: Path, cell: str,
                                                         flags: list[str], message: str) -> None:
    manifest = manifest_with_own_sets(tmp_path, [cell, '{"a": "x"}', '{"a": "x"}'])
    done = runner.invoke(app, ["caption", "--manifest", str(manifest), "-o", str(tmp_path / "o.parquet"),
                               "--model", str(tiny_model_dir), *flags])
    assert done.exit_code == 2 and message in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1 and not (tmp_path / "o.parquet").exists()


def test_prompts_cells_read_from_json_lines_objects_and_parquet_maps(tmp_path: Path) -> None:
    import pyarrow as pa

    from tarsier_batch.inputs.manifest import read_manifest

    lines = tmp_path / "list.jsonl"
    lines.write_text(json.dumps({"path": str(FILES[0]), "prompts": {"tags": "Tags?", "mood": "Calm?"}}) + "\n" +
                     json.dumps({"path": str(FILES[1]), "prompts": {"mood": "Calm?"}}) + "\n" +
                     json.dumps({"path": str(FILES[2]), "prompts": None}) + "\n")
    maps = tmp_path / "list.parquet"
    pq.write_table(pa.table({"path": [str(path) for path in FILES],
                             "prompts": pa.array([[("tags", "Tags?"), ("mood", "Calm?")], [("mood", "Calm?")], None],
                                                 pa.map_(pa.string(), pa.string()))}), maps)
    for manifest in (lines, maps):
        items = read_manifest(manifest, "path", frozenset()).discovery.items
        assert [item.prompt_set for item in items] == \
            [(Question("tags", "Tags?"), Question("mood", "Calm?")), (Question("mood", "Calm?"),), None], manifest
        assert "|prompts-sha256:" in items[0].key and "|prompts" not in items[2].key   # a row's own set is in its key


def test_a_column_named_question_does_not_make_a_wide_output_long(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The layout is recorded in the provenance, not guessed from columns: a VQA manifest's kept `question`
    column (renamed input_question) survives a run with nothing to do, answers and all."""
    manifest = tmp_path / "vqa.csv"
    manifest.write_text("path,question\n" + "".join(f"{path},what is it?\n" for path in FILES))
    out = tmp_path / "out.parquet"
    args = ["caption", "--manifest", str(manifest), "--keep-columns", "all", "-o", str(out), "--model",
            str(tiny_model_dir), "--max-new-tokens", "4", "-q"]
    assert runner.invoke(app, args).exit_code == 0
    before = pq.read_table(out).to_pylist()
    assert before[0]["input_question"] == "what is it?" and all(row["caption"] for row in before)
    assert runner.invoke(app, args).exit_code == 0 and pq.read_table(out).to_pylist() == before


def test_every_manifest_row_with_its_own_set_may_be_long_and_its_key_ignores_question_order(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    manifest = manifest_with_own_sets(tmp_path, ['{"b": "Tags?", "a": "Describe."}', '{"a": "Describe."}',
                                                 '{"a": "Describe."}'])
    out = tmp_path / "out.jsonl"
    args = ["caption", "--manifest", str(manifest), "-o", str(out), "--model", str(tiny_model_dir),
            "--max-new-tokens", "4", "-q", "--long"]
    assert runner.invoke(app, args).exit_code == 0
    rows = long_rows(out)
    assert [(Path(row["path"]).name, row["question"]) for row in rows] == \
        [(FILES[0].name, "b"), (FILES[0].name, "a"), (FILES[1].name, "a"), (FILES[2].name, "a")]
    # The same questions in another order: the same row (its key does not depend on the order).
    manifest_with_own_sets(tmp_path, ['{"a": "Describe.", "b": "Tags?"}', '{"a": "Describe."}', '{"a": "Describe."}'])
    assert "skip 3 (3 done earlier)" in runner.invoke(app, [*args, "--dry-run"]).output


def test_a_question_added_to_a_file_that_now_fails_keeps_the_earlier_answer_and_the_error(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out.jsonl"
    args = ["caption", str(FILES[1]), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "4", "-q",
            "--long", "--ask", "a=Describe."]
    assert runner.invoke(app, args).exit_code == 0
    [first] = long_rows(out)
    # Asked a new question, the picture now fails to decode (over the pixel cap): the earlier answer stays, the
    # new question's row is the error, and reading the file back gives the item its error (the report counts it).
    assert runner.invoke(app, [*args, "--ask", "b=Tags?", "--max-image-pixels", "1"]).exit_code == 1
    kept, failed = long_rows(out)
    assert kept | {"elapsed_s": 0} == first | {"elapsed_s": 0}   # the item's time is this run's
    assert (failed["question"], failed["finish_reason"], failed["caption"]) == ("b", "error", None)
    assert "max_image_pixels" in failed["error"] and "--" not in failed["error"]   # a row names no flag
    from tarsier_batch.review.results import figures, load_results

    results = load_results(out)
    assert figures(results).failed == 1 and results.rows[0]["a"] == first["caption"]


def test_a_set_with_fastv_says_why_its_questions_do_not_share_a_prefill(tmp_path: Path, tiny_model_dir: Path) -> None:
    args = ["caption", *map(str, FILES), "-o", str(tmp_path / "o.parquet"), "--model", str(tiny_model_dir),
            "--ask", "a=Describe.", "--ask", "b=Tags?", "--dry-run"]
    shared = runner.invoke(app, [*args, "--prune-vision", "0.5", "--prune-method", "temporal"])
    alone = runner.invoke(app, [*args, "--prune-vision", "0.5", "--prune-method", "fastv"])
    assert shared.exit_code == alone.exit_code == 0, alone.output
    assert "each question prefills its whole prompt (fastv ranks the vision tokens by the question's last token" \
        in alone.output and "prefills its whole prompt" not in shared.output


def test_settings_stored_by_the_first_prompt_sets_compare_without_a_crash() -> None:
    """Outputs of the first prompt sets stored the names alone (a list): compared as names without own limits."""
    from tarsier_batch.outputs.resume import check_settings

    check_settings({"old.parquet": {"prompt_set": ["caption", "objects"]}},
                   {"prompt_set": {"caption": None, "objects": None, "camera": None}})
    with pytest.raises(SettingsMismatchError, match="answers to the question objects, which this run does not ask"):
        check_settings({"old.parquet": {"prompt_set": ["caption", "objects"]}}, {"prompt_set": {"caption": None}})
    with pytest.raises(SettingsMismatchError, match="answers to the questions objects, camera, which this run does "
                                                    "not ask: ask them again"):
        check_settings({"old.parquet": {"prompt_set": ["caption", "objects", "camera"]}},
                       {"prompt_set": {"caption": None}})
