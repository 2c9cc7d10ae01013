"""Where did the model look? Attention from its answer to the image, drawn over the image.

    mmgrpo viz attention --model runs/x/checkpoint-50 --model_type qwen2-vl \\
        --dataset shapes-color:test --index 3 --output attention.png

1. The answer is generated greedily, with the same policy and template as training.
2. One forward over prompt + answer runs with eager attention in the language model (the vision
   tower keeps its own); a hook on every layer's self-attention keeps, of its [heads, L, L]
   weights, only the rows that produced the answer, averaged over heads and those rows: [L].
   Row P - 1 + t is the position that predicted answer token t (P = prompt length).
3. Those rows are averaged over layers (`--layers all`, the default), or one layer is taken
   (`--layers last`, `--layers 3`). Raw attention, no rollout or gradients: it shows which
   media tokens the answer positions read, not why.
4. The columns of each image's (or video's) placeholder tokens, in prompt order, are reshaped
   to the merged patch grid [t, h / merge, w / merge] from `image_grid_thw` and the template
   hook's token count per item (Qwen-VL processors order merged tokens row-major within each
   temporal slot), upsampled onto the original image (or onto the first frame of each temporal
   slot of a video) and drawn as an overlay. The resized model input covers the whole original image, so grid cell
   (r, c) is the same fraction of the original image as of the input.

Colours run from each medium's min to its max (one scale over all slots of a video); a panel's
title gives the share of the answer's attention that went to it (the rest went to text).
"""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

import numpy as np
import torch

from mmgrpo.errors import ConfigError
from mmgrpo.fusion.attach import prompt_length

MAX_VIDEO_PANELS = 8  # temporal slots drawn per video, evenly spaced


def attention_to_image_grid(attn_to_image_tokens, grid_thw, merge_size: int) -> np.ndarray:
    """Attention over one medium's placeholder tokens -> its merged patch grid.

    attn_to_image_tokens: [n_img_tokens], n = t * h * w / merge_size**2, in prompt order.
    grid_thw: (t, h, w) in patches, as in `image_grid_thw` / `video_grid_thw`.
    Returns [t, h / merge_size, w / merge_size] float32.

    >>> attention_to_image_grid(np.arange(6), (1, 4, 6), 2)
    array([[[0., 1., 2.],
            [3., 4., 5.]]], dtype=float32)
    """
    t, h, w = (int(x) for x in grid_thw)
    if h % merge_size or w % merge_size:
        raise ValueError(f"grid {(t, h, w)} is not divisible by merge size {merge_size}")
    values = np.asarray(
        attn_to_image_tokens.detach().cpu()
        if torch.is_tensor(attn_to_image_tokens)
        else attn_to_image_tokens,
        dtype=np.float32,
    )
    expected = t * (h // merge_size) * (w // merge_size)
    if values.shape != (expected,):
        raise ValueError(
            f"grid {(t, h, w)} with merge {merge_size} has {expected} tokens, got shape {values.shape}"
        )
    return values.reshape(t, h // merge_size, w // merge_size)


def upsample(heat, size: tuple[int, int]) -> np.ndarray:
    """A heatmap [H', W'] resized bilinearly to `size` = (width, height): [height, width] float32.

    Each grid cell covers its share of the picture, so the cell (r, c) of an [H', W'] grid lands
    on rows r * height / H' .. (r + 1) * height / H' (and likewise for columns).
    """
    from PIL import Image

    heat = np.asarray(heat, dtype=np.float32)
    return np.asarray(
        Image.fromarray(heat, mode="F").resize(size, Image.Resampling.BILINEAR), dtype=np.float32
    )


def overlay(
    image, heat, alpha: float = 0.5, cmap: str = "jet", value_range: tuple[float, float] | None = None
):
    """`image` (PIL) with `heat` [H', W'] blended on top: PIL RGB, same size.

    value_range (low, high) maps to the two ends of the colour map; default: the heat's min..max.
    """
    from matplotlib import colormaps
    from PIL import Image

    image = image.convert("RGB")
    values = upsample(heat, image.size)  # [height, width]
    low, high = value_range or (float(values.min()), float(values.max()))
    values = np.clip((values - low) / (high - low), 0.0, 1.0) if high > low else np.zeros_like(values)
    colours = colormaps[cmap](values)[..., :3]  # [height, width, 3] in 0..1
    blended = (1 - alpha) * np.asarray(image, dtype=np.float32) / 255.0 + alpha * colours
    return Image.fromarray(np.clip(blended * 255.0 + 0.5, 0, 255).astype(np.uint8))


# ---- the model side ---------------------------------------------------------------------------


def answer_attention(
    model, template, batch: dict, completion_ids, completion_mask, layers: str = "all"
) -> torch.Tensor:
    """Attention of the answer's positions to every position of prompt + answer: [L].

    batch: a collated batch of ONE prompt (no padding); completion_ids, completion_mask: [1, T].
    The language model must run eager attention (so each layer returns its weights).
    """
    prompt_len = batch["input_ids"].shape[1]
    answer_len = int(completion_mask.sum())
    if answer_len == 0:
        raise ConfigError("the model generated an empty answer: nothing to attribute")
    rows = slice(prompt_len - 1, prompt_len - 1 + answer_len)  # row P - 1 + t predicted answer token t
    llm = model.get_submodule(template.components["llm"])
    attention_modules = [module for name, module in llm.named_modules() if name.endswith("self_attn")]
    if not attention_modules:
        raise ConfigError(f"{template.components['llm']} has no `self_attn` modules to read attention from")
    kept: list[torch.Tensor] = []

    def keep(module, args, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [1, heads, L, L]
        if weights is None:
            raise ConfigError("the language model returned no attention weights: it must use eager attention")
        kept.append(weights[0, :, rows].float().mean(dim=(0, 1)).cpu())  # [L]

    handles = [module.register_forward_hook(keep) for module in attention_modules]
    try:
        inputs = template.forward_inputs(batch, completion_ids, completion_mask, model=model)
        # fusion modules of a checkpoint (mmgrpo/fusion/) read the prompt's part of the sequence only
        with torch.no_grad(), prompt_length(model, prompt_len):
            model.get_submodule(template.components["backbone"])(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    per_layer = torch.stack(kept)  # [layers, L]
    if layers == "all":
        return per_layer.mean(0)
    index = -1 if layers == "last" else int(layers)
    if not -len(kept) <= index < len(kept):
        raise ConfigError(f"--layers {layers}: the model has {len(kept)} layers")
    return per_layer[index]


def media_panels(template, prompt, input_ids: torch.Tensor, attention: torch.Tensor) -> list[dict]:
    """Split the attention over media tokens into one grid per image / video, with its pictures.

    input_ids [L], attention [L] (prompt + answer). Returns, per medium in prompt order,
    {"kind", "index", "share", "grid" [t, H', W'], "pictures": [PIL per temporal slot]}.
    """
    from PIL import Image

    panels = []
    media = {"image": ("image_grid_thw", prompt.images), "video": ("video_grid_thw", prompt.videos)}
    for kind, (grid_key, items) in media.items():
        if kind not in template.media or grid_key not in prompt.mm:
            continue
        # The expanded token (e.g. Gemma3's <image_soft_token>), not the placeholder it replaced.
        token_attention = attention[input_ids == template.media[kind].token_id]  # [tokens of every item]
        # The template's hook says how many placeholder tokens each item owns; the merge size
        # follows from its patch grid (t*h*w patches -> t*h*w / merge**2 tokens).
        counts = template.media[kind].tokens_per_item(prompt.mm)
        start = 0
        for index, (grid_thw, count) in enumerate(zip(prompt.mm[grid_key].tolist(), counts)):
            merge = round(math.sqrt(np.prod(grid_thw) / count))
            values = token_attention[start : start + count]
            start += count
            grid = attention_to_image_grid(values, grid_thw, merge)  # [t, H', W']
            if kind == "image":
                pictures = [items[index]]
            else:
                frames = items[index].frames  # [num_frames, height, width, 3]
                pictures = [
                    Image.fromarray(frames[min(len(frames) - 1, k * len(frames) // len(grid))])
                    for k in range(len(grid))
                ]
            panels.append(
                {
                    "kind": kind,
                    "index": index,
                    "share": float(values.sum()),
                    "grid": grid,
                    "pictures": pictures,
                }
            )
        if start != len(token_attention):
            raise ConfigError(
                f"{len(token_attention)} {kind} tokens in the prompt but the grids cover {start}"
            )
    return panels


def render(panels: list[dict], question: str, answer: str, output: Path, note: str = "") -> Path:
    """One PNG: a row of overlays (images, then up to MAX_VIDEO_PANELS slots per video) under a title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tiles = []
    for panel in panels:
        slots = range(len(panel["grid"]))
        if len(slots) > MAX_VIDEO_PANELS:
            slots = np.linspace(0, len(panel["grid"]) - 1, MAX_VIDEO_PANELS).round().astype(int)
        grid = panel["grid"]  # [t, H', W']: one colour scale over all slots of a video
        for slot in slots:
            label = f"{panel['kind']} {panel['index'] + 1}" + (
                f", slot {slot + 1}/{len(grid)}" if panel["kind"] == "video" else ""
            )
            picture = overlay(
                panel["pictures"][slot], grid[slot], value_range=(float(grid.min()), float(grid.max()))
            )
            tiles.append((picture, f"{label}: {float(grid[slot].sum()):.0%} of attention"))
    figure = Figure(figsize=(4 * len(tiles), 4 + 0.9), dpi=100)
    FigureCanvasAgg(figure)
    for i, (picture, label) in enumerate(tiles):
        axes = figure.add_subplot(1, len(tiles), i + 1)
        axes.imshow(picture)
        axes.set_title(label, fontsize=9)
        axes.axis("off")
    width = 45 * len(tiles)  # characters per title line that fit the figure
    lines = [f"Q: {question}", f"A: {answer}"] + ([note] if note else [])
    title = "\n".join(textwrap.fill(clip(line, 3 * width), width) for line in lines)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    return output


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def question_text(messages: list[dict]) -> str:
    """The text of the last user message (media tags dropped)."""
    from mmgrpo.templates.base import Template

    for message in reversed(messages):
        if message["role"] == "user":
            parts = Template.content_parts(message["content"])
            return " ".join(part["text"].strip() for part in parts if part.get("type") == "text").strip()
    return ""


def load_for_attention(model_path: str, model_type: str | None, *, max_pixels=None, dtype=torch.float32):
    """(model, template): the language model with eager attention (it returns its weights), loaded
    in the same sequence as training (`load_template`)."""
    from mmgrpo.models.loading import load_model, load_template

    path, _, template = load_template(model_path, model_type, max_pixels=max_pixels)
    try:  # eager only where the weights are read; the vision tower keeps the default
        model = load_model(path, dtype=dtype, template=template, attn_implementation={"text_config": "eager"})
    except (ValueError, TypeError, KeyError):
        model = load_model(path, dtype=dtype, template=template, attn_implementation="eager")
    return model, template


def attention_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmgrpo viz attention",
        description="Generate an answer greedily, then draw the attention from the answer tokens to the image "
        "(or video) tokens as a heatmap over the image: one PNG, the question and answer as its title.",
    )
    p.add_argument(
        "--model", required=True, help="Model folder (e.g. runs/x/checkpoint-50) or tiny:<family>."
    )
    p.add_argument(
        "--model_type", help="Template name (qwen2-vl, qwen2.5-vl, ...); inferred from the checkpoint when not given."
    )
    p.add_argument("--dataset", required=True, help="NAME[:split] (default split: test) or a data file.")
    p.add_argument("--index", type=int, default=0, help="Row of the split to draw.")
    p.add_argument(
        "--output", default=None, help="PNG path (default: attention-<dataset>-<split>-<index>.png)."
    )
    p.add_argument("--max_new_tokens", type=int, default=64, help="Longest answer in tokens.")
    p.add_argument("--layers", default="all", help="`all` (mean over layers), `last`, or a layer index.")
    p.add_argument("--max_pixels", type=int, default=None, help="Image pixel limit after resizing.")
    p.add_argument("--video_fps", type=float, default=2.0, help="Frames per second sampled from a video.")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="Model weights' dtype."
    )
    p.add_argument("--dataset_registry", nargs="*", default=[], help="Extra registry YAML files.")
    return p


def main(argv: list[str]) -> Path:
    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.rollout import HFRollout, SamplingParams
    from mmgrpo.runstate.runlog import console

    args = attention_parser().parse_args(argv)
    if args.layers not in ("all", "last") and not args.layers.lstrip("-").isdigit():
        raise ConfigError(f"--layers {args.layers!r}: give all, last or a layer index")
    dataset = resolve_dataset(args.dataset, split="test", extra_files=args.dataset_registry)
    if not 0 <= args.index < len(dataset):
        raise ConfigError(f"--index {args.index}: {dataset.name}:{dataset.split} has {len(dataset)} rows")
    sample = dataset[args.index]
    if not (sample.images or sample.videos):
        raise ConfigError(f"sample {sample.id} has no image or video: nothing to draw attention on")

    model, template = load_for_attention(
        args.model, args.model_type, max_pixels=args.max_pixels, dtype=getattr(torch, args.dtype)
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    prompt = template.encode_prompt(sample.load_media(fps=args.video_fps))
    batch = {key: value.to(device) for key, value in template.collate([prompt]).items()}
    # generate: eager attention, which the shared-prefix rollout does not take
    rollout = HFRollout(model, template).generate(
        [prompt], SamplingParams(num_generations=1, max_new_tokens=args.max_new_tokens, greedy=True)
    )
    completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask  # [1, T]
    answer = template.tokenizer.decode(completion_ids[0][completion_mask[0].bool()], skip_special_tokens=True)

    attention = answer_attention(
        model, template, batch, completion_ids, completion_mask, layers=args.layers
    )  # [L]
    input_ids = torch.cat([batch["input_ids"][0], completion_ids[0]]).cpu()  # [L]
    panels = media_panels(template, prompt, input_ids, attention)
    output = Path(
        args.output or f"attention-{dataset.name.replace('/', '_')}-{dataset.split}-{args.index}.png"
    )
    note = f"{sample.id}, layers: {args.layers}" + (
        f", solution: {sample.columns['solution']}" if "solution" in sample.columns else ""
    )
    render(panels, question_text(sample.messages), answer, output, note=note)
    console.print(f"answer: {answer!r}")
    console.print(f"attention map written to {output}")
    return output
