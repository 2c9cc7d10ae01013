"""What every model family's template does, and the template registry.

A template turns a `LoadedSample` into model inputs, the way the family's Hugging Face processor
would, but in steps a trainer can use separately:

    template = get_template("qwen2-vl", processor)
    text = template.render(sample.messages)          # ONE placeholder per image / video
    prompt = template.encode_prompt(sample)          # PromptInputs: expanded ids + pixel tensors
    batch = template.collate([prompt, ...])          # left-padded, ready for model.generate(**batch)
    inputs = template.forward_inputs(batch, completion_ids, completion_mask, model=model)
    logits = model(**inputs).logits                  # training forward over prompt + completion

Placeholder expansion happens on token ids: the rendered text is tokenized once, then each
placeholder id is replaced by the ids an `expand_<modality>` hook returns (a few lines per family,
from the processed grid sizes). The rendered text and the raw media also travel in `PromptInputs`
so that a rollout engine (vLLM) can expand them itself; tests check both give identical ids.

A family subclasses `Template`, fills in the class attributes and hooks, and registers itself:

    @register_template("qwen2-vl")
    class Qwen2VLTemplate(Template): ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mmgrpo.errors import ConfigError, DataError

MEDIA_TAGS = {"<image>": "image", "<video>": "video", "<audio>": "audio"}
_TAG_RE = re.compile("(" + "|".join(re.escape(tag) for tag in MEDIA_TAGS) + ")")


@dataclass
class PromptInputs:
    """One encoded prompt: the training payload and the rollout payload.

    Training: `prompt_ids` (placeholders expanded) and `mm` (what the forward needs besides ids).
    Rollout: `prompt_text` (one placeholder per medium, unexpanded) and the decoded media.
    """

    id: str  # the sample id, for errors and logs
    prompt_ids: torch.Tensor  # [prompt_len] int64, placeholders expanded
    mm: dict[str, torch.Tensor]  # e.g. mm_token_type_ids [prompt_len], pixel_values [patches, dim],
    #                              image_grid_thw [images, 3], pixel_values_videos, video_grid_thw
    prompt_text: str  # rendered chat text, one placeholder per medium
    images: list = field(default_factory=list)  # PIL images, RGB, as given
    videos: list = field(default_factory=list)  # mmgrpo.data.schema.Video
    audios: list = field(default_factory=list)  # float32 mono arrays
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # original (width, height)
    input_sizes: list[tuple[int, int]] = field(default_factory=list)  # resized model input (width, height)


class Template:
    """Base class: rendering, encoding, collation and forward inputs for one model family.

    Subclasses set the class attributes and implement `render_part` and the hooks of the
    modalities they take (`process_images` + `expand_image`, `process_videos` + `expand_video` ...).
    """

    name: str = ""  # set by register_template
    modalities: tuple[str, ...] = ()  # media kinds the family takes: "image", "video", "audio"
    box_convention: str = ""  # "rel1000" (0-1000 of the image) or "abs_input" (pixels of the model input)
    components: dict[str, str] = {}  # module paths in the HF model: vision, aligner, llm, lm_head
    placeholder_tokens: dict[
        str, str
    ] = {}  # modality -> the token one medium renders to, e.g. "<|image_pad|>"
    mm_token_types: dict[str, int] = {}  # modality -> its value in mm_token_type_ids (text is 0)
    never_sample_tokens: tuple[str, ...] = ()  # special tokens a policy must never generate
    stop_tokens: tuple[str, ...] = ()  # tokens that end a completion (besides the tokenizer's eos)

    def __init__(self, processor, **kwargs: Any):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tokenizer.padding_side = "left"  # not saved with a tokenizer: set at run time
        if kwargs:
            raise ConfigError(f"template {self.name!r} got unknown option(s) {sorted(kwargs)}")
        self.pad_token_id = self.tokenizer.pad_token_id
        self.placeholder_ids = {m: self._token_id(t) for m, t in self.placeholder_tokens.items()}

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ConfigError(
                f"template {self.name!r}: the tokenizer has no {token} token; is --model_type right?"
            )
        return token_id

    # ----------------------------------------------------------------------------------------
    # Rendering
    # ----------------------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Chat text with ONE placeholder per medium (the rollout engine's prompt)."""
        raise NotImplementedError

    @staticmethod
    def content_parts(content) -> list[dict]:
        """Message content as typed parts: a string's <image>/<video>/<audio> tags become parts.

        >>> Template.content_parts("<image>What colour?")
        [{'type': 'image'}, {'type': 'text', 'text': 'What colour?'}]
        """
        if isinstance(content, str):
            pieces = _TAG_RE.split(content)
            return [
                {"type": MEDIA_TAGS[p]} if p in MEDIA_TAGS else {"type": "text", "text": p}
                for p in pieces
                if p
            ]
        return list(content)

    def count_media(self, messages: list[dict]) -> dict[str, int]:
        """How many media of each kind the messages refer to (tags or typed parts)."""
        counts = {"image": 0, "video": 0, "audio": 0}
        for message in messages:
            for part in self.content_parts(message["content"]):
                if part.get("type") in counts:
                    counts[part["type"]] += 1
        return counts

    def check_media(self, sample) -> None:
        """DataError (naming the sample) if tags and media disagree or a modality is not taken."""
        counts = self.count_media(sample.messages)
        for kind, n_tags in counts.items():
            n_media = len(getattr(sample, kind + "s"))
            if (n_tags or n_media) and kind not in self.modalities:
                raise DataError(
                    f"sample {sample.id}: has {kind} input, but template {self.name!r} takes only "
                    f"{', '.join(self.modalities) or 'text'}; pick a model that takes {kind} or drop the column"
                )
            if n_tags != n_media:
                raise DataError(
                    f"sample {sample.id}: the messages have {n_tags} <{kind}> tag(s) but the sample has "
                    f"{n_media} {kind}(s); put one <{kind}> tag where each {kind} goes"
                )

    # ----------------------------------------------------------------------------------------
    # Encoding
    # ----------------------------------------------------------------------------------------

    def encode_prompt(self, sample) -> PromptInputs:
        """Render, tokenize and expand placeholders; process pixels. `sample` is a LoadedSample."""
        self.check_media(sample)
        prompt_text = self.render(sample.messages, add_generation_prompt=True)
        ids = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        mm: dict[str, torch.Tensor] = {}
        expansions: dict[str, list[list[int]]] = {}
        input_sizes: list[tuple[int, int]] = []
        if sample.images:
            processed = self.process_images(sample.images)
            mm.update(processed)
            expansions["image"] = [self.expand_image(processed, i) for i in range(len(sample.images))]
            input_sizes = self.input_sizes(processed)
        if sample.videos:
            processed = self.process_videos(sample.videos)
            mm.update(processed)
            expansions["video"] = [self.expand_video(processed, i) for i in range(len(sample.videos))]
        if sample.audios:
            processed = self.process_audios(sample.audios)
            mm.update(processed)
            expansions["audio"] = [self.expand_audio(processed, i) for i in range(len(sample.audios))]
        prompt_ids = torch.tensor(self.expand_placeholders(ids, expansions), dtype=torch.long)  # [prompt_len]
        mm.update(self.token_type_inputs(prompt_ids))
        return PromptInputs(
            id=sample.id,
            prompt_ids=prompt_ids,
            mm=mm,
            prompt_text=prompt_text,
            images=list(sample.images),
            videos=list(sample.videos),
            audios=list(sample.audios),
            image_sizes=[tuple(image.size) for image in sample.images],
            input_sizes=input_sizes,
        )

    def expand_placeholders(self, ids: list[int], expansions: dict[str, list[list[int]]]) -> list[int]:
        """Replace the i-th placeholder id of each modality by `expansions[modality][i]`."""
        by_id = {self.placeholder_ids[m]: iter(expansions.get(m, [])) for m in self.placeholder_ids}
        out: list[int] = []
        for token_id in ids:
            if token_id in by_id:
                replacement = next(by_id[token_id], None)
                if replacement is None:
                    raise DataError(
                        f"more {self.tokenizer.convert_ids_to_tokens(token_id)} tokens than media in the prompt"
                    )
                out.extend(replacement)
            else:
                out.append(token_id)
        return out

    def token_type_inputs(self, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token modality ids the forward needs (`mm_token_type_ids`: 0 text, 1 image, 2 video, 3 audio)."""
        if not self.mm_token_types:
            return {}
        types = torch.zeros_like(prompt_ids)  # [prompt_len]
        for modality, type_id in self.mm_token_types.items():
            types[prompt_ids == self.placeholder_ids[modality]] = type_id
        return {"mm_token_type_ids": types}

    # Per-modality hooks: `process_*` runs the HF image/video/audio processor on a sample's media,
    # `expand_*` gives the token ids one placeholder becomes.
    def process_images(self, images: list) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expand_image(self, processed: dict, index: int) -> list[int]:
        raise NotImplementedError

    def input_sizes(self, processed: dict) -> list[tuple[int, int]]:
        raise NotImplementedError

    def process_videos(self, videos: list) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expand_video(self, processed: dict, index: int) -> list[int]:
        raise NotImplementedError

    def process_audios(self, audios: list) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expand_audio(self, processed: dict, index: int) -> list[int]:
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------
    # Batching
    # ----------------------------------------------------------------------------------------

    # Per-token tensors padded like input_ids; everything else in `mm` is concatenated on dim 0.
    token_keys: tuple[str, ...] = ("mm_token_type_ids",)

    def collate(self, prompts: list[PromptInputs]) -> dict[str, torch.Tensor]:
        """Left-padded batch for `model.generate(**batch)` and the forward.

        input_ids, attention_mask [batch, max_prompt_len]; per-token mm tensors padded with 0;
        media tensors (pixel_values, image_grid_thw ...) concatenated in prompt order.
        """
        max_len = max(len(p.prompt_ids) for p in prompts)
        input_ids = torch.full((len(prompts), max_len), self.pad_token_id, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros((len(prompts), max_len), dtype=torch.long)  # [B, L]
        batch: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in self.token_keys:
            if any(key in p.mm for p in prompts):
                batch[key] = torch.zeros((len(prompts), max_len), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            length = len(prompt.prompt_ids)
            input_ids[row, max_len - length :] = prompt.prompt_ids
            attention_mask[row, max_len - length :] = 1
            for key in self.token_keys:
                if key in prompt.mm:
                    batch[key][row, max_len - length :] = prompt.mm[key]
        media_keys = sorted({k for p in prompts for k in p.mm if k not in self.token_keys})
        for key in media_keys:
            batch[key] = torch.cat([p.mm[key] for p in prompts if key in p.mm], dim=0)
        return batch

    def media_per_row(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Split a collated batch's media tensors back into one dict per row."""
        raise NotImplementedError

    def forward_inputs(
        self,
        batch: dict[str, torch.Tensor],
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        model=None,
    ) -> dict[str, torch.Tensor]:
        """Inputs of a training forward over prompt + completion.

        batch: `collate` output for B prompts. completion_ids, completion_mask: [N, T] with
        N = B * G: the G completions of a prompt are contiguous (advantages depend on it), so each
        prompt row (and its media) is repeated G times. Per-token tensors get zeros over the
        completion. With `model`, `position_ids` [3, N, L + T] are added, computed by the model's
        own mRoPE index exactly as `generate` does (optional: without them the forward computes
        the same positions for media rows, and text-only rows differ only by a per-row shift,
        which RoPE ignores).
        """
        num_prompts = batch["input_ids"].shape[0]
        num_rows = completion_ids.shape[0]
        if num_rows % num_prompts:
            raise ValueError(f"{num_rows} completions are not a multiple of {num_prompts} prompts")
        group = num_rows // num_prompts
        if group > 1:
            batch = self.repeat_rows(batch, group)
        completion_mask = completion_mask.to(batch["attention_mask"].dtype)
        inputs = dict(batch)
        inputs["input_ids"] = torch.cat([batch["input_ids"], completion_ids], dim=1)  # [N, L + T]
        inputs["attention_mask"] = torch.cat([batch["attention_mask"], completion_mask], dim=1)  # [N, L + T]
        for key in self.token_keys:
            if key in batch:
                zeros = torch.zeros_like(completion_ids, dtype=batch[key].dtype)  # [N, T]
                inputs[key] = torch.cat([batch[key], zeros], dim=1)  # [N, L + T]
        if model is not None:
            inputs["position_ids"] = self.position_ids(model, inputs)
        return inputs

    def repeat_rows(self, batch: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
        """Each prompt row (and its media) repeated `group` times, copies contiguous."""
        out = {
            k: batch[k].repeat_interleave(group, dim=0)
            for k in ("input_ids", "attention_mask", *self.token_keys)
            if k in batch
        }
        rows = self.media_per_row(batch)
        for key in {k for row in rows for k in row}:
            out[key] = torch.cat([row[key] for row in rows for _ in range(group) if key in row], dim=0)
        return out

    def position_ids(self, model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Position ids [3, N, seq_len] for a forward, as `generate` computes them."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------
    # Boxes and generation
    # ----------------------------------------------------------------------------------------

    def box_to_image(self, box, image_size, input_size) -> list[float]:
        """A box [x1, y1, x2, y2] in the model's coordinates -> original-image pixels.

        image_size: original (width, height); input_size: resized model input (width, height).
        """
        sx, sy = self._box_scale(image_size, input_size)
        return [float(box[0]) * sx, float(box[1]) * sy, float(box[2]) * sx, float(box[3]) * sy]

    def box_from_image(self, box, image_size, input_size) -> list[float]:
        """A box in original-image pixels -> the model's coordinates (round before writing text)."""
        sx, sy = self._box_scale(image_size, input_size)
        return [float(box[0]) / sx, float(box[1]) / sy, float(box[2]) / sx, float(box[3]) / sy]

    def _box_scale(self, image_size, input_size) -> tuple[float, float]:
        """Pixels of the original image per model coordinate unit, along x and y."""
        width, height = image_size
        if self.box_convention == "rel1000":
            return width / 1000.0, height / 1000.0
        if self.box_convention == "abs_input":
            in_width, in_height = input_size
            return width / in_width, height / in_height
        raise NotImplementedError(f"box convention {self.box_convention!r}")

    def box_mapper(self, prompt: PromptInputs):
        """A callable `(box, image_index=0) -> box in original pixels` for one prompt's images.

        The engine hands one per completion to rewards as the `to_image_box` column.
        """

        def to_image_box(box, image_index: int = 0) -> list[float]:
            return self.box_to_image(box, prompt.image_sizes[image_index], prompt.input_sizes[image_index])

        return to_image_box

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a completion: pass with the eos id to generate."""
        return sorted({self._token_id(t) for t in self.stop_tokens})

    @property
    def suppress_token_ids(self) -> list[int]:
        """Ids a policy must never sample (placeholders, vision delimiters): pass to generate."""
        return sorted({self._token_id(t) for t in self.never_sample_tokens})


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_TEMPLATES: dict[str, type[Template]] = {}


def _normalise(name: str) -> str:
    """'qwen2_5_vl', 'Qwen2.5-VL' and 'qwen2-5-vl' name the same template."""
    return re.sub(r"[._\-]", "-", name.strip().lower())


def register_template(name: str):
    """Class decorator: register a Template under `name` (`--model_type`). Duplicates are an error."""

    def register(cls: type[Template]) -> type[Template]:
        key = _normalise(name)
        if key in _TEMPLATES:
            raise ConfigError(f"template {name!r} is already registered (by {_TEMPLATES[key].__name__})")
        cls.name = name
        _TEMPLATES[key] = cls
        return cls

    return register


def known_templates() -> list[str]:
    """Registered template names, sorted."""
    return sorted(cls.name for cls in _TEMPLATES.values())


def get_template(model_type: str, processor, **kwargs) -> Template:
    """The registered template for `model_type` ('qwen2-vl', 'qwen2_vl' ...), bound to `processor`.

    kwargs are the template's options, e.g. `min_pixels`, `max_pixels`, `video_max_pixels`.
    """
    key = _normalise(model_type)
    if key not in _TEMPLATES:
        raise ConfigError(
            f"unknown model_type {model_type!r}; known templates: {', '.join(known_templates())}"
        )
    return _TEMPLATES[key](processor, **kwargs)
