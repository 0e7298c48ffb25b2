"""Messages that name the fix, first-use notices, shared caches and the ETA."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from conftest import REPO, SAMPLE_DATA, caption_probe
from tarsier_batch.cli import app
from tarsier_batch.model.checkpoints import DEMO_ACCURACY, download_problem
from tarsier_batch.progress import RunStats, progress_line
from tarsier_batch.version import extra_command_for, install_extra_command

runner = CliRunner()


def bare(error_type: type[BaseException], message: str) -> BaseException:
    """An instance of a hub error without the HTTP response its constructor wants."""
    error = error_type.__new__(error_type)
    Exception.__init__(error, message)
    return error


def test_hub_problems_say_whether_the_name_or_the_network_is_wrong(tmp_path: Path) -> None:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    assert "there is no model 'someone/typo' on the Hugging Face hub (check the name" in \
        download_problem("someone/typo", bare(RepositoryNotFoundError, "404"))
    assert "is gated on the Hugging Face hub: accept its terms" in \
        download_problem("org/gated", bare(GatedRepoError, "403"))
    (tmp_path / "a.jpg").touch()
    done = subprocess.run([sys.executable, "-m", "tarsier_batch.cli", "caption", str(tmp_path), "-o",
                           str(tmp_path / "r.parquet"), "--model", "someone/model"], capture_output=True,
                          env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")},
                          timeout=120)
    error = done.stderr.decode().strip()
    assert done.returncode == 2 and len(error.splitlines()) == 1, error
    assert "cannot reach the Hugging Face hub to download 'someone/model'" in error
    assert "'hf download someone/model --local-dir DIR'" in error and "huggingface-cli" not in error


def test_first_use_of_a_built_in_model_says_so_and_the_cache_is_group_readable(shared_media: Path,
                                                                               tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = [str(shared_media / "tarsier_logo.jpg"), "--model", "tiny-random", "--max-new-tokens", "2"]
    env = {"TARSIER_BATCH_CACHE": str(cache)}
    old_umask = os.umask(0o002)   # a group-shared cache
    try:
        first = runner.invoke(app, ["caption", *args, "-o", str(tmp_path / "a.parquet")], env=env)
    finally:
        os.umask(old_umask)
    assert first.exit_code == 0, first.output
    assert "building the random-weight model tiny-random (first use; cached in" in first.output
    built = cache / "tiny-random-tiny-seed0"
    assert stat.S_IMODE(built.stat().st_mode) == 0o775   # mkdtemp alone would leave 0700
    assert all(stat.S_IMODE(path.stat().st_mode) & 0o040 for path in built.iterdir())
    again = runner.invoke(app, ["caption", *args, "-o", str(tmp_path / "b.parquet")], env=env)
    assert again.exit_code == 0 and "building" not in again.output


def test_sha256_key_adds_a_sha256_column(shared_media: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    image = shared_media / "tarsier_logo.jpg"
    result = runner.invoke(app, ["caption", str(image), "--model", str(tiny_model_dir), "-o", str(out),
                                 "--max-new-tokens", "2", "--key", "sha256"])
    assert result.exit_code == 0, result.output
    row = pq.read_table(out).to_pylist()[0]
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    assert row["sha256"] == digest and row["key"] == f"sha256:{digest}" and row["size_bytes"] == image.stat().st_size


def test_eta_counts_items_still_generating_by_their_tokens() -> None:
    stats = RunStats(total=10)
    stats.started -= 100.0   # 100 s into the run
    assert stats.eta_s is None   # nothing finished: no basis for an estimate
    stats.done, stats.generated_tokens, stats.streamed_tokens = 2, 200, 200
    # Two items in 100 s and nothing in flight: 8 left at 50 s each.
    assert abs(stats.eta_s - 400.0) < 1.0
    stats.streamed_tokens = 400   # 200 more tokens: two items' worth are under way
    assert abs(stats.eta_s - 150.0) < 1.0   # 4 items' worth done in 100 s; 6 left at 25 s


def test_eta_is_never_zero_while_items_still_generate() -> None:
    """A short first item made the mean tokens per item tiny: the long items in flight counted as done and the
    ETA read 0:00:00 for minutes while 7 of 8 items generated."""
    stats = RunStats(total=8)
    stats.started -= 60.0
    assert "ETA -:--:--" in progress_line(stats)   # nothing finished: unknown, not 0
    stats.done, stats.generated_tokens = 1, 10
    stats.streamed_tokens = 10 + 7 * 500   # seven items in flight, 500 tokens each: 350 mean items' worth
    # What is in flight counts for at most half of the 7 items left: 4.5 items' worth in 60 s, 3.5 left.
    assert abs(stats.eta_s - 3.5 * 60.0 / 4.5) < 0.5
    stats.started -= 120.0   # two minutes on, nothing more finished: the estimate grows, it does not run out
    assert abs(stats.eta_s - 3.5 * 180.0 / 4.5) < 0.5
    assert "ETA 0:00:00" not in progress_line(stats)


def test_eta_is_at_least_a_second_while_items_remain_and_zero_when_all_are_done() -> None:
    stats = RunStats(total=2)
    stats.started -= 0.2   # one item done in 0.2 s: a rounded estimate would read 0:00:00
    stats.done = stats.generated_tokens = stats.streamed_tokens = 1
    assert stats.eta_s == 1.0 and progress_line(stats).endswith("ETA 0:00:01")
    stats.done = 2
    assert stats.eta_s == 0.0


def test_eta_goes_at_the_rate_of_captioned_items_when_quick_failures_came_first() -> None:
    """9,000 files failed to decode in the first seconds, then 399 were captioned in 100 s: the 601 items left take
    about 150 s more, not the 6 s the rate of all finished items promised."""
    stats = RunStats(total=10_000)
    stats.started -= 100.0
    stats.done, stats.failed = 9_399, 9_000
    stats.generated_tokens = stats.streamed_tokens = 399 * 50
    assert abs(stats.eta_s - 601 * 100.0 / 399) < 1.0
    stats.streamed_tokens += 2 * 50   # two captions' worth in flight, by the tokens of captioned items
    assert abs(stats.eta_s - 599 * 100.0 / 401) < 1.0
    only_failures = RunStats(total=20)   # nothing captioned nor generating: the failures' rate is all there is
    only_failures.started -= 10.0
    only_failures.done = only_failures.failed = 10
    assert abs(only_failures.eta_s - 10.0) < 0.1


def test_the_demo_model_is_offered_and_its_accuracy_is_the_readmes() -> None:
    """`tarsier models` said "nine in ten right" where the README, measured, says 99.9 %; --model's help left
    the demo out."""
    listed = runner.invoke(app, ["models"])
    assert listed.exit_code == 0 and DEMO_ACCURACY in listed.output and "nine in ten" not in listed.output
    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    assert DEMO_ACCURACY in page   # "The demo model" says it in the same words
    help_text = " ".join(runner.invoke(app, ["caption", "--help"]).output.split())
    assert "the shipped demo model ('demo'" in help_text


def test_a_near_miss_of_a_model_name_is_answered_with_the_name_before_torch_is_imported(tmp_path: Path) -> None:
    """`--model dem0` imported torch and loaded before it said anything, and suggested nothing."""
    from tarsier_batch.model.checkpoints import model_reference_problem

    done = caption_probe(tmp_path, "--model", "dem0")
    assert done.stdout.strip() == "HEAVY False CODE 2"
    error = done.stderr.strip()
    assert len(error.splitlines()) == 1 and "--model 'dem0' is not a checkpoint directory" in error
    assert error.endswith("did you mean 'demo'?"), error
    assert "did you mean 'tiny-random-tarsier2'?" in model_reference_problem("tiny-random-tarsir2")
    # What may name a checkpoint is still accepted: a directory (even one named like a typo), a hub id, the aliases.
    (tmp_path / "dem0").mkdir()
    for accepted in (str(tmp_path / "dem0"), "someone/model", "demo", "tiny-random"):
        assert model_reference_problem(accepted) is None, accepted


def test_the_live_elapsed_time_counts_from_where_the_summarys_wall_time_does(monkeypatch) -> None:
    """On a terminal the bar said 0:00:08 (from when it appeared, after loading) and the summary 0:00:17."""
    import io

    from rich.console import Console

    from tarsier_batch.progress import RichReporter, summary_rows

    stats = RunStats(total=2)
    stats.started -= 17.2              # the run began 17 s ago...
    stats.start_captioning()
    stats.captioning_started -= 8.1    # ...and captioning 8 s ago, once the model had loaded
    screen = io.StringIO()
    reporter = RichReporter(stats, Console(file=screen, force_terminal=True, width=200))
    reporter.progress.console.print(reporter.progress.make_tasks_table(reporter.progress.tasks))
    assert "0:00:17" in screen.getvalue() and "0:00:08" not in screen.getvalue(), screen.getvalue()
    assert dict(summary_rows(stats, "out.parquet", ""))["wall time"] == \
        "0:00:17 (0:00:09 loading the model, 0:00:08 captioning)"
    # The rate is the captioning's; the whole run's, loading included, beside it (the clock held still).
    stats.done = 2
    now = time.perf_counter()
    stats.started, stats.captioning_started = now - 17.2, now - 8.1
    with monkeypatch.context() as patch:
        patch.setattr(time, "perf_counter", lambda: now)
        throughput = dict(summary_rows(stats, "out.parquet", ""))["throughput"]
    assert throughput == "0.247 items/s while captioning (0.116 items/s with loading), 0 tokens"


def test_the_wall_time_splits_into_starting_loading_and_captioning_which_add_up(monkeypatch) -> None:
    from tarsier_batch.progress import summary_rows

    now = time.perf_counter()
    stats = RunStats(total=2, started=now - 20.2)   # the process began 20 s ago, the model's load 17 s ago...
    stats.loading_started, stats.captioning_started = now - 17.2, now - 8.1   # ...and captioning 8 s ago
    with monkeypatch.context() as patch:
        patch.setattr(time, "perf_counter", lambda: now)
        assert dict(summary_rows(stats, "out.parquet", ""))["wall time"] == \
            "0:00:20 (0:00:03 starting, 0:00:09 loading the model, 0:00:08 captioning)"


def test_a_commands_wall_time_starts_when_its_process_did() -> None:
    # time.perf_counter is the system's monotonic clock: readings of two processes compare.
    child = "import time; first = time.perf_counter(); from tarsier_batch.progress import process_started; " \
            "print(process_started(), first)"
    before = time.perf_counter()
    shown = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    after = time.perf_counter()
    started, first = map(float, shown.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")   # the kernel's clocks count process ages in ticks
    assert before - tick <= started <= first <= after


# `tarsier ARGS` as its console script runs it, in a fresh interpreter of this checkout, with an object that Python's
# teardown of the main module deletes and an at-exit handler registered before the command's own (so run after
# them), which says whether the decoding server is still running.
_ENTRY_PROBE = ("import atexit, os, sys\n"
                "class TornDown:\n"
                "    def __del__(self):\n"
                "        os.write(2, b'interpreter torn down\\n')\n"
                "kept = TornDown()\n"
                "def ended():\n"
                "    from tarsier_batch.workers import fork_server\n"
                "    try:\n"
                "        os.kill(fork_server._quiet_server_pid, 0)\n"
                "        server = 'running'\n"
                "    except ProcessLookupError:\n"
                "        server = 'stopped'\n"
                "    except TypeError:\n"
                "        server = 'never started'\n"
                "    os.write(2, f'at-exit handlers ran; decoding server {server}\\n'.encode())\n"
                "atexit.register(ended)\n"
                "sys.argv = ['tarsier'] + sys.argv[1:]\n"
                "from tarsier_batch.cli import run_command\n"
                "run_command()\n")


def test_the_command_ends_with_its_summary(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The process lingered 2-15 s after its summary, tearing down the interpreter (collecting every object torch
    and the model made): the summary's wall time understated the command's. The at-exit handlers (Ray's) still
    run, and the decoding server stops with the command rather than tearing down its own interpreter after it."""
    out = tmp_path / "r.parquet"
    done = subprocess.run([sys.executable, "-c", _ENTRY_PROBE, "caption", str(SAMPLE_DATA / "still.png"), "--model",
                           str(tiny_model_dir), "-o", str(out), "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[-2].startswith("tarsier: done: captioned 1;"), done.stderr
    assert lines[-1] == "at-exit handlers ran; decoding server stopped"   # not left to tear down its own torch
    assert "interpreter torn down" not in done.stderr
    assert pq.read_table(out).num_rows == 1


def test_the_commands_exit_code_and_messages_come_through_the_entry_point(tmp_path: Path) -> None:
    usage = subprocess.run([sys.executable, "-c", _ENTRY_PROBE, "caption", str(tmp_path / "none.mp4"), "-o",
                            str(tmp_path / "r.parquet")], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert usage.returncode == 2 and "none.mp4" in usage.stderr
    assert usage.stderr.endswith("at-exit handlers ran; decoding server never started\n")
    version = subprocess.run([sys.executable, "-c", _ENTRY_PROBE, "--version"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert version.returncode == 0 and version.stdout.startswith("tarsier-batch ")


def test_a_missing_extra_is_installed_the_way_the_package_was() -> None:
    # From an index; from a clone installed editable (`pip install -e .`: the index may not have this package at
    # all), or from a folder. The development install is editable, so the real call names this checkout.
    assert extra_command_for(None, "scenes") == "pip install 'tarsier-batch[scenes]'"
    assert extra_command_for({"url": "https://example.org/t.whl", "archive_info": {}}, "ray") == \
        "pip install 'tarsier-batch[ray]'"
    assert extra_command_for({"url": "file:///src/tarsier%20batch", "dir_info": {"editable": True}}, "gcs") == \
        "pip install -e '/src/tarsier batch[gcs]'"
    assert extra_command_for({"url": "file:///src/tb", "dir_info": {}}, "gcs") == "pip install '/src/tb[gcs]'"
    assert extra_command_for({"url": "https://github.com/o/tb", "vcs_info": {"vcs": "git"}}, "ray") == \
        "pip install 'tarsier-batch[ray] @ git+https://github.com/o/tb'"
    assert extra_command_for({"url": "file:///src/it's", "dir_info": {}}, "ray") == \
        "pip install '/src/it'\"'\"'s[ray]'"   # quoted for the shell
    assert extra_command_for({"url": "file:///src/tb", "dir_info": ["odd"]}, "ray") == "pip install '/src/tb[ray]'"
    # This installation: the documented development set-up (editable, from this checkout), or from an index.
    assert install_extra_command("scenes") in {f"pip install -e '{Path(__file__).resolve().parents[1]}[scenes]'",
                                               "pip install 'tarsier-batch[scenes]'"}


def test_the_summary_counts_tokens_with_thousands_separators() -> None:
    from tarsier_batch.progress import summary_rows

    stats = RunStats(total=2, done=2, generated_tokens=3592)
    assert dict(summary_rows(stats, "out.parquet", ""))["throughput"].endswith(", 3,592 tokens")
