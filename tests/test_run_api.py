"""The captioning run as a library object: the rows the CLI writes, resume, results as they finish, a
stream, the lock, and settings checked once with messages in the caller's words."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch import CaptionRun, CaptionSettings, RunSettings, SamplingParams, SettingsError, Status, discover
from tarsier_batch.cli import app
from tarsier_batch.cli_options import FLAGS
from tarsier_batch.outputs.lock import OutputLock, OutputLockedError
from tarsier_batch.outputs.schema import PROVENANCE_KEY
from tarsier_batch.progress import RunStats

runner = CliRunner()
PYTHON_API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def settings_for(model: Path, **run: object) -> RunSettings:
    return RunSettings(CaptionSettings(model=str(model), device="cpu", dtype="float32",
                                       sampling=SamplingParams(max_new_tokens=4)), with_token_ids=True, **run)


def rows_of(path: Path) -> list[dict]:
    return pq.read_table(path).drop(["elapsed_s"]).to_pylist()


def settings_of(path: Path) -> dict:
    return json.loads(pq.read_schema(path).metadata[PROVENANCE_KEY.encode()])["settings"]


class Recorder:
    """A RunReporter keeping what the run told, and a live display that keeps every result."""

    def __init__(self) -> None:
        self.infos: list[str] = []
        self.results: list[str] = []

    def info(self, message: str) -> None:
        self.infos.append(message)

    def warning(self, message: str) -> None:
        self.infos.append(message)

    def loading(self, model: str):
        import contextlib
        return contextlib.nullcontext()

    def progress(self, stats: RunStats) -> list:
        recorder = self

        class Display:
            def __enter__(self):
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def on_tokens(self) -> None:
                pass

            def on_result(self, result) -> None:
                recorder.results.append(result.path)

        return [Display()]


def test_a_python_run_writes_the_rows_the_cli_writes_and_a_rerun_resumes(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    cli_out, python_out = tmp_path / "cli.parquet", tmp_path / "python.parquet"
    done = runner.invoke(app, ["caption", str(SAMPLE_DATA), "--model", str(tiny_model_dir), "-o", str(cli_out),
                               "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4", "--with-token-ids"])
    assert done.exit_code == 0, done.output
    reporter = Recorder()
    outcome = CaptionRun([SAMPLE_DATA], python_out, settings_for(tiny_model_dir), reporter).execute()
    assert outcome.status is Status.DONE and outcome.ok and outcome.stats is not None
    assert rows_of(python_out) == rows_of(cli_out) and settings_of(python_out) == settings_of(cli_out)
    assert sorted(reporter.results) == sorted(row["path"] for row in rows_of(cli_out))
    assert any(info.startswith(f"{tiny_model_dir} (Tarsier v1, 8 frames) on cpu") for info in reporter.infos)

    again = CaptionRun([SAMPLE_DATA], python_out, settings_for(tiny_model_dir)).execute()
    assert again.status is Status.DONE and again.stats is not None
    assert (again.stats.already_done, again.stats.done) == (len(rows_of(cli_out)), 0)
    assert again.message.endswith(f"output {python_out} ({len(rows_of(cli_out))} rows, unchanged)")

    other = settings_for(tiny_model_dir, key="sha256")
    with pytest.raises(Exception, match="holds rows made with other settings"):
        CaptionRun([SAMPLE_DATA], python_out, other).execute()


def test_results_come_as_they_finish_and_leaving_early_keeps_them_for_the_next_run(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    run = CaptionRun([SAMPLE_DATA], out, settings_for(tiny_model_dir, flush_rows=1))
    taken = []
    for result in run.results():
        taken.append(result.path)
        if len(taken) == 2:
            break
    assert run.outcome is not None and run.outcome.status is Status.INTERRUPTED
    assert "2 finished rows are saved in" in run.outcome.message and not out.exists()
    rest = CaptionRun([SAMPLE_DATA], out, settings_for(tiny_model_dir))
    later = [result.path for result in rest.results()]
    assert rest.outcome is not None and rest.outcome.stats is not None and rest.outcome.stats.already_done == 2
    assert not set(later) & set(taken) and len(rows_of(out)) == len(taken) + len(later)


def test_a_stream_gets_json_lines_in_input_order(tiny_model_dir: Path) -> None:
    stream = io.StringIO()
    outcome = CaptionRun([SAMPLE_DATA / "still.png", SAMPLE_DATA / "ball.gif"], stream,
                         settings_for(tiny_model_dir)).execute()
    assert outcome.status is Status.DONE
    paths = [json.loads(line)["path"] for line in stream.getvalue().splitlines()]
    assert paths == [str(SAMPLE_DATA / "still.png"), str(SAMPLE_DATA / "ball.gif")]
    with pytest.raises(SettingsError, match="^overwrite continue an output file"):
        CaptionRun([SAMPLE_DATA], io.StringIO(), settings_for(tiny_model_dir, overwrite=True))


def test_another_run_on_the_same_output_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    lock = OutputLock(out)
    lock.acquire()
    try:
        with pytest.raises(OutputLockedError):
            CaptionRun([SAMPLE_DATA / "still.png"], out, settings_for(tiny_model_dir)).execute()
    finally:
        lock.release()


@pytest.mark.parametrize(("make", "field", "flag"), [
    (lambda: SamplingParams(top_p=0.0), "top_p", "--top-p"),
    (lambda: CaptionSettings(prune_layer=2), "prune_layer", "--prune-layer"),
    (lambda: CaptionSettings(decode_timeout_s=0), "decode_timeout_s", "--decode-timeout"),
    (lambda: CaptionSettings(batch_size=8, max_batch_tokens=4), "max_batch_tokens", "--max-batch-tokens"),
    (lambda: RunSettings(key="md5"), "key", "--key"),
])
def test_a_bad_setting_is_named_as_the_caller_knows_it(make, field: str, flag: str) -> None:
    with pytest.raises(SettingsError) as refused:
        make()
    assert str(refused.value).startswith(field) and flag not in str(refused.value)
    assert refused.value.worded(FLAGS).startswith(flag)


def test_every_setting_has_its_flag() -> None:
    """A field renamed without its flag (or the other way round) would show users a name they cannot type."""
    import typer.main

    caption = typer.main.get_command(app).commands["caption"]   # type: ignore[attr-defined]
    options = {name for param in caption.params for name in (*param.opts, *param.secondary_opts)}
    library_only = {"isolate_decoding", "caption", "sampling"}   # the last two hold other settings
    missing = {field: flag for field, flag in FLAGS.items()   # "--ask/--prompts": either flag gives the setting
               if field not in library_only and not set(flag.split("/")) <= options}
    assert not missing


@pytest.mark.docs
def test_the_python_api_example_runs_as_written(tmp_path: Path) -> None:
    """The Python API page's example, run as a script (its decoding workers are processes: the `__main__` guard)."""
    text = PYTHON_API_PAGE.read_text(encoding="utf-8")
    example = re.search(r"```python\n(# caption_folder\.py\n.*?)```", text, re.S)
    assert example, "the Python API page's example (starting '# caption_folder.py') is missing"
    (tmp_path / "sample_data").symlink_to(SAMPLE_DATA)
    (tmp_path / "caption_folder.py").write_text(example.group(1))
    first = subprocess.run([sys.executable, "caption_folder.py"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    rows = pq.read_table(tmp_path / "captions.parquet").to_pylist()
    assert len(rows) == len(discover([str(SAMPLE_DATA)]).items) > 0
    assert all(row["error"] is None and row["caption"] for row in rows)
    printed = first.stdout.splitlines()
    assert len([line for line in printed if line.startswith(str(tmp_path / "sample_data"))]) == len(rows)
    assert printed[-1].startswith("done")
    second = subprocess.run([sys.executable, "caption_folder.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0 and second.stdout.splitlines()[-1].startswith("done") and \
        f"done earlier {len(rows)}" in second.stdout, second.stdout


def test_a_new_output_format_is_one_class(tiny_model_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Tab-separated values, registered from the tests alone: written by a run, read back to resume it."""
    import csv

    import pyarrow as pa

    from tarsier_batch.outputs import formats

    class TsvFile(formats.TextWithMeta):
        name = "tsv"

        def write_rows(self, handle, table: pa.Table) -> None:
            writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
            writer.writerow(["path", "key", "caption", "error"])
            writer.writerows([row["path"], row["key"], row["caption"], row["error"] or ""]
                             for row in table.to_pylist())

        def read_rows(self, path: Path, schema: pa.Schema) -> pa.Table:
            with open(path, encoding="utf-8", newline="") as handle:
                rows = [{**row, "error": row["error"] or None}
                        for row in csv.DictReader(handle, delimiter="\t")]
            return pa.Table.from_pylist(rows, schema=pa.schema([schema.field(name) for name in rows[0]]))

    monkeypatch.setitem(formats.FORMATS, ".tsv", TsvFile())
    out = tmp_path / "captions.tsv"
    inputs = [SAMPLE_DATA / "still.png", SAMPLE_DATA / "ball.gif"]
    first = CaptionRun(inputs, out, settings_for(tiny_model_dir)).execute()
    assert first.status is Status.DONE and len(out.read_text().splitlines()) == 3
    again = CaptionRun(inputs, out, settings_for(tiny_model_dir)).execute()
    assert again.stats is not None and (again.stats.already_done, again.stats.done) == (2, 0)


def test_a_script_without_its_main_guard_is_told_why_before_any_work(tmp_path: Path) -> None:
    """Decoding workers import the script again: unguarded, each died while starting and every item failed with
    'the decoding workers failed (All workers expired)', rows a rerun then took for finished work."""
    script = tmp_path / "unguarded.py"
    script.write_text("from tarsier_batch import CaptionRun\n"
                      f"CaptionRun([{str(SAMPLE_DATA / 'still.png')!r}], 'r.parquet').execute()\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "UnguardedScriptError" in done.stderr
    assert f"{script} runs its work when imported" in done.stderr and "if __name__ == \"__main__\":" in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["unguarded.py"]   # nothing written


def test_a_dry_run_over_inputs_without_media_says_so(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no media here")
    out = ["-o", str(tmp_path / "r.parquet"), "--dry-run"]
    named = runner.invoke(app, ["caption", str(tmp_path), *out])   # a named input without media is a failed input
    assert named.exit_code == 1 and f"no supported media in {tmp_path} (1 other file skipped)" in named.output
    for extra, code in (([], 0), (["--fail-on-empty"], 1)):   # piped paths without media: a quiet night
        done = runner.invoke(app, ["caption", "-", *out, *extra], input=f"{tmp_path / 'notes.txt'}\n")
        assert done.exit_code == code and "no supported media in - (1 other file skipped)" in done.output


def test_a_stop_between_two_results_saves_them_and_ends_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM's Terminated raised in the caller's frame, between two results: execute() throws it into the run
    where it stands (a stop there used to escape with a traceback, the run closed as 'stopped by the caller')."""
    from tarsier_batch.run import Terminated

    out = tmp_path / "r.parquet"
    run = CaptionRun([SAMPLE_DATA], out, settings_for(tiny_model_dir, flush_rows=1))
    results = run.results()
    next(results), next(results)
    with pytest.raises(StopIteration):
        results.throw(Terminated())   # what execute() does with a stop that arrives in its own loop
    assert run.outcome is not None and run.outcome.status is Status.TERMINATED
    assert run.outcome.message.startswith("terminated; 2 finished rows are saved in") and not out.exists()


class Reversed:
    """A backend that finishes the items last to first, as a run's rows can finish out of order."""

    def __init__(self, settings: CaptionSettings) -> None:
        self.settings = settings
        self.asked_in_order: list[bool] = []

    def caption(self, items, on_tokens=None, in_order=True):
        from tarsier_batch.outputs.results import CaptionResult

        self.asked_in_order.append(in_order)
        for item in reversed(list(items)):
            yield CaptionResult(path=item.row_path, media_type=item.media_type.value, key=item.stable_key,
                                caption=f"caption of {Path(item.path).name}", generated_tokens=1,
                                finish_reason="length")

    def provenance(self) -> dict:
        return {"tool": "test"}

    def resolved_settings(self):
        from tarsier_batch.settings import Resolved

        return Resolved(None, 8, 1.0)

    def prompt_reuse(self) -> None:
        return None

    def describe(self) -> str:
        return "reversed"


def test_rows_are_saved_as_they_finish_and_outputs_keep_input_order(tmp_path: Path) -> None:
    inputs = [SAMPLE_DATA / "still.png", SAMPLE_DATA / "ball.gif", SAMPLE_DATA / "portrait.JPG"]
    settings = RunSettings(CaptionSettings(model="x"))
    captioning = Reversed(settings.caption)
    run = CaptionRun(inputs, tmp_path / "r.parquet", settings, captioner=captioning)  # type: ignore[arg-type]
    finished = [Path(result.path).name for result in run.results()]
    assert captioning.asked_in_order == [False]   # the run takes each row as it finishes...
    assert finished == ["portrait.JPG", "ball.gif", "still.png"]
    assert [Path(path).name for path in pq.read_table(tmp_path / "r.parquet").column("path").to_pylist()] == \
        ["still.png", "ball.gif", "portrait.JPG"]   # ...and the output is in input order
    stream = io.StringIO()
    CaptionRun(inputs, stream, settings, captioner=Reversed(settings.caption)).execute()  # type: ignore[arg-type]
    assert [Path(json.loads(line)["path"]).name for line in stream.getvalue().splitlines()] == \
        ["still.png", "ball.gif", "portrait.JPG"]   # a stream keeps input order itself


class Counting(Reversed):
    """A backend shared by runs whose prompt counts grow with each: (positions admitted, from the prefix cache,
    from another question of the clip) since loading."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.reuse = (0, 0, 0)

    def caption(self, items, on_tokens=None, in_order=True):
        self.reuse = tuple(count + more for count, more in zip(self.reuse, (120, 40, 10)))
        yield from super().caption(items, on_tokens, in_order)

    def prompt_reuse(self) -> tuple[int, int, int]:
        return self.reuse


def test_a_run_over_a_shared_backend_counts_its_own_share_of_the_prompt_positions(tmp_path: Path) -> None:
    settings = RunSettings(CaptionSettings(model="x"))
    shared = Counting(settings.caption)
    for number in range(2):
        outcome = CaptionRun([SAMPLE_DATA / "still.png"], tmp_path / f"r{number}.parquet", settings,
                             captioner=shared).execute()  # type: ignore[arg-type]
        assert outcome.status is Status.DONE, outcome.message
        stats = outcome.stats
        assert (stats.prompt_positions, stats.reused_positions, stats.shared_positions) == (120, 40, 10)
    assert shared.reuse == (240, 80, 20)
