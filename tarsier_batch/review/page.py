"""The report as one HTML page: no network, no external file but its strips' folder (`strip_files`), if any.

The header (provenance, figures, histogram, errors by kind, what the page leaves out) is static
HTML. The items travel as one JSON block that a small script renders a page at a time, filtered
by media type, status and text; user text reaches the page only through `textContent`, never as
markup. Each item's frame strip (a data: URI, or a file's relative path) is a separate inert
block, read only when its item is shown, so opening the page parses a JSON block of a few MB,
not the images. The filter state lives in the URL's fragment
(`#status=failed&type=video&q=cat&page=2`), so a filtered view can be bookmarked, and tested.
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from typing import Any

from ..inputs.sources import row_id_of
from .results import Figures, Results, answers
from .sections import error_groups, notes
from .selection import Selection

PAGE_SIZE = 50
ITEM_FIELDS = ("path", "media_type", "caption", "prompt", "model", "num_frames", "frame_indices", "width", "height",
               "duration_s", "decoder", "prompt_tokens", "generated_tokens", "finish_reason", "error", "warnings",
               "elapsed_s", "size_bytes")


def render(results: Results, figures: Figures, strips: list[dict[str, str | None]], title: str,
           selection: Selection | None = None) -> str:
    """The whole page; `strips` holds, per row shown (`selection`'s, default every row), {"uri": ...} (a data:
    URI, or a path relative to the page) or {"problem": ...}."""
    shown = [results.rows[index] for index in selection.indices] if selection is not None else results.rows
    items = [_item(row, strip, results) for row, strip in zip(shown, strips)]
    files = _timelines(shown, items)
    data = json.dumps({"items": items, "files": files, "pageSize": PAGE_SIZE}, ensure_ascii=False,
                      separators=(",", ":"))
    # Inside <script>, only "</" and "<!--" can end or confuse the block; JSON allows "<\/".
    data = data.replace("</", "<\\/").replace("<!--", "<\\u0021--")
    # data: URIs are base64 and a fixed prefix, and a strip's relative path is percent-encoded: nothing in them
    # can end a block.
    images = "\n".join(f'<script type="text/plain" id=strip-{index}>{strip["uri"]}</script>'
                       for index, strip in enumerate(strips) if strip.get("uri"))
    header = _header(results, figures, title) + notes(results, selection)
    return _TEMPLATE.format(title=html.escape(title), header=header, data=data,
                            images=images, style=_STYLE, script=_SCRIPT)


def _item(row: dict[str, Any], strip: dict[str, str | None], results: Results) -> dict[str, Any]:
    item = {name: row.get(name) for name in ITEM_FIELDS}
    item["path"] = row_id_of(row)   # a segment's with its span (`clip.mp4#t=10,20`): a row of its own
    item.update(strip=bool(strip.get("uri")), stripProblem=strip.get("problem"),
                extra={name: _plain(row.get(name)) for name in results.extra_columns})
    if results.questions:   # a prompt set: each question's answer, under its name
        item["answers"] = [[question, answer, row.get(question + "_prompt")]
                           for question, answer in zip(results.questions, answers(results, row))]
        item["caption"] = " ".join(answer or "" for answer in answers(results, row))   # what the search looks in
    return item


def _timelines(rows: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The files whose rows are segments, each with its segments on a timeline: [start_s, end_s, failed, item
    index]. Each segment's item gets `file` (its file's index here), `segment` and `span`."""
    files: dict[str, dict[str, Any]] = {}
    for index, (row, item) in enumerate(zip(rows, items)):
        if row.get("start_s") is None or row.get("end_s") is None:
            continue
        file = files.setdefault(row["path"], {"path": row["path"], "length": 0.0, "segments": [],
                                              "index": len(files)})
        file["segments"].append([row["start_s"], row["end_s"], bool(row.get("error")), index])
        # The file's length where a row recorded it; else as far as its segments reach.
        file["length"] = max(file["length"], row["end_s"], row.get("duration_s") or 0.0)
        item.update(file=file["index"], segment=row.get("segment"), span=[row["start_s"], row["end_s"]])
    return [{name: value for name, value in file.items() if name != "index"} for file in files.values()]


def _questions(prompt_set: list[dict[str, Any]] | None) -> str | None:
    return "; ".join(f"{question['name']}: {question['text']}" for question in prompt_set) if prompt_set else None


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _header(results: Results, figures: Figures, title: str) -> str:
    p = results.provenance
    generation = p.get("generation") or {}
    facts = [("model", f"{p.get('model', '?')} ({p.get('model_family', '?')})"),
             ("prompt", _questions(p.get("prompt_set")) or p.get("prompt") or "the model's default"),
             ("frames", p.get("frames")),
             ("generation", ", ".join(f"{k} {v}" for k, v in generation.items() if k != "eos_token_ids")),
             ("device", f"{p.get('device', '?')} ({p.get('dtype', '?')})"),
             ("tool", f"tarsier-batch {p.get('tool_version', '?')}"),
             ("report written", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))]
    rate = (f"{figures.items_per_s:.3g} items/s, {figures.tokens_per_s:.3g} tokens/s"
            if figures.items_per_s and figures.tokens_per_s else "n/a")
    warned = f" ({', '.join(f'{kind} {count}' for kind, count in figures.warning_kinds)})" if figures.warned else ""
    numbers = [("items", figures.total), ("captioned", figures.captioned), ("failed", figures.failed),
               ("with warnings", f"{figures.warned}{warned}"),
               ("by type", ", ".join(f"{count} {kind}" for kind, count in figures.by_type.items())),
               ("throughput", rate),
               ("caption words", f"mean {figures.words_mean:.1f}, median {figures.words_median:g}"
                if figures.words_mean is not None else "n/a")]
    parts = [f"<h1>{html.escape(title)}</h1>", "<div class=facts>",
             _definitions("run", facts), _definitions("figures", numbers), _histogram_svg(figures), "</div>"]
    parts.append(error_groups(figures))
    return "\n".join(parts)


def _definitions(caption: str, pairs: list[tuple[str, Any]]) -> str:
    rows = "".join(f"<dt>{html.escape(name)}</dt><dd>{html.escape(str(value))}</dd>" for name, value in pairs)
    return f"<section><h2>{caption}</h2><dl>{rows}</dl></section>"


def _histogram_svg(figures: Figures) -> str:
    if not figures.histogram:
        return "<section><h2>caption length</h2><p>no captions</p></section>"
    width, height, gap = 300, 110, 2
    bar = width / len(figures.histogram)
    top = max(count for _, _, count in figures.histogram) or 1
    bars = []
    for index, (low, high, count) in enumerate(figures.histogram):
        tall = round(90 * count / top)
        label = html.escape(f"{low}-{high} words: {count}")
        bars.append(f'<rect x="{index * bar:.1f}" y="{95 - tall}" width="{bar - gap:.1f}" height="{tall}">'
                    f"<title>{label}</title></rect>")
    first, last = figures.histogram[0][0], figures.histogram[-1][1]
    axis = (f'<text x="0" y="{height - 2}">{first}</text>'
            f'<text x="{width}" y="{height - 2}" text-anchor="end">{last} words</text>')
    return (f'<section><h2>caption length</h2><svg class=hist viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="caption length histogram">{"".join(bars)}{axis}</svg></section>')


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:16px;color:#222}
h1{font-size:20px;margin:0 0 8px}h2{font-size:13px;text-transform:uppercase;color:#666;margin:0 0 4px}
.facts{display:flex;gap:24px;flex-wrap:wrap;margin-bottom:12px}.facts section{min-width:260px;flex:1}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 10px;margin:0}dt{color:#666}dd{margin:0}
.hist rect{fill:#4a7bd0}.hist text{font-size:10px;fill:#666}
.errors{background:#fff4f4;border:1px solid #f0c8c8;padding:6px 10px;margin-bottom:12px}
.errors code{white-space:pre-wrap}
.note{background:#fffbe6;border:1px solid #e6d9a0;padding:4px 10px;margin:0 0 8px}
.controls{position:sticky;top:0;background:#fff;padding:8px 0;border-bottom:1px solid #ddd;display:flex;gap:8px;
flex-wrap:wrap;align-items:center}
.item{border-bottom:1px solid #eee;padding:10px 0}.item.failed{background:#fff8f8}
.strip{margin:4px 0}.strip img{display:block;max-width:100%;height:auto}
.path{font-family:monospace;font-size:12px;word-break:break-all}.caption{white-space:pre-wrap;margin:4px 0}
.meta{color:#666;font-size:12px}.problem{color:#a00;font-size:12px}
.badge{display:inline-block;background:#fff1d6;border:1px solid #e8b960;color:#7a4b00;font-size:12px;
padding:0 6px;margin:2px 4px 2px 0;border-radius:8px}.pager button{min-width:32px}
.file{margin-top:12px;padding:6px 0 2px;border-top:2px solid #ccc}
.timeline{position:relative;height:10px;background:#eee;margin:4px 0}
.timeline .seg{position:absolute;top:0;bottom:0;background:#9bb7e6;border-right:1px solid #fff}
.timeline .seg.failed{background:#e69b9b}.timeline .seg.current{background:#2a5bb0}
.timeline .seg.failed.current{background:#b02a2a}
"""

_SCRIPT = r"""
const data = JSON.parse(document.getElementById('data').textContent);
const items = data.items;
const list = document.getElementById('items');
const state = {type: '', status: '', q: '', page: 1};
function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  for (const key of Object.keys(state)) if (params.has(key)) state[key] = params.get(key);
  state.page = Math.max(1, parseInt(state.page, 10) || 1);
  document.getElementById('type').value = state.type;
  document.getElementById('status').value = state.status;
  document.getElementById('q').value = state.q;
}
function writeHash() {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(state)) {
    if (value && !(key === 'page' && value === 1)) params.set(key, value);
  }
  history.replaceState(null, '', '#' + params.toString());
}
function matches(item) {
  if (state.type && item.media_type !== state.type) return false;
  if (state.status === 'ok' && item.error) return false;
  if (state.status === 'failed' && !item.error) return false;
  if (state.status === 'warnings' && !(item.warnings || []).length) return false;
  if (state.q) {
    const q = state.q.toLowerCase();
    if (!((item.caption || '') + ' ' + item.path).toLowerCase().includes(q)) return false;
  }
  return true;
}
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function seconds(value) { return (Math.round(value * 100) / 100) + ' s'; }
// A file's segments as a bar, each at its place in the file; `current` (an item's index) marked.
function timeline(file, current) {
  const bar = el('div', 'timeline');
  for (const [start, end, failed, index] of file.segments) {
    const seg = el('span', 'seg' + (failed ? ' failed' : '') + (index === current ? ' current' : ''));
    seg.style.left = (100 * start / file.length) + '%';
    seg.style.width = (100 * (end - start) / file.length) + '%';
    seg.title = seconds(start) + ' - ' + seconds(end) + (failed ? ' (failed)' : '');
    bar.appendChild(seg);
  }
  return bar;
}
function fileHeader(file) {
  const node = el('div', 'file');
  const failed = file.segments.filter(segment => segment[2]).length;
  node.appendChild(el('div', 'path', file.path));
  node.appendChild(el('div', 'meta', file.segments.length + ' segments over ' + seconds(file.length) +
    (failed ? ', ' + failed + ' failed' : '')));
  node.appendChild(timeline(file, -1));
  return node;
}
function card(item, index) {
  const node = el('div', item.error ? 'item failed' : 'item');
  node.appendChild(el('div', 'path', item.path));
  for (const kind of item.warnings || []) node.appendChild(el('span', 'badge', kind));
  if (item.file != null) {
    const file = data.files[item.file];
    node.appendChild(timeline(file, index));
    node.appendChild(el('div', 'meta', 'segment ' + item.segment + ': ' + seconds(item.span[0]) + ' - ' +
      seconds(item.span[1]) + ' of ' + seconds(file.length)));
  }
  if (item.strip) {
    const box = el('div', 'strip'); const img = el('img');
    img.alt = 'frames ' + (item.frame_indices || []).join(' ');
    img.src = document.getElementById('strip-' + index).textContent;
    box.appendChild(img); node.appendChild(box);
  } else if (item.stripProblem) node.appendChild(el('div', 'problem', 'no frames: ' + item.stripProblem));
  if (item.error) node.appendChild(el('div', 'problem', 'error: ' + item.error));
  if (item.answers) item.answers.forEach(([name, answer, asked]) => {
    const box = el('div', 'caption'); box.title = asked || '';
    box.appendChild(el('b', null, name + ': '));
    box.appendChild(document.createTextNode(answer == null ? '-' : answer));
    node.appendChild(box);
  });
  else if (!item.error) node.appendChild(el('div', 'caption', item.caption));
  const facts = [item.media_type, item.width && item.height ? item.width + 'x' + item.height : null,
    item.duration_s != null ? item.duration_s + ' s' : null,
    item.num_frames != null ? item.num_frames + (item.num_frames === 1 ? ' frame' : ' frames') : null,
    item.decoder, item.prompt_tokens != null ? item.prompt_tokens + ' prompt tokens' : null,
    item.generated_tokens != null ? item.generated_tokens + ' generated (' + item.finish_reason + ')' : null,
    item.elapsed_s != null ? item.elapsed_s.toFixed(2) + ' s' : null, item.model];
  node.appendChild(el('div', 'meta', facts.filter(Boolean).join(' · ')));
  if (item.prompt) node.appendChild(el('div', 'meta', 'prompt: ' + item.prompt));
  const extra = Object.entries(item.extra || {});
  if (extra.length) node.appendChild(el('div', 'meta', extra.map(([k, v]) => k + ': ' + v).join(' · ')));
  return node;
}
function render() {
  const shown = [];
  items.forEach((item, index) => { if (matches(item)) shown.push([item, index]); });
  const pages = Math.max(1, Math.ceil(shown.length / data.pageSize));
  state.page = Math.min(state.page, pages);
  const start = (state.page - 1) * data.pageSize;
  const slice = shown.slice(start, start + data.pageSize);
  // A file's segments come under its header: once per file on a page, where its first shown segment is.
  const nodes = [];
  let lastFile = null;
  for (const [item, index] of slice) {
    if (item.file != null && item.file !== lastFile) nodes.push(fileHeader(data.files[item.file]));
    lastFile = item.file;
    nodes.push(card(item, index));
  }
  list.replaceChildren(...nodes);
  document.body.dataset.fileHeaders = list.querySelectorAll('.file').length;
  document.getElementById('count').textContent =
    shown.length + ' of ' + items.length + ' items, page ' + state.page + '/' + pages;
  document.body.dataset.matching = shown.length;
  document.body.dataset.rendered = slice.length;
  writeHash();
  countImages(++renders);
}
// How many of the page's frame strips the browser could read, on <body> for tests. Counted from
// each image's load or error event: those come before the window's load event, which a headless
// browser's DOM dump waits for; img.decode() settles off the main thread, possibly after the dump.
let renders = 0;
function countImages(render) {
  let loaded = 0, failed = 0;
  const tally = () => {
    if (render !== renders) return;   // a later render replaced these images
    document.body.dataset.imagesLoaded = loaded;
    document.body.dataset.imagesFailed = failed;
  };
  for (const img of list.querySelectorAll('img')) {
    if (img.complete) { if (img.naturalWidth > 0) loaded++; else failed++; continue; }
    img.addEventListener('load', () => { loaded++; tally(); }, {once: true});
    img.addEventListener('error', () => { failed++; tally(); }, {once: true});
  }
  tally();
}
for (const id of ['type', 'status']) {
  document.getElementById(id).addEventListener('change', e => {
    state[id] = e.target.value; state.page = 1; render();
  });
}
document.getElementById('q').addEventListener('input', e => { state.q = e.target.value; state.page = 1; render(); });
document.getElementById('prev').addEventListener('click', () => { state.page -= 1; render(); });
document.getElementById('next').addEventListener('click', () => { state.page += 1; render(); });
window.addEventListener('hashchange', () => { readHash(); render(); });
readHash(); render();
"""

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>{title}</title><style>{style}</style></head>
<body>
{header}
<div class=controls>
<select id=type><option value="">all types</option><option value=video>video</option><option value=gif>gif</option>
<option value=image>image</option></select>
<select id=status><option value="">all items</option><option value=ok>captioned</option>
<option value=failed>failed</option><option value=warnings>with warnings</option></select>
<input id=q type=search placeholder="search captions and paths">
<span class=pager><button id=prev>‹</button><button id=next>›</button></span><span id=count></span>
</div>
<div id=items></div>
<script type="application/json" id=data>{data}</script>
{images}
<script>{script}</script>
</body></html>
"""
