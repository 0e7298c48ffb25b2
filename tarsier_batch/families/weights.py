"""Fill a model skeleton from a checkpoint's safetensors files, and write one back.

Shared by the families: each says how its checkpoint's key names map onto its modules (the
official checkpoints keep names that today's transformers modules no longer use).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

# Buffers that older exports saved although they are recomputed at construction.
RECOMPUTED_BUFFERS = ("position_ids", "rotary_emb.inv_freq")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, sharded (with an index) or single."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {model_dir} (expected model.safetensors or an index)")


def load_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype, device: torch.device, family: str,
                 to_module_key: Callable[[str], str] = str,
                 to_checkpoint_key: Callable[[str], str] = str) -> None:
    """Replace the parameters of `model` (built without initialisation) by the checkpoint's.

    Tensors go straight from the files to `device` in `dtype`; buffers recomputed at
    construction (rotary frequencies, position ids) keep their own precision. A key the model
    does not have, or a parameter the checkpoint lacks, is an error naming `family`.
    """
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            _read_tensors(path, device, dtype, expected, state, family, to_module_key)
        except SafetensorError as error:   # a truncated or corrupt file: the checkpoint's problem, not ours
            raise ValueError(f"cannot read {path}: {error}") from error
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(to_checkpoint_key(name) for name in missing[:3])
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weights, e.g. {shown}")
    model.load_state_dict(state, strict=False, assign=True)


def _read_tensors(path: Path, device: torch.device, dtype: torch.dtype, expected: dict[str, nn.Parameter],
                  state: dict[str, torch.Tensor], family: str, to_module_key: Callable[[str], str]) -> None:
    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        for key in handle.keys():
            name = to_module_key(key)
            if name not in expected:
                if name.endswith(RECOMPUTED_BUFFERS):
                    continue
                raise ValueError(f"unexpected weight {key!r} in {path.name}: not a {family} checkpoint?")
            state[name] = handle.get_tensor(key).to(dtype)


def save_weights(model: nn.Module, model_dir: Path, to_checkpoint_key: Callable[[str], str] = str) -> None:
    """Write the parameters as one safetensors file under the checkpoint's key names."""
    state = {to_checkpoint_key(name): tensor.detach().contiguous() for name, tensor in model.named_parameters()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
