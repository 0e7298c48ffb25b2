"""Counting what a step would launch on a GPU, from torch.profiler's CPU op tree.

On a GPU an eager step costs about what the host spends launching its kernels, and that is
counted here on any device: the aten ops of a profiled step that do work themselves. Views
(no data moves) and allocations or metadata queries (no kernel) are left out, and so is an op
that only composes others (`linear` is not counted, the `addmm` it calls is).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

VIEWS = frozenset({"aten::as_strided", "aten::view", "aten::_unsafe_view", "aten::transpose", "aten::slice",
                   "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t", "aten::narrow",
                   "aten::resolve_conj", "aten::resolve_neg", "aten::permute", "aten::alias", "aten::reshape",
                   "aten::lift_fresh", "aten::detach", "aten::view_as_real", "aten::_reshape_alias",
                   "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::flatten",
                   "aten::unflatten"})
# They allocate or answer questions about tensors; when they do work (`to` converting), the work is a
# child op such as copy_, which is counted.
METADATA = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::result_type",
                      "aten::resize_", "aten::detach_", "aten::to", "aten::_to_copy", "aten::contiguous",
                      "aten::is_nonzero", "aten::_has_compatible_shallow_copy_type", "aten::is_same_size",
                      "aten::set_", "aten::new_empty", "aten::new_empty_strided"})


def kernel_ops(events: Iterable[Any]) -> list[str]:
    """Names of the ops in `events` (a profile's `events()`) that would launch a kernel, in order: aten ops,
    and the kernels torch.compile generated (visible to the profiler on the CPU with
    TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 set before torch is imported)."""
    return [event.name for event in events
            if (event.name.startswith("aten::") and _launches(event) and not _delegates(event))
            or _GENERATED.search(event.name)]


_GENERATED = re.compile(r"^graph_\d+_(cpp_|triton_|kernel)")


def non_view_ops(events: Iterable[Any]) -> int:
    """Every aten op that is not a view, composites and the ops they call alike (an upper bound)."""
    return sum(event.name.startswith("aten::") and event.name not in VIEWS for event in events)


def _launches(event: Any) -> bool:
    return event.name not in VIEWS and event.name not in METADATA


def _delegates(event: Any) -> bool:
    """Some op below it launches: it only composes them."""
    return any(child.name.startswith("aten::") and (_launches(child) or _delegates(child))
               for child in event.cpu_children)
