"""What the random-weight test checkpoints of every family share: a training text, scales, file quirks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

TRAINING_TEXT = """
A man wearing a dark beanie peeks out from behind a tree in a snowy forest.
The camera slowly pans to the right and shows another man walking between the trees.
He carries a bundle of branches on his back and looks over his shoulder.
A small animal with very large eyes sits on a branch at night and turns its head.
The video shows a person riding a bicycle along a wet street while cars pass by.
Two children play with a red ball in a park; a dog runs after them and barks.
The image shows a cartoon mascot above a word written in bold letters on a white background.
A woman pours coffee into a white cup, then lifts it and smiles at the camera.
Describe the video in detail. Describe the image in detail. What happens next?
The scene changes to a close-up of hands typing on a keyboard in a dim room.
Snow falls steadily; the wind moves the branches and the light fades toward evening.
In the final shot, the first man raises his arm and points toward the distance.
"""
# Weights are drawn wider than transformers' default (0.02) so that outputs depend strongly on
# the input: with the default, every input yields nearly the same tokens, which hides mix-ups.
INIT_SCALE = 0.3
BASE_VOCAB_SIZE = 700  # tokens learnt from TRAINING_TEXT, before the added tokens


def write_merges_as_strings(tokenizer_json: Path) -> None:
    """Store BPE merges as "a b" strings, the form every tokenizers release reads (0.20+ writes pairs).

    Keeps the checkpoint loadable by the transformers 4.4x that the official code pins.
    """
    data = json.loads(tokenizer_json.read_text())
    data["model"]["merges"] = [" ".join(merge) if isinstance(merge, list) else merge
                               for merge in data["model"]["merges"]]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def plain_config(config: PretrainedConfig) -> dict[str, Any]:
    """A sub-config as the real checkpoints store it: the non-default fields and the model type.

    `rope_theta` is spelled out as well, for transformers 4.x, which does not read `rope_parameters`.
    """
    fields = config.to_diff_dict()
    fields.pop("transformers_version", None)
    rope = fields.get("rope_parameters") or {}
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    return {"model_type": config.model_type, **fields}


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
