"""What a benchmark's JSON says of itself: the commit, machine and versions it ran on; and no figure in
bench/results that a bench here did not measure."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "bench"))

from measured_on import measured_on  # noqa: E402


def test_a_bench_records_the_checkouts_commit_and_what_it_ran_on() -> None:
    import torch

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    recorded = measured_on()
    assert recorded["commit"] == head.stdout.strip()
    assert isinstance(recorded["uncommitted_changes"], bool)
    assert recorded["machine"]["cores"] >= recorded["machine"]["cores_usable"] >= 1
    assert recorded["machine"]["cpu"]
    assert recorded["versions"]["python"] == platform.python_version()
    assert recorded["versions"]["torch"] == torch.__version__
    json.dumps(recorded)  # it goes into the bench's JSON as it is


def recorded_commits(data: object) -> list[str]:
    """Every commit a results file records, wherever its bench put it (at the top, or in an environment section)."""
    if isinstance(data, list):
        return [commit for item in data for commit in recorded_commits(item)]
    if not isinstance(data, dict):
        return []
    found = [data["commit"]] if isinstance(data.get("commit"), str) else []
    history = data.get("commit_recorded_from_git_history")
    if isinstance(history, dict):
        found += [history["committed_in"], history["parent_of_committed_in"]]
    return found + [commit for value in data.values() for commit in recorded_commits(value)]


def test_every_results_file_records_its_commit() -> None:
    """A new file from its bench (measured_on()); an older one what git history says of it, under its own name."""
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        commits = recorded_commits(json.loads(path.read_text()))
        assert commits and all(re.fullmatch(r"[0-9a-f]{40}", commit) for commit in commits), path.name


def test_no_results_file_holds_a_figure_that_was_not_measured_here() -> None:
    """Peer figures (vLLM's, quoted in the docs as citations) never enter bench/results as if measured."""
    for path in sorted(RESULTS.glob("*.json")):
        text = path.read_text().lower()
        assert "peer" not in text and "vllm" not in text, path.name
