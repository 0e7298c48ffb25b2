"""What a run imports before its first row, and where: each module kept out of a process saves its start-up time.

Each check runs in a fresh interpreter of this checkout and reads its `sys.modules`.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
def fresh_python(code: str, environment: dict[str, str] | None = None) -> dict:
    """Run `code` (which prints one JSON value last) in a new interpreter of this checkout; that value."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(environment or {})})
    return json.loads(done.stdout.splitlines()[-1])


def test_the_recorded_decoder_versions_are_read_without_importing_the_decoders() -> None:
    """The process that holds the model decodes nothing: importing decord and PyAV there only for their versions
    would cost every run ~0.2 s."""
    found = fresh_python(
        "import json, sys\n"
        "from tarsier_batch.media import decoder_versions\n"
        "versions = decoder_versions()\n"
        "imported = [name for name in ('decord', 'av') if name in sys.modules]\n"
        "import av, decord, PIL\n"
        "print(json.dumps({'versions': versions, 'imported': imported, 'expected': [decord.__version__, "
        "av.__version__, PIL.__version__]}))\n")
    decord_version, av_version, pillow_version = found["expected"]
    assert found["imported"] == []
    assert found["versions"] == {"video": f"decord {decord_version}", "video_fallback": f"pyav {av_version}",
                                 "gif": f"pillow {pillow_version}", "image": f"pillow {pillow_version}"}


def test_quieting_the_library_logs_leaves_transformers_unimported_and_quiet() -> None:
    """The decoding fork server starts once the logs are quieted: importing transformers for that would delay it."""
    found = fresh_python(
        "import json, sys\n"
        "from tarsier_batch.cli_run import quiet_library_logs\n"
        "quiet_library_logs()\n"
        "imported = 'transformers' in sys.modules\n"
        "import transformers\n"
        "print(json.dumps({'imported': imported, 'verbosity': transformers.logging.get_verbosity(),\n"
        "                  'error': transformers.logging.ERROR}))\n",
        {"TRANSFORMERS_VERBOSITY": "info"})
    assert found["imported"] is False
    assert found["verbosity"] == found["error"]


def test_quieting_the_library_logs_quiets_a_transformers_imported_already() -> None:
    found = fresh_python(
        "import json, transformers\n"
        "from tarsier_batch.cli_run import quiet_library_logs\n"
        "transformers.logging.set_verbosity_info()\n"
        "quiet_library_logs()\n"
        "print(json.dumps([transformers.logging.get_verbosity(), transformers.logging.ERROR]))\n")
    assert found[0] == found[1]


@pytest.mark.long
def test_a_caption_run_loads_torch_with_its_waiting_cpu_threads_asleep_and_the_collector_paused(
        tmp_path: Path) -> None:
    """OpenMP reads its wait policy when torch loads it: set any later, spinning threads would hold the core a
    decoding worker needs. The cyclic collector would walk torch's objects again and again while they are made
    (model/collector.py). Recorded at the moment the run first imports torch."""
    found = fresh_python(
        "import gc, json, os, sys\n"
        "os.environ.pop('OMP_WAIT_POLICY', None)\n"
        "seen = {}\n"
        "class WatchTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and 'policy' not in seen:\n"
        "            seen['policy'] = os.environ.get('OMP_WAIT_POLICY')\n"
        "            seen['collecting'] = gc.isenabled()\n"
        "sys.meta_path.insert(0, WatchTorch())\n"
        "from tarsier_batch.cli import app\n"
        f"sys.argv = ['tarsier', 'caption', {str(REPO / 'sample_data' / 'still.png')!r}, '--model', 'demo',\n"
        f"            '--out', {str(tmp_path / 'still.parquet')!r}, '--quiet']\n"
        "try:\n"
        "    app(prog_name='tarsier')\n"
        "except SystemExit as stop:\n"
        "    seen['exit'] = stop.code\n"
        "print(json.dumps(seen))\n")
    assert found == {"policy": "PASSIVE", "collecting": False, "exit": 0}


def test_a_wait_policy_the_user_chose_is_kept(monkeypatch) -> None:
    from tarsier_batch.cli_run import let_waiting_cpu_threads_sleep
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    let_waiting_cpu_threads_sleep()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"



NETWORK_MODULES = ("transformers.modeling_utils", "transformers.image_processing_utils",
                   "transformers.models.llama.configuration_llama", "torch.distributed.tensor", "sympy")


@pytest.mark.parametrize("model", ["demo", "tiny-random"])
def test_a_tarsier_v1_decoding_worker_imports_none_of_the_networks_modules(tmp_path: Path, model: str) -> None:
    """A decoding worker forks from the fork server once it has imported its preload list: for a Tarsier v1 run,
    the worker's processor (pickled by the model's process, its network built) preprocesses frames and prompts
    with transformers' tokenizer and image transforms alone. Its modeling utilities (imported by its image
    processor classes and its Llama configuration) would put seconds before the run's first decoded item."""
    from tarsier_batch.families.loading import load_caption_model
    from tarsier_batch.model.checkpoints import resolve_model

    checkpoint = resolve_model(model).path
    processor = load_caption_model(checkpoint, torch.float32, torch.device("cpu")).processor
    pickled = tmp_path / "processor.pickle"
    pickled.write_bytes(pickle.dumps(processor))
    found = fresh_python(
        "import importlib, json, pickle, sys\n"
        "from pathlib import Path\n"
        "from tarsier_batch.workers.fork_server import decoding_preload\n"
        "from tarsier_batch.media import MediaType\n"
        f"preload = decoding_preload(Path({str(checkpoint)!r}))\n"
        "for name in preload:\n"
        "    importlib.import_module(name)\n"
        f"processor = pickle.loads(Path({str(pickled)!r}).read_bytes())\n"
        f"media = processor.load_media({str(REPO / 'sample_data' / 'still.png')!r}, MediaType.IMAGE, 8)\n"
        "prompt = processor.process(media, None)\n"
        f"heavy = [name for name in {NETWORK_MODULES!r} if name in sys.modules]\n"
        "families = [name for name in preload if name.startswith('tarsier_batch.families.') and\n"
        "            name.count('.') == 3]\n"
        "print(json.dumps({'heavy': heavy, 'families': families, 'frames': len(prompt.pixel_values)}))\n")
    assert found == {"heavy": [], "families": ["tarsier_batch.families.tarsier.processing"], "frames": 1}


def test_without_a_readable_checkpoint_the_fork_server_preloads_every_familys_processor(tmp_path: Path) -> None:
    found = fresh_python(
        "import json\n"
        "from pathlib import Path\n"
        "from tarsier_batch.families.catalog import model_families\n"
        "from tarsier_batch.workers.fork_server import decoding_preload\n"
        "every = [family.processor_loader.partition(':')[0] for family in model_families()]\n"
        f"lists = [decoding_preload(checkpoint) for checkpoint in (None, Path({str(tmp_path)!r}))]\n"
        "print(json.dumps({'every': every, 'preloaded': [[name for name in preload if name in every]\n"
        "                                                for preload in lists]}))\n")
    assert len(found["every"]) == 5 and found["preloaded"] == [found["every"]] * 2   # tmp_path: no config.json


def test_a_dry_run_with_segments_reads_lengths_without_torch_or_the_decoding_server(tmp_path: Path) -> None:
    """Cutting videos into windows needs their lengths alone, read by the decoders in fresh worker processes: the
    decoding fork server's preload (torch, the model's processor) is seconds a dry run does not need."""
    clip = REPO / "sample_data" / "ball_h264.mp4"
    found = fresh_python(
        "import json, sys\n"
        "from multiprocessing import forkserver\n"
        "from tarsier_batch.cli import app\n"
        f"sys.argv = ['tarsier', 'caption', {str(clip)!r}, '--model', 'demo', '--segments', 'fixed:1s',\n"
        f"            '--out', {str(tmp_path / 'w.parquet')!r}, '--dry-run']\n"
        "try:\n"
        "    app(prog_name='tarsier')\n"
        "except SystemExit as stop:\n"
        "    code = stop.code\n"
        "print(json.dumps({'exit': code, 'server': forkserver._forkserver._forkserver_pid is not None,\n"
        "                  'torch': 'torch' in sys.modules}))\n")
    assert found == {"exit": 0, "server": False, "torch": False}
