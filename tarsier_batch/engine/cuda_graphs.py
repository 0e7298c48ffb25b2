"""Decode steps replayed as CUDA graphs: one launch for the whole step instead of one per kernel.

An eager decode step of Tarsier2-7B launches ~1,900 kernels, and up to tens of rows the GPU finishes
each before the host has launched the next: measured on an H200, 33 ms a step at 1 row of which the
device was busy 8 ms (bench/README.md, "GPU"). A CUDA graph records the step's kernels once for a set
of input sizes and replays them in one call. The decode step's sizes are padded to powers of two
(`attention.bucket`), so a run records a few dozen graphs, each in about the time of two steps.

A replay runs on the tensors the graph was recorded with: each call copies its inputs into them, and
the step's outputs come back copied out (a later replay overwrites them). Everything else the step
touches stays where it was recorded: the weights, and the KV cache, allocated once, which the step
writes in place. The graphs share one memory pool (one step replays at a time); it holds one decode
step's intermediates, well inside the share of free memory the KV cache leaves (`devices.CUDA_KV_SHARE`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)


class _Recorded(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: list[Any]        # the leaves the graph reads: tensors to copy each call into, or fixed values
    output: torch.Tensor


class StepGraphs:
    """`function` (tensors in, one tensor out, no host synchronisation inside) replayed as a CUDA graph per
    distinct set of input sizes; if recording fails, it runs eagerly from then on, with a warning."""

    def __init__(self, function: Callable[..., torch.Tensor], device: torch.device):
        self.function = function
        self.device = device
        self.graphs: dict[tuple, _Recorded] = {}
        self.pool: tuple | None = None
        self.failed: str | None = None   # why recording failed: every call runs eagerly

    def __call__(self, *inputs: Any) -> torch.Tensor:
        if self.failed is not None:
            return self.function(*inputs)
        leaves, spec = tree_flatten(inputs)
        key = (spec, tuple((leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))
        recorded = self.graphs.get(key)
        if recorded is None:
            try:
                recorded = self.graphs[key] = self._record(leaves, spec)
            except torch.OutOfMemoryError:
                raise   # the engine retries smaller steps
            except RuntimeError as error:
                self.failed = str(error).splitlines()[0] if str(error) else type(error).__name__
                log.warning("decode steps run without CUDA graphs: recording one failed (%s)", self.failed)
                self.graphs.clear()
                return self.function(*inputs)
        for static, leaf in zip(recorded.inputs, leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(leaf, non_blocking=True)
        recorded.graph.replay()
        return recorded.output.clone()

    def _record(self, leaves: list[Any], spec: Any) -> _Recorded:
        """Warm up once on a side stream (compilation and lazy initialisation happen outside the recording;
        the step's KV writes are the same values to the same slots, again at the replay), then record."""
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        arguments = tree_unflatten(static, spec)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.function(*arguments)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe calls break the recording, not another thread's work.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = self.function(*arguments)
        if self.pool is None:
            self.pool = graph.pool()
        return _Recorded(graph, static, output)
