"""What a checkpoint's generation_config.json asks of every generate call: stop ids, repetition penalty.

The official scripts pass only max_new_tokens, sampling switches, temperature and top-p to
`generate`, so everything else in this file still applies to their output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: frozenset[int]
    repetition_penalty: float = 1.0


def read_generation_defaults(model_dir: Path, tokenizer_eos: int | None) -> GenerationDefaults:
    """Stop ids from generation_config.json (else the tokenizer's end-of-sequence token) and its penalty."""
    path = model_dir / "generation_config.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    eos = raw.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    if not ids:
        raise ValueError(f"{model_dir} names no end-of-sequence token")
    return GenerationDefaults(frozenset(int(token) for token in ids), _penalty(raw, path))


def read_repetition_penalty(model_dir: Path) -> float:
    """The checkpoint's repetition penalty alone (1.0: none), without its tokenizer."""
    path = model_dir / "generation_config.json"
    return _penalty(json.loads(path.read_text()) if path.exists() else {}, path)


def _penalty(raw: dict, path: Path) -> float:
    penalty = float(raw.get("repetition_penalty") or 1.0)
    if penalty <= 0:
        raise ValueError(f"{path}: repetition_penalty must be positive, found {penalty}")
    return penalty
