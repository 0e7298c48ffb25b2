"""Time to the first row of the README's quick start, in fresh processes: this checkout against an earlier commit.

    python bench/bench_startup.py [--before main] [--repeats 5]

Runs `python -m tarsier_batch caption sample_data --model demo --out sample.parquet` (the quick start) in a new empty
folder each time, with the code of this checkout ("after") and of `--before` ("before": that commit exported with
`git archive` into a scratch folder, so that no checkout changes), one after the other in turns, so that both see the
same load of a shared machine; one discarded run each first writes their bytecode caches. For each run:

- `first_row_s`: from starting the command to the first finished row on disk: the first part file in the output's
  work directory (the run's first finished row is written, fsynced and renamed into place at once), or the output
  itself if it comes first. Polled every 5 ms.
- `exit_s`: to the process's exit; `cpu_s`: the command's user + system CPU time (its own and the children it
  waited for: the decoding fork server's too where the command stops and reaps it at its exit).
- `import_torch_s` (once per turn): a fresh interpreter's `import torch`, the machine's speed at that time.
- `server_preload_cpu_s`: measured apart, in a fresh interpreter, the CPU seconds of importing what the decoding
  fork server preloads before it forks its first worker (the modules the command has imported when it starts the
  server, the decoders, the families' processors).

Run it with the Python of the environment to measure (`/path/to/venv/bin/python bench/bench_startup.py`: the README's
install, or one with the extras); the JSON's `environment` says which. Prints JSON: each side's medians and every
run, and the `-X importtime` offenders of one run per side (the main process's imports: the decoding fork server
writes to /dev/null): the top-level imports by cumulative time, and whether torch, transformers' modeling utilities,
decord, PyAV and pandas were imported by the command itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from measured_on import measured_on  # noqa: E402

QUICK_START = ["caption", str(REPO / "sample_data"), "--model", "demo", "--out", "sample.parquet"]
WATCHED_MODULES = ("torch", "transformers.modeling_utils", "decord", "av", "pandas")
POLL_S = 0.005
# In a fresh interpreter, what the decoding fork server imports before it can fork a worker: the parent has the CLI
# and the run imported when it launches the server, which preloads those, the decoding modules and the processors.
PRELOAD_CPU = """
import importlib, time
import tarsier_batch.cli, tarsier_batch.run.caption_run
from tarsier_batch.workers.fork_server import decoding_preload
try:   # the run's checkpoint names the one family whose processor is preloaded
    from tarsier_batch.model.checkpoints import local_checkpoint
    preload = decoding_preload(local_checkpoint("demo"))
except ImportError:   # code from before that: every family's
    preload = decoding_preload()
started = time.process_time()
for name in preload:
    importlib.import_module(name)
print(round(time.process_time() - started, 3))
"""


def export(commit: str, into: Path) -> Path:
    """The tree of `commit` written into `into` (`git archive`: no checkout or branch changes)."""
    into.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def user_environment(code: Path) -> dict[str, str]:
    """This environment with the package at `code` first on the path, and Python writing its bytecode caches as it
    does by default (a container may turn that off, PYTHONDONTWRITEBYTECODE: every run would compile the package
    again, which a user's second run never does)."""
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    return {**environment, "PYTHONPATH": str(code)}


def quick_start(code: Path, folder: Path) -> dict:
    """One quick start with the package at `code`, in the empty `folder`."""
    environment = user_environment(code)
    parts = folder / ".sample.parquet.tarsier"
    output = folder / "sample.parquet"
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "tarsier_batch", *QUICK_START], cwd=folder, env=environment,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first_row = None
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if first_row is None and (output.exists() or (parts.is_dir() and any(parts.glob("part-*.parquet")))):
            first_row = time.perf_counter() - started
        if pid:
            break
        time.sleep(POLL_S)
    exited = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
    if process.returncode != 0 or not output.exists():
        raise RuntimeError(f"the quick start failed ({process.returncode}): {stderr[-2000:]}")
    return {"first_row_s": round(first_row if first_row is not None else exited, 3), "exit_s": round(exited, 3),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}


def server_preload_cpu_s(code: Path, folder: Path) -> float:
    """CPU seconds the decoding fork server spends importing its preload list (the package at `code`; run in
    `folder`, which holds no package: `python -c` puts its working directory first on the path)."""
    done = subprocess.run([sys.executable, "-c", PRELOAD_CPU], cwd=folder, env=user_environment(code),
                          capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def import_offenders(code: Path, folder: Path, top: int = 12) -> dict:
    """The quick start's top-level imports by cumulative seconds (`-X importtime`), and which watched modules it
    imported."""
    environment = user_environment(code)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tarsier_batch", *QUICK_START], cwd=folder,
                          env=environment, capture_output=True, text=True, check=True)
    cumulative: dict[str, float] = {}
    imported: set[str] = set()
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative_us, name = line.removeprefix("import time:").split("|")
        imported.add(name.strip())
        if not name.startswith("  "):   # a top-level import (nested ones are indented)
            cumulative[name.strip()] = round(int(cumulative_us) / 1e6, 3)
    ranked = sorted(cumulative.items(), key=lambda item: -item[1])[:top]
    return {"top_level_s": dict(ranked), "imported": {name: name in imported for name in WATCHED_MODULES}}


def environment() -> dict:
    """The Python the runs used, and which optional packages that change start-up it has: the README's install
    has none of them (pandas comes with the ray extra and pyarrow imports it; Triton is imported by torch._dynamo
    where installed)."""
    import importlib.util

    return {"python": sys.prefix, "installed": {name: importlib.util.find_spec(name) is not None
                                                for name in ("pandas", "triton", "ray")}}


def import_torch_s(folder: Path) -> float:
    """Seconds a fresh interpreter of this environment takes to import torch: the machine's speed at the time of
    the runs, to read rounds run at different times side by side (a shared machine's speed moves by a third)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], cwd=folder, env=user_environment(REPO), check=True)
    return round(time.perf_counter() - started, 3)


def summary(runs: list[dict]) -> dict:
    return {key: round(statistics.median(run[key] for run in runs), 3) for key in ("first_row_s", "exit_s", "cpu_s",
                                                                             "server_preload_cpu_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="main", help="the commit to compare with (default: main)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    before_commit = subprocess.run(["git", "rev-parse", args.before], cwd=REPO, capture_output=True, text=True,
                                   check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        trees = {"before": export(before_commit, Path(scratch) / "before"), "after": REPO}
        runs: dict[str, list[dict]] = {side: [] for side in trees}
        reference: list[float] = []
        for repeat in range(args.repeats + 1):
            for side, code in trees.items():
                folder = Path(tempfile.mkdtemp(dir=scratch))
                measured = {**quick_start(code, folder), "server_preload_cpu_s": server_preload_cpu_s(code, folder)}
                if repeat:   # the first writes the bytecode caches
                    runs[side].append(measured)
            if repeat:
                reference.append(import_torch_s(Path(scratch)))
        offenders = {side: import_offenders(code, Path(tempfile.mkdtemp(dir=scratch))) for side, code in trees.items()}
    medians = {side: summary(side_runs) for side, side_runs in runs.items()}
    print(json.dumps({**measured_on(), "benchmark": "bench/bench_startup.py", "command": "tarsier " + " ".join(
        ["caption", "sample_data", *QUICK_START[2:]]), "environment": environment(), "before_commit": before_commit,
        "repeats": args.repeats,
        "load_average_at_end": list(os.getloadavg()), "median": medians,
        "first_row_before_over_after": round(medians["before"]["first_row_s"] / medians["after"]["first_row_s"], 2),
        "import_torch_s": {"median": statistics.median(reference), "runs": reference},
        "runs": runs, "imports": offenders}, indent=1))


if __name__ == "__main__":
    main()
