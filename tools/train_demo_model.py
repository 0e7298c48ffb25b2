"""Train the demo model: a small Tarsier v1 that captions the synthetic clips of tarsier_batch.demo.clips.

    python tools/train_demo_model.py            # the shipped checkpoint: 2,400 steps from scratch, 86 min on 2 cores
    python tools/train_demo_model.py --out /tmp/demo --steps 400 --geometry image_size=112   # an experiment

From scratch or from a demo checkpoint (`--init`), on the CPU, in the checkpoint format `tarsier caption` loads.
Each step draws a batch of fresh clips (seeds from TRAIN_SEEDS, disjoint from the held-out seeds `tarsier dev
eval-demo` uses) and trains on exactly what inference feeds the model: the frames v1 samples,
preprocessed by the checkpoint's own processor, the official prompt with one vision block per
frame, then the caption and </s>; the loss is on the caption and </s> only, plus a training-only
shape classifier on the vision features (`ShapeProbe`). `--stills` adds single frames as
pictures, captioned without the motion.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tarsier_batch.demo import DEMO_GEOMETRY, TRAIN_SEEDS, caption_vocabulary  # noqa: E402
from tarsier_batch.demo.clips import SHAPES, make_clip  # noqa: E402
from tarsier_batch.families.tarsier.config import TarsierConfig  # noqa: E402
from tarsier_batch.families.tarsier.modeling import TarsierModel  # noqa: E402
from tarsier_batch.families.tarsier.processing import TarsierPromptProcessor  # noqa: E402
from tarsier_batch.families.tarsier.weights import checkpoint_to_module_key, save_model  # noqa: E402
from tarsier_batch.families.tiny.tarsier import build  # noqa: E402
from tarsier_batch.media import Media, MediaType, frame_indices  # noqa: E402

FRAMES = 8   # what `tarsier caption` samples for v1


def training_batch(processor: TarsierPromptProcessor, seeds: list[int], still_seeds: list[int], eos: int
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list, torch.Tensor]:
    """Token ids, labels (-100 but on the caption and </s>), pixels, the vision blocks and the shape of each row.

    A row of `seeds` is a clip (v1's 8 sampled frames); a row of `still_seeds` is one frame of a
    clip as an image, captioned without the motion ("A red circle."), so that pictures get a
    sentence that fits them; a still costs about a fifth of a clip.
    """
    rows, labels, pixels, blocks, shapes = [], [], [], [], []
    items = [(seed, False) for seed in seeds] + [(seed, True) for seed in still_seeds]
    for seed, still in items:
        clip = make_clip(seed)
        if still:
            frame = clip.frames[random.Random(seed).randrange(len(clip.frames))]
            media = Media("still.png", MediaType.IMAGE, [processor.frame_pixels(frame)], [0], frame.width,
                          frame.height, None, "pillow")
            text = clip.spec.still_caption
        else:
            indices = frame_indices(len(clip.frames), FRAMES)
            frames = [processor.frame_pixels(clip.frames[index], FRAMES) for index in indices]
            media = Media("clip.mp4", MediaType.VIDEO, frames, indices, clip.frames[0].width,
                          clip.frames[0].height, 2.0, "decord")
            text = clip.caption
        prompt = processor.process(media, None)
        caption = processor.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        ids = prompt.token_ids.tolist() + caption
        rows.append(ids)
        labels.append([-100] * prompt.length + caption)
        pixels.append(prompt.pixel_values)
        blocks.append(prompt.vision_blocks)
        shapes.append(SHAPES.index(clip.spec.shape))
    width = max(map(len, rows))
    pad = processor.tokenizer.pad_token_id
    # Right padding: causal attention never lets a real position see the padding after it.
    token_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    targets = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
    return token_ids, targets, pixels, blocks, torch.tensor(shapes)


def captions_right(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row: is every caption token the model's top choice, given the true ones before it?

    The batch is fresh clips, so this tracks held-out exact-match accuracy while training.
    """
    predicted = logits[:, :-1].argmax(-1)
    wanted = targets[:, 1:]
    scored = wanted != -100
    return ((predicted == wanted) | ~scored).all(dim=1).float()


class ShapeProbe(torch.nn.Module):
    """A training-only head: the shape of each frame from its strongest vision feature per channel.

    Through the caption alone, the shape is one token's loss reached across the language model,
    and the vision tower learned it slowly: a linear probe on the 0.88 model's features read the
    shape of a frame only 72 % of the time. Classifying each frame directly, the same tower reads
    it 99 % of the time after 75 s. The head is not saved; the checkpoint stays plain Tarsier v1.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.classify = torch.nn.Linear(width, len(SHAPES))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.classify(features.max(dim=1).values)


def caption_loss(model: TarsierModel, probe: ShapeProbe, feature_layer: int, batch: tuple
                 ) -> tuple[torch.Tensor, float]:
    """The loss of one `training_batch` as inference merges it (plus the probe's), and the share of its rows all
    right."""
    token_ids, targets, pixels, blocks, shapes = batch
    hidden = model.vision_tower(pixel_values=torch.cat(pixels), output_hidden_states=True)
    # The layer inference uses (it drops the layers after it when loading).
    selected = hidden.hidden_states[feature_layer][:, 1:]
    frame_shapes = shapes.repeat_interleave(torch.tensor([len(row_pixels) for row_pixels in pixels]))
    probe_loss = torch.nn.functional.cross_entropy(probe(selected), frame_shapes)
    vectors = model.add_frame_separators(model.multi_modal_projector(selected)).split(
        [len(row_pixels) for row_pixels in pixels])
    embeds = model.language_model.get_input_embeddings()(token_ids)
    pieces = []
    for row in range(len(pixels)):
        row_embeds, cursor = [], 0
        for frame, block in enumerate(blocks[row]):
            row_embeds += [embeds[row, cursor:block.start], vectors[row][frame]]
            cursor = block.end
        row_embeds.append(embeds[row, cursor:])
        pieces.append(torch.cat(row_embeds))
    output = model.language_model(inputs_embeds=torch.stack(pieces), labels=targets)
    return output.loss + probe_loss, captions_right(output.logits.detach(), targets).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "tarsier_batch" / "demo" / "checkpoint")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--stills", type=int, default=16,
                        help="still frames (captioned shape only) added to each batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the weights' dtype on disk (bfloat16 halves the package's size)")
    parser.add_argument("--init", type=Path, help="continue from this demo checkpoint instead of random weights")
    parser.add_argument("--geometry", action="append", default=[], metavar="KEY=N",
                        help="override one DEMO_GEOMETRY value (for experiments), e.g. image_size=84")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.init:
        shutil.copytree(args.init, args.out, dirs_exist_ok=True)
        config = TarsierConfig.from_file(args.out / "config.json")
        model = TarsierModel(config)
        weights = load_file(args.init / "model.safetensors")
        model.load_state_dict({checkpoint_to_module_key(key): value for key, value in weights.items()})
    else:
        geometry = dict(DEMO_GEOMETRY)
        for override in args.geometry:
            key, value = override.split("=")
            if key not in geometry:
                parser.error(f"unknown geometry key {key!r}; known: {', '.join(geometry)}")
            geometry[key] = int(value)
        model = build(args.out, "demo", args.seed, geometry=geometry, extra_text=caption_vocabulary(),
                      init_scale=0.02)
        config = TarsierConfig.from_file(args.out / "config.json")
    processor = TarsierPromptProcessor(args.out, config)
    eos = processor.tokenizer.eos_token_id
    feature_layer = config.vision_feature_layer
    probe = ShapeProbe(config.vision.hidden_size)
    optimizer = torch.optim.AdamW([*model.parameters(), *probe.parameters()], lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    draw = random.Random(args.seed)
    start, history = time.perf_counter(), []
    model.train()
    for step in range(1, args.steps + 1):
        seeds = [draw.randrange(*TRAIN_SEEDS) for _ in range(args.batch)]
        still_seeds = [draw.randrange(*TRAIN_SEEDS) for _ in range(args.stills)]
        # Clips and stills in separate forwards: padded together, a still would take a clip's length.
        loss, right = caption_loss(model, probe, feature_layer, training_batch(processor, seeds, [], eos))
        if still_seeds:
            loss = loss + caption_loss(model, probe, feature_layer, training_batch(processor, [], still_seeds, eos))[0]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        history.append((loss.item(), right))
        if step % 50 == 0 or step == args.steps:
            recent = history[-50:]
            print(json.dumps({"step": step, "loss": round(sum(h[0] for h in recent) / len(recent), 4),
                              "caption_accuracy": round(sum(h[1] for h in recent) / len(recent), 4),
                              "seconds": round(time.perf_counter() - start)}), flush=True)
    model.eval()
    save_model(model.to(getattr(torch, args.save_dtype)), args.out)
    config_file = args.out / "config.json"
    raw = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**raw, "torch_dtype": args.save_dtype}, indent=2) + "\n")
    print(json.dumps({"trained_s": round(time.perf_counter() - start), "steps": args.steps, "batch": args.batch,
                      "stills": args.stills,
                      "parameters": sum(p.numel() for p in model.parameters()), "out": str(args.out)}))


if __name__ == "__main__":
    main()
