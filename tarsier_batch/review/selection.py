"""Which items a report shows one by one: all of them, the first N, or a seeded sample that keeps every status.

The page's figures and error groups always count every row; only the per-item section is cut,
so that a report over 100,000 rows stays a page a browser opens (and frames are extracted for
the items shown only). A sample is stratified: captioned rows and each kind of failure are
strata, each gets its share and at least a few rows, so that 30 failures among 100,000 rows
are not sampled away.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ..errors import UNKNOWN

DEFAULT_SAMPLE = 1_000   # items shown when the output holds more and neither a sample nor a limit is asked for
DEFAULT_SEED = 0
AT_LEAST_PER_STRATUM = 10


@dataclass(frozen=True)
class Selection:
    """The rows shown, by index, in output order; of how many; and how they were chosen."""

    indices: list[int]
    total: int
    how: str | None = None   # "sampled" or "the first": None when every row is shown

    @property
    def note(self) -> str | None:
        """What the page says when it does not show every item."""
        if self.how is None:
            return None
        return f"showing {len(self.indices):,} of {self.total:,} items, {self.how}"


def select_items(rows: list[dict[str, Any]], sample: int | None = None, limit: int | None = None,
                 seed: int = DEFAULT_SEED) -> Selection:
    """`limit`: the first `limit` rows; `sample`: a stratified sample of that many (0: every row); neither: a
    sample of DEFAULT_SAMPLE when there are more rows."""
    total = len(rows)
    if limit is not None:
        return Selection(list(range(min(limit, total))), total, "the first" if limit < total else None)
    wanted = DEFAULT_SAMPLE if sample is None else sample
    if wanted == 0 or wanted >= total:
        return Selection(list(range(total)), total)
    return Selection(stratified_sample(rows, wanted, seed), total, "sampled")


def status_of(row: dict[str, Any]) -> str:
    """The stratum of a row: "captioned", or its kind of failure."""
    return (row.get("error_kind") or UNKNOWN) if row.get("error") else "captioned"


def stratified_sample(rows: list[dict[str, Any]], count: int, seed: int) -> list[int]:
    """`count` row indices (fewer than the rows), in output order: each stratum's share of `count`, at least
    AT_LEAST_PER_STRATUM of it (or all, if it is smaller), each stratum's rows drawn with `seed`."""
    strata: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        strata.setdefault(status_of(row), []).append(index)
    shares = _shares({name: len(members) for name, members in strata.items()}, count)
    generator = random.Random(seed)
    chosen = [index for name in sorted(strata) for index in generator.sample(strata[name], shares[name])]
    return sorted(chosen)


def _shares(sizes: dict[str, int], count: int) -> dict[str, int]:
    """How many of `count` each stratum gets: a floor (AT_LEAST_PER_STRATUM, less when `count` cannot give every
    stratum that much), the rest in proportion to what each stratum has beyond its floor (largest remainders)."""
    if count < len(sizes):   # more strata than rows to show: one row of each of the largest strata
        largest = sorted(sizes, key=lambda name: (-sizes[name], name))[:count]
        return {name: int(name in largest) for name in sizes}
    floor = min(AT_LEAST_PER_STRATUM, count // len(sizes))
    shares = {name: min(size, floor) for name, size in sizes.items()}
    left = count - sum(shares.values())
    spare = {name: sizes[name] - shares[name] for name in sizes}
    room = sum(spare.values())
    exact = {name: left * spare[name] / room for name in sizes}
    for name in sizes:
        shares[name] += int(exact[name])
    rest = left - sum(int(value) for value in exact.values())
    for name in sorted(sizes, key=lambda n: (-(exact[n] - int(exact[n])), n))[:rest]:
        shares[name] += 1
    return shares
