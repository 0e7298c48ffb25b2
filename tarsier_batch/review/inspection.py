"""What the tool sees in one file: its facts, the decoder captioning would use and why, the frames it would sample.

Runs the same decoding path as captioning (`media.load_media` with the family's sampler), in a
child process, so "would fail" is real and a decoder that crashes or hangs on the file is
reported rather than taking the command down. No torch, no model.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .. import storage
from ..errors import Worded, one_line, printable
from ..families.catalog import TARSIER, FamilyInfo, family_of_config, model_families
from ..inputs import tars
from ..inputs.copies import readable_copy
from ..inputs.sources import item_of_path
from ..media import (
    FrameCount,
    FrameSampler,
    FramesAtRate,
    MediaType,
    check_regular_file,
    decord_problem,
    frames_in_words,
    load_media,
    media_type_of,
    open_image,
)
from ..workers.fork_server import quiet_fork_server

DECODE_TIMEOUT_S = 120.0


@dataclass
class Inspection:
    """Facts about one file, as captioning would see them; `problem` says why it would fail."""

    path: str
    media_type: str | None = None
    size_bytes: int | None = None
    container: str | None = None
    codec: str | None = None
    image_mode: str | None = None
    stored_size: str | None = None       # width x height as stored
    displayed_size: str | None = None    # after rotation and non-square pixels (what the model sees)
    rotation: int | None = None
    sample_aspect_ratio: str | None = None
    fps: float | None = None
    duration_s: float | None = None
    frame_count: int | None = None       # as the decoder captioning uses counts them
    animated: bool | None = None
    decoder: str | None = None
    decoder_reason: str | None = None
    family: str | None = None
    frames_asked: int | None = None     # a fixed count, or with a rate the most a clip gives
    fps_asked: float | None = None       # frames sampled per second of each clip (the Qwen-VL families' rule)
    frame_indices: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # damage read past decoding the frames (the row's `warnings`)
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def verdict(self) -> str:
        """What captioning would do with the file, naming the warnings its row would carry."""
        if not self.ok:
            return "would fail"
        if not self.warnings:
            return "would caption"
        return (f"would caption, with {'warning' if len(self.warnings) == 1 else 'warnings'} "
                f"{', '.join(self.warnings)} (from the frames that decode)")

    def as_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    def as_text(self) -> str:
        """Aligned `name  value` lines, the known ones only, then the verdict."""
        shown = {_LABELS.get(name, name.replace("_", " ")): _shown(name, value)
                 for name, value in asdict(self).items()
                 if value not in (None, []) and name not in ("warnings", "fps_asked")}
        if self.fps_asked is not None and self.frames_asked is not None:
            shown["frames"] = frames_in_words(FramesAtRate(self.fps_asked, self.frames_asked))
        shown["verdict"] = self.verdict
        width = max(map(len, shown))
        return "\n".join(f"{name:<{width}}  {value}" for name, value in shown.items())


_LABELS = {"size_bytes": "size", "duration_s": "duration", "fps": "frame rate", "frames_asked": "frames"}


def _shown(name: str, value: Any) -> str:
    if name == "size_bytes":
        return f"{value:,} bytes"
    if name == "duration_s":
        return f"{value:g} s"
    if name == "fps":
        return f"{value:g} fps"
    if name == "rotation":
        return f"{value} degrees"
    if name == "frame_indices":
        return " ".join(map(str, value))
    return str(value)


def family_for(model: str) -> FamilyInfo:
    """The family of `--model`: a built-in alias, a known hub id, or a checkpoint folder's config.json."""
    if model == "demo":   # the shipped demo model is a Tarsier v1
        return TARSIER
    for family in model_families():
        if model == family.tiny_alias or model in family.checkpoints:
            return family
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        return family_of_config(json.loads(config.read_text(encoding="utf-8")), str(config))
    raise ValueError(Worded("{model} {name!r}: not a built-in model, a known checkpoint or a checkpoint folder; "
                            "use {family} tarsier or tarsier2", name=model))


def inspect_file(path: str, family: FamilyInfo, frames: FrameCount | None = None,
                 timeout_s: float = DECODE_TIMEOUT_S) -> Inspection:
    """Everything `tarsier inspect` prints about `path` (a file, an object's URL, or a shard's `shard.tar#member`),
    sampling `frames` (the family's count when None)."""
    rule = family.default_frames if frames is None else frames
    if storage.is_url(path) or tars.split_member_path(path) is not None:
        return _inspect_copy(path, family, rule, timeout_s)
    found = _asked(Inspection(printable(os.path.abspath(path)), family=family.name), rule)
    media_type = media_type_of(path)
    if media_type is None:
        found.problem = f"not media: {Path(path).suffix.lower() or 'no extension'} files are skipped by caption"
        return found
    found.media_type = media_type.value
    try:
        found.size_bytes = os.stat(path).st_size
    except OSError:
        pass
    found.__dict__.update(_in_child(_decode_facts, (path, media_type, family, rule), timeout_s))
    return found


def _asked(found: Inspection, rule: FrameCount) -> Inspection:
    """`found` with the frames it samples."""
    if isinstance(rule, FramesAtRate):
        found.frames_asked, found.fps_asked = rule.most, rule.fps
    else:
        found.frames_asked = rule
    return found


def _inspect_copy(path: str, family: FamilyInfo, rule: FrameCount, timeout_s: float) -> Inspection:
    """`inspect_file` of an object or a shard's member, read into a local copy first."""
    found = _asked(Inspection(printable(storage.redact(path)), family=family.name), rule)
    try:
        item = item_of_path(path)
        if item is None:
            name = tars.split_member_path(path)[1] if tars.split_member_path(path) else storage.url_name(path)
            found.problem = f"not media: {Path(name).suffix.lower() or 'no extension'} files are skipped by caption"
            return found
        found.media_type, found.size_bytes = item.media_type.value, item.facts.size_bytes
        with readable_copy(item) as local:
            found.__dict__.update(_in_child(_decode_facts, (local, item.media_type, family, rule), timeout_s))
    except (OSError, ValueError, tars.ShardError, storage.StorageError) as error:
        found.problem = storage.redact_text(str(error) or one_line(error))
    return found


def _decode_facts(path: str, media_type: MediaType, family: FamilyInfo, frames: FrameCount) -> dict[str, Any]:
    """Probe, then decode the sampled frames exactly as captioning does (the pixels are dropped)."""
    try:
        check_regular_file(path)   # before any decoder opens it: a FIFO would block for ever
    except ValueError as error:
        return {"problem": str(error)}
    facts: dict[str, Any] = _probe(path, media_type)
    counted: list[int] = []

    def sampler(total: int, wanted: int) -> list[int]:
        counted.append(total)
        sampler: FrameSampler = family.code("frame_sampler")   # the child has no registry
        return sampler(total, wanted)

    try:
        media = load_media(path, media_type, frames, frame_transform=lambda frame, count: None, sampler=sampler)
    except Exception as error:  # what captioning would put in the row's error column
        facts["problem"] = str(error) if isinstance(error, ValueError) else one_line(error)
        return facts
    # The loaded media, not the extension, says what the row will: an animated WebP or PNG is a "gif",
    # a multi-picture JPEG (MPO) a still although Pillow calls it animated.
    facts.update(media_type=media.media_type.value, displayed_size=f"{media.width}x{media.height}",
                 duration_s=media.duration_s, decoder=media.decoder, frame_indices=media.frame_indices,
                 warnings=list(media.warnings))
    if media_type is not MediaType.VIDEO:
        facts["animated"] = media.media_type is MediaType.GIF
    if counted:
        facts["frame_count"] = counted[0]
    if media.decoder == "pyav":
        facts["decoder_reason"] = decord_problem(os.path.abspath(path)) or "decord could not decode it"
    elif media.decoder == "decord":
        facts["decoder_reason"] = "decord returns the frames asked for in this container and codec"
    else:
        facts["decoder_reason"] = ("Pillow reads GIFs and animated images frame by frame" if facts["animated"]
                                   else "Pillow reads still images") + " (decord reads only videos)"
    return facts


def _probe(path: str, media_type: MediaType) -> dict[str, Any]:
    """Container facts from PyAV (videos) or Pillow (images, GIFs); {} when the file cannot be opened."""
    try:
        return _probe_video(path) if media_type is MediaType.VIDEO else _probe_image(path)
    except Exception:  # the decode that follows reports the reason
        return {}


def _probe_video(path: str) -> dict[str, Any]:
    import av

    with av.open(os.path.abspath(path)) as container:
        stream = container.streams.best("video")
        if stream is None:
            return {"container": container.format.name}
        codec = stream.codec_context
        first = next(container.decode(stream), None)
        aspect = stream.sample_aspect_ratio or codec.sample_aspect_ratio
        rate = stream.average_rate
        return {"container": container.format.name, "codec": codec.name,
                "stored_size": f"{codec.width}x{codec.height}",
                "rotation": int(first.rotation) if first is not None else None,
                "sample_aspect_ratio": str(Fraction(aspect)) if aspect else None,
                "fps": round(float(rate), 3) if rate else None}


def _probe_image(path: str) -> dict[str, Any]:
    with open_image(path, None) as image:   # facts only: no pixel is decoded, no size limit applies
        # A colour key or transparent palette entry is composited over white like an alpha band (media.images._to_rgb)
        transparency = " with transparency" if "transparency" in image.info else ""
        return {"container": image.format, "image_mode": image.mode + transparency,
                "stored_size": f"{image.width}x{image.height}"}


def _in_child(function: Any, args: tuple[Any, ...], timeout_s: float) -> dict[str, Any]:
    """`function(*args)` in a child process: a crash or a hang becomes a problem, not the end of the command."""
    context = quiet_fork_server(["decord", "av", __name__])
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_answer, args=(send, function, args), daemon=True)
    process.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            process.kill()
            return {"problem": f"decoding took longer than {timeout_s:g} s"}
        try:
            return receive.recv()
        except EOFError:   # the child died before answering
            process.join()
            code = process.exitcode or 0
            how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
            return {"problem": f"the decoder crashed ({how})"}
    finally:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


def _answer(send: Connection, function: Any, args: tuple[Any, ...]) -> None:
    """The child's side of `_in_child`."""
    faulthandler.disable()   # a crash is reported by the parent, without a dump of the child's stack
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)   # decord and FFmpeg log from native code (the server's stderr may not be quiet)
    os.close(devnull)
    send.send(function(*args))
