"""Read and write Tarsier v1 weights in the official safetensors layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.initialization import no_init_weights

from .modeling import TarsierConfig, TarsierModel

# transformers 5 flattened CLIPVisionModel (no `vision_model.` level); the checkpoints keep it.
_CHECKPOINT_VISION_PREFIX = "vision_tower.vision_model."
_MODULE_VISION_PREFIX = "vision_tower."
# Buffers that older exports saved although they are recomputed at construction.
_RECOMPUTED_BUFFERS = ("position_ids", "rotary_emb.inv_freq")


def checkpoint_to_module_key(key: str) -> str:
    """The module name a checkpoint key loads into."""
    if key.startswith(_CHECKPOINT_VISION_PREFIX):
        return _MODULE_VISION_PREFIX + key[len(_CHECKPOINT_VISION_PREFIX):]
    return key


def module_to_checkpoint_key(key: str) -> str:
    """The checkpoint key a module parameter is saved under (the official names)."""
    if key.startswith(_MODULE_VISION_PREFIX):
        return _CHECKPOINT_VISION_PREFIX + key[len(_MODULE_VISION_PREFIX):]
    return key


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


def load_model(model_dir: Path, config: TarsierConfig, dtype: torch.dtype, device: torch.device) -> TarsierModel:
    """Build the network without random initialisation and fill it from the checkpoint.

    The skeleton's parameters are left uninitialised on the host (untouched memory, never
    written) and replaced by the checkpoint's tensors, which go straight from the files to
    `device` in `dtype`. Buffers recomputed at construction (rotary frequencies, position ids)
    keep their own precision and follow the model to `device`.
    """
    with no_init_weights():
        model = TarsierModel(config)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for key in handle.keys():
                name = checkpoint_to_module_key(key)
                if name not in expected:
                    if name.endswith(_RECOMPUTED_BUFFERS):
                        continue
                    raise ValueError(f"unexpected weight {key!r} in {path.name}: not a Tarsier v1 checkpoint?")
                state[name] = handle.get_tensor(key).to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(module_to_checkpoint_key(name) for name in missing[:3])
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weights, e.g. {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    model.drop_unused_vision_layers()
    return model.to(device).eval()


def save_model(model: TarsierModel, model_dir: Path) -> None:
    """Write the weights as one safetensors file with the official key names."""
    state = {module_to_checkpoint_key(name): tensor.detach().contiguous()
             for name, tensor in model.state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
