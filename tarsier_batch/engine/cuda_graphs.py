"""Decode steps replayed as CUDA graphs: one launch for the whole step instead of one per kernel.

An eager decode step of Tarsier2-7B launches ~1,900 kernels, and up to tens of rows the GPU finishes
each before the host has launched the next: the device sits idle most of an eager step (the decode-step
figures of bench/README.md, "GPU"). A CUDA graph records the step's kernels once for a set
of input sizes and replays them in one call. The decode step's sizes are padded to a few
(`attention.bucket`, `attention.fine_bucket`), so a run records a few dozen graphs, each in about the
time of three steps.

A replay runs on the tensors the graph was recorded with: each call copies its inputs into them, and
the output comes back copied out of a buffer that the graphs of the same output size share (a later
replay overwrites it). Everything else the step touches stays where it was recorded: the weights, and
the KV cache, allocated once, which the step writes in place. The graphs share one memory pool (one
step replays at a time); it holds one decode step's intermediates, inside the share of free memory the
KV cache leaves (`devices.CUDA_KV_SHARE`), and is given back after the device runs out of memory
(`release`).

A recording that fails is fatal (`CudaGraphError`): torch's allocator is left mid-recording then, and
nothing after it can be trusted. The run stops with the reason; `--no-cuda-graphs` runs without graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import Worded


class CudaGraphError(RuntimeError):
    """Recording a CUDA graph failed: the process's CUDA state cannot be trusted for more steps."""


class _Recorded(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: list[Any]        # the leaves the graph reads: tensors to copy each call into, or fixed values
    output: torch.Tensor     # the buffer the graph writes its result into


class StepGraphs:
    """A step function (tensors in, one tensor out, no host synchronisation inside) replayed as a CUDA graph per
    distinct set of input sizes.

    The function comes with each call, the same one every time (a graph replays what the first call of its sizes
    recorded), and is not kept: it is its owner's method, and keeping it would tie the owner to itself in a
    reference cycle, which outlives a dropped engine, and the model's weights with it, until the cyclic
    collector's next full collection."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[tuple, _Recorded] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}   # (shape, dtype) -> the buffer graphs of that output share
        self.pool: tuple | None = None
        # One stream for every warm-up and recording, on the graph's device (not the current one): each new
        # stream would also get cuBLAS a workspace of its own, kept for the process's life.
        self.stream = torch.cuda.Stream(device)

    def __call__(self, function: Callable[..., torch.Tensor], *inputs: Any) -> torch.Tensor:
        leaves, spec = tree_flatten(inputs)
        key = (spec, tuple((leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))
        with torch.cuda.device(self.device):
            recorded = self.graphs.get(key)
            if recorded is None:
                recorded = self.graphs[key] = self._record(function, leaves, spec)
            for static, leaf in zip(recorded.inputs, leaves):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf, non_blocking=True)
            recorded.graph.replay()
            return recorded.output.clone()

    def release(self) -> None:
        """Forget every graph and their pool (after running out of memory: the pool is memory no step can use);
        they are recorded again as steps need them."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def _record(self, function: Callable[..., torch.Tensor], leaves: list[Any], spec: Any) -> _Recorded:
        """Warm up once (compilation and lazy initialisation happen outside the recording; the step's KV writes
        are the same values to the same slots, again at the replay), then record. An error of the warm-up is
        the step's own and propagates as it is; one of the recording is a `CudaGraphError`."""
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        arguments = tree_unflatten(static, spec)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            warm = function(*arguments)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        output = self.outputs.setdefault((warm.shape, warm.dtype), torch.empty_like(warm))
        del warm
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's unsafe calls break the recording, not another thread's work.
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                output.copy_(function(*arguments))
        except Exception as error:
            cause = error.__context__ or error   # a failed recording's own error is often "a previous error"
            raise CudaGraphError(Worded("recording a decode step as a CUDA graph failed ({cause}); run with "
                                        "{cuda_graphs}", cause=f"{type(cause).__name__}: "
                                        f"{str(cause).splitlines()[0] if str(cause) else ''}")) from error
        if self.pool is None:
            self.pool = graph.pool()
        return _Recorded(graph, static, output)
