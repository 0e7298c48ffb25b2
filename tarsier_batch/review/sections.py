"""Parts of the report's header that sum up many rows: the failures by kind, and what the page leaves out."""

from __future__ import annotations

import html

from ..errors import KINDS
from ..progress import plural
from .results import Figures, Results
from .selection import Selection


def error_groups(figures: Figures) -> str:
    """The failed items by kind, each with its count, what the kind means and a few examples (file and message)."""
    if not figures.errors:
        return ""
    kinds = ", ".join(f"{group.kind} {group.count:,}" for group in figures.errors)
    parts = [f"<details class=errors open><summary>{plural(figures.failed, 'failed item')}: "
             f"{html.escape(kinds)}</summary><ul>"]
    for group in figures.errors:
        examples = "".join(f"<li><span class=path>{html.escape(path)}</span> <code>{html.escape(message)}</code></li>"
                           for path, message in group.examples)
        more = group.count - len(group.examples)
        examples += f"<li>… and {more:,} more</li>" if more else ""
        parts.append(f"<li><b>{group.count:,} ×</b> <code>{html.escape(group.kind)}</code> "
                     f"<span class=meta>{html.escape(KINDS.get(group.kind, ''))}</span><ul>{examples}</ul></li>")
    parts.append("</ul></details>")
    return "".join(parts)


def notes(results: Results, selection: Selection | None) -> str:
    """Lines above the items that say the page is not every row of a finished run: an unfinished run, a sample."""
    said = [note for note in (results.unfinished.note if results.unfinished else None,
                              selection.note if selection else None) if note]
    if results.unfinished and results.unfinished.unreadable:
        said.append("unreadable parts: " + "; ".join(results.unfinished.unreadable))
    return "".join(f"<p class=note>{html.escape(note)}</p>" for note in said)
