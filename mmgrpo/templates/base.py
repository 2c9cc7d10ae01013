"""What every model family's template does, and the template registry.

A template turns a `LoadedSample` into model inputs, the way the family's Hugging Face processor
would, but in steps a trainer can use separately:

    template = get_template("qwen2-vl", processor)
    text = template.render(sample.messages)          # ONE placeholder per image / video / audio
    prompt = template.encode_prompt(sample)          # PromptInputs: expanded ids + media tensors
    batch = template.collate([prompt, ...])          # left-padded, ready for model.generate(**batch)
    inputs = template.forward_inputs(batch, completion_ids, completion_mask, model=model)
    hidden = model.get_submodule(template.components["backbone"])(**inputs).last_hidden_state

A family is one small subclass in its own file: the chat format (`render`), one media hook per
modality it takes (`build_media`, see mmgrpo/templates/hooks.py), the per-token type ids and
positions its forward needs, its box convention and its module paths; then

    @register_template("qwen2-vl")
    class Qwen2VLTemplate(Template): ...

Placeholder expansion happens on token ids: the rendered text is tokenized once, then each
placeholder id is replaced by the ids the modality's hook returns. A family whose expansion
adds context-dependent text (Gemma3 wraps each image in "\\n\\n") sets `expand_in_text` and its
hooks return text, spliced in before tokenizing, exactly as the HF processor does. The rendered
text and the raw media also travel in `PromptInputs` so that a rollout engine (vLLM) can expand
them itself; tests check both give identical ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mmgrpo.errors import ConfigError, DataError
from mmgrpo.registry import Registry, describe

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
    #                              image_grid_thw [images, 3], input_features [clips, mel, frames] ...
    prompt_text: str  # rendered chat text, one placeholder per medium
    images: list = field(default_factory=list)  # PIL images, RGB, as given
    videos: list = field(default_factory=list)  # mmgrpo.data.sample.Video
    audios: list = field(default_factory=list)  # float32 mono arrays
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # original (width, height)
    input_sizes: list[tuple[int, int]] = field(default_factory=list)  # resized model input (width, height)
    columns: dict = field(default_factory=dict)  # the sample's dataset columns (what tools may read)


@dataclass(frozen=True)
class MediaOptions:
    """Options every template accepts (None: the processor's saved value).

    Options of a modality the family does not take are ignored, so one config serves all families.
    """

    min_pixels: int | None = None  # per image
    max_pixels: int | None = None
    video_min_pixels: int | None = None  # per frame (Qwen3-VL: per clip, its processor's budget)
    video_max_pixels: int | None = None
    video_fps: float | None = None  # frame sampling: read by the data loader that decodes videos
    video_nframes: int | None = None
    video_max_frames: int | None = None


BOX_CONVENTIONS = ("rel1000", "rel1", "abs_input", "")  # see Template._box_scale


class Template:
    """Base class: rendering, encoding, collation and forward inputs for one model family.

    Subclasses set the class attributes, implement `render` and `build_media` (one hook per
    modality they take), and `position_ids` when their positions are not plain 1-D ones.
    """

    name: str = ""  # set by register_template
    # the `model_type` values of the HF config.json this template serves: a checkpoint's own type
    # picks its template when --model_type is not given (mmgrpo/models/loading.py:infer_model_type)
    hf_model_types: tuple[str, ...] = ()
    box_convention: str = ""  # "rel1000" | "rel1" (fractions of the image) | "abs_input" | "" (no boxes)
    components: dict[str, str] = {}  # module paths: backbone, lm_head, and vision / audio / aligner / llm
    stop_tokens: tuple[str, ...] = ()  # tokens that end a completion (besides the tokenizer's eos)
    never_sample_tokens: tuple[str, ...] = ()  # special tokens a policy must never generate
    token_type_key: str | None = None  # per-token modality ids the forward needs: "mm_token_type_ids" ...
    token_types: dict[str, int] = {}  # modality -> its value under token_type_key (text is 0)
    expand_in_text = False  # hooks return text spliced in before tokenizing (see module docstring)
    # The text config's field whose cap the family's forward applies to its logits after the LM head
    # (cap * tanh(logits / cap): Gemma 2, Gemma 4, Gemma 3's text-only class); None: the forward applies
    # none whatever the config says (Gemma3ForConditionalGeneration). The chunked log-probs and the
    # shared-prefix sampler read the cap once through it (mmgrpo/forward/policy.py:final_logit_softcap).
    logit_softcap_field: str | None = "final_logit_softcapping"
    # What the fast paths may assume about the family's model (docs/speed.md). A template vouches
    # for these; nothing outside mmgrpo/templates/ inspects a model's family or class:
    # - shared_prefix: the backbone runs a prompt (its media included) once and the completions of
    #   its group from the recorded K/V (mmgrpo/forward/shared_prefix.py), positions from
    #   `prompt_positions`, the text decoder at components["llm"];
    # - sliding_window_layers: the decoder mixes full and sliding-window layers and takes a
    #   {layer type: mask} mapping (Gemma3); decoders with sliding layers otherwise run naive;
    # - linear_attention_layers: the decoder mixes full attention and linear-attention layers that
    #   keep their state in transformers' linear-attention cache layers (Qwen3.5's Gated DeltaNet):
    #   the prompt's convolution and recurrent state are shared as K/V are;
    # - lean_decode: every decoder layer's forward is RMSNorm -> q/k/v (+ per-head q/k RMSNorm) ->
    #   RoPE -> attention -> o_proj -> residual -> RMSNorm -> SwiGLU MLP -> residual, so rollouts may
    #   run it as the lean step (mmgrpo/rollout/lean_decode.py) on the layers' weights (hybrid
    #   decoders too: Gated DeltaNet layers in place of attention, gated attention);
    # - zero_centered_norm: the decoder's RMSNorms scale by 1 + weight, in fp32 (Qwen3.5), for the lean step.
    # The most pixels an image gets when --max_pixels is not given and the checkpoint's processor allows
    # more (Qwen2.5-VL's allows 12.8M: one photo becomes 16k visual tokens): None keeps the processor's.
    default_max_pixels: int | None = None
    shared_prefix: bool = False
    sliding_window_layers: bool = False
    linear_attention_layers: bool = False
    lean_decode: bool = False
    zero_centered_norm: bool = False
    # frame_local_tower: the vision tower takes (pixel rows, grid_thw) and its attention and positions
    # never cross a frame, so --sequence_parallel_size shards it by frames (forward/tower_split.py).
    frame_local_tower: bool = False
    # tile_local_tower: the vision tower takes pixel_values [tiles, C, H, W] and encodes each tile alone
    # (no attention across tiles), so --sequence_parallel_size shards it by tiles.
    tile_local_tower: bool = False
    # vLLM loads a family's weights by the names of its original Hugging Face checkpoints. Where
    # transformers names them otherwise (in memory, or in a folder it saved) and vLLM's model class
    # does not map them itself, these (regex, replacement) rules rename them, applied in order, for
    # the checkpoint vLLM starts from and for every weight sync (mmgrpo/rollout/vllm_weights.py).
    # A name already in the original layout must come out unchanged.
    vllm_weight_names: tuple[tuple[str, str], ...] = ()
    # vLLM loads the family's fused expert banks (`*.experts.gate_up_proj`, `*.experts.down_proj`) as
    # its published checkpoints store them, [experts, hidden, 2 x width] and [experts, width, hidden],
    # where transformers 5 holds and saves them with the last two dims swapped: each sync sends them
    # transposed, and a checkpoint transformers saved starts vLLM from a view with them transposed.
    vllm_expert_banks_transposed: bool = False
    # Where vLLM's own implementation of the family computes other log-probs than transformers (a
    # measured fact, with its figure): said in an error at start-up, as vLLM would sample from
    # another model than the policy. Checks of prompt ids and weight names turn it off.
    vllm_mismatch: str = ""
    # Why the installed transformers cannot run the policy's forward of this family (its modelling
    # code holds the parts elsewhere than the template's components say): a run stops at start-up
    # (`load_template`) instead of training on what a forward that skips a part computes.
    transformers_problem: str = ""
    # Keys vLLM's processor of the family reads from each video's metadata beyond transformers'
    # VideoMetadata fields (GLM-4V's: do_sample_frames), sent with every video to vLLM.
    vllm_video_metadata: dict = {}
    # The family's forward cannot take images and videos in one batch (GLM-V fills every <|image|>
    # token from the images): a training set with both is refused at start-up (build.check_modalities).
    separate_media_batches: bool = False

    def __init__(self, processor, **kwargs: Any):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tokenizer.padding_side = "left"  # not saved with a tokenizer: set at run time
        known = MediaOptions.__dataclass_fields__
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ConfigError(
                f"template {self.name!r} got unknown option(s) {unknown}; known: {', '.join(sorted(known))}"
            )
        self.options = MediaOptions(**kwargs)
        self.video_sampling = {
            "fps": self.options.video_fps,
            "nframes": self.options.video_nframes,
            "max_frames": self.options.video_max_frames,
        }
        self.pad_token_id = self.tokenizer.pad_token_id
        self.media = self.build_media()  # modality -> hook, in the order media are encoded
        self.placeholder_ids = {m: self.token_id(hook.placeholder) for m, hook in self.media.items()}

    def build_media(self) -> dict:
        """{modality: hook} for the modalities the family takes (see mmgrpo/templates/hooks.py)."""
        return {}

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.media)

    @property
    def sampling_rate(self) -> int | None:
        """Audio sampling rate the family's feature extractor expects (None without audio)."""
        audio = self.media.get("audio")
        return getattr(audio, "sampling_rate", None)

    @property
    def max_audio_samples(self) -> int | None:
        """The longest audio clip the family's encoder takes, in samples (None: any length)."""
        return getattr(self.media.get("audio"), "max_samples", None)

    def token_id(self, token: str) -> int:
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

    def render_tool_turn(self, results: list[list[dict]]) -> str:
        """The text between a model turn that called tools and the next model turn.

        results: one list of content parts per tool call ({"type": "text", "text": ...} or
        {"type": "image"}). The model's turn ended with its stop token (kept in the trajectory as
        sampled); this text is what `render` puts after that token: the tool messages (role
        "tool") and the opening of the next model turn, so that a trajectory built turn by turn
        has the ids a dataset row of the same conversation has. Derived from `render`; a family
        whose `render` has no tool role overrides this.
        """
        marker = "\x00end of the model turn\x00"
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
        messages += [{"role": "tool", "content": parts} for parts in results]
        tail = self.render(messages, add_generation_prompt=True).split(marker, 1)[1]
        for stop in self.stop_tokens:
            if tail.startswith(stop):
                return tail[len(stop):]
        raise ConfigError(
            f"template {self.name!r} cannot render tool results after a model turn (its assistant turn does not end "
            f"with one of its stop tokens {list(self.stop_tokens)}); override render_tool_turn"
        )

    @property
    def max_image_pixels(self) -> int | None:
        """The most pixels an image is resized to (`max_pixels`, or the processor's own), if the family has a budget."""
        size = getattr(self.media.get("image"), "size", None)
        if isinstance(size, dict) and size.get("longest_edge"):
            return int(size["longest_edge"])
        return None

    # ----------------------------------------------------------------------------------------
    # Encoding
    # ----------------------------------------------------------------------------------------

    def encode_prompt(self, sample) -> PromptInputs:
        """Render, tokenize and expand placeholders; process media. `sample` is a LoadedSample."""
        self.check_media(sample)
        try:
            prompt_text = self.render(sample.messages, add_generation_prompt=True)
        except DataError:
            raise
        except Exception as error:  # a plugin's template or a checkpoint's chat template: the cause, named
            raise DataError(f"sample {sample.id}: template {self.name!r} raised while rendering its messages "
                            f"({type(error).__name__}: {error}); fix the template's render (or its chat template)") from error
        mm, expansions, input_sizes = self.encode_media(sample)
        prompt_ids = self.tokenize_expanded(prompt_text, expansions)  # [prompt_len]
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
            columns=dict(getattr(sample, "columns", {})),
        )

    def tokenize_expanded(self, text: str, expansions: dict[str, list]) -> torch.Tensor:
        """Rendered text (one placeholder per medium) -> ids [len] with each placeholder expanded."""
        if self.expand_in_text:
            ids = self.tokenizer(self.expand_text(text, expansions), add_special_tokens=False)["input_ids"]
        else:
            ids = self.expand_placeholders(self.tokenizer(text, add_special_tokens=False)["input_ids"], expansions)
        return torch.tensor(ids, dtype=torch.long)

    def encode_media(self, sample) -> tuple[dict, dict, list]:
        """Each modality's hook on the sample's media: (tensors, expansions per modality, input sizes)."""
        mm: dict[str, torch.Tensor] = {}
        expansions: dict[str, list] = {}
        input_sizes: list[tuple[int, int]] = []
        for modality, hook in self.media.items():
            items = getattr(sample, modality + "s")
            if not items:
                continue
            try:
                tensors, expansions[modality] = hook.process(items)
            except DataError as err:  # the hook knows the medium, not the sample
                raise DataError(f"sample {sample.id}: {err}") from None
            mm.update(tensors)
            if modality == "image":
                input_sizes = hook.input_sizes(tensors)
        return mm, expansions, input_sizes

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

    def expand_text(self, text: str, expansions: dict[str, list[str]]) -> str:
        """Replace the i-th placeholder string of each modality by the text `expansions[modality][i]`."""
        by_placeholder = {self.media[m].placeholder: iter(expansions.get(m, [])) for m in self.media}
        pattern = "|".join(re.escape(p) for p in by_placeholder)

        def replace(match: re.Match) -> str:
            replacement = next(by_placeholder[match.group(0)], None)
            if replacement is None:
                raise DataError(f"more {match.group(0)} placeholders than media in the prompt")
            return replacement

        return re.sub(pattern, replace, text) if pattern else text

    def token_type_inputs(self, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token modality ids the forward needs (e.g. `mm_token_type_ids`: 0 text, 1 image, 2 video)."""
        if not self.token_type_key:
            return {}
        types = torch.zeros_like(prompt_ids)  # [prompt_len]
        for modality, type_id in self.token_types.items():
            if modality in self.media:
                types[prompt_ids == self.media[modality].token_id] = type_id
        return {self.token_type_key: types}

    def rollout_processor_kwargs(self) -> dict:
        """Keyword arguments for the family's HF processor that make an engine running it on
        `prompt_text` and the raw media (vLLM's `mm_processor_kwargs`) expand and resize exactly as
        `encode_prompt` does: each hook's `processor_kwargs`, and the batch flags."""
        kwargs: dict[str, Any] = {}
        for hook in self.media.values():
            if hasattr(hook, "processor_kwargs"):
                kwargs.update(hook.processor_kwargs())
        kwargs.update(self.batch_flags([]))
        return kwargs

    # ----------------------------------------------------------------------------------------
    # Batching
    # ----------------------------------------------------------------------------------------

    @property
    def token_keys(self) -> tuple[str, ...]:
        """Per-token tensors, padded like input_ids and extended with zeros over a completion."""
        return (self.token_type_key,) if self.token_type_key else ()

    @property
    def row_keys(self) -> tuple[str, ...]:
        """Tensors with one entry per prompt row (0 for a row without that medium)."""
        return tuple(key for hook in self.media.values() for key in hook.row_keys)

    def batch_flags(self, prompts: list[PromptInputs]) -> dict[str, Any]:
        """Non-tensor forward arguments that hold for the whole batch (Qwen2.5-Omni's use_audio_in_video)."""
        return {}

    def collate(self, prompts: list[PromptInputs]) -> dict[str, Any]:
        """Left-padded batch for `model.generate(**batch)` and the forward.

        input_ids, attention_mask [batch, max_prompt_len]; per-token tensors padded with 0;
        per-row tensors [batch]; media tensors (pixel_values, image_grid_thw ...) concatenated in
        prompt order (zero-padded where their trailing shapes differ, e.g. LLaVA-OneVision's tiles).
        """
        max_len = max(len(p.prompt_ids) for p in prompts)
        input_ids = torch.full((len(prompts), max_len), self.pad_token_id, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros((len(prompts), max_len), dtype=torch.long)  # [B, L]
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
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
        for key in self.row_keys:
            if any(key in p.mm for p in prompts):
                batch[key] = torch.cat(
                    [p.mm.get(key, torch.zeros(1, dtype=torch.long)) for p in prompts]
                )  # [B]
        skip = {*self.token_keys, *self.row_keys}
        media_keys = sorted({k for p in prompts for k in p.mm if k not in skip})
        for key in media_keys:
            batch[key] = cat_padded([p.mm[key] for p in prompts if key in p.mm])
        batch.update(self.batch_flags(prompts))
        return batch

    def media_per_row(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        """Split a collated batch's media tensors back into one dict per row.

        A row owns as many items of a modality as its placeholder tokens account for, in order.
        """
        input_ids = batch["input_ids"]
        rows: list[dict[str, torch.Tensor]] = [{} for _ in range(input_ids.shape[0])]
        for modality, hook in self.media.items():
            keys = [k for k in (*hook.item_keys, *hook.patch_keys) if k in batch]
            if not keys:
                continue
            item_tokens = hook.tokens_per_item(batch)
            patches = hook.patches_per_item(batch) if hook.patch_keys else [0] * len(item_tokens)
            patch_start = [0]
            for count in patches:
                patch_start.append(patch_start[-1] + int(count))
            row_tokens = (input_ids == hook.token_id).sum(dim=1).tolist()  # [B]
            item = 0
            for row, tokens_left in enumerate(row_tokens):
                first = item
                while tokens_left > 0:
                    if item >= len(item_tokens):
                        raise ValueError(
                            f"row {row} has more {modality} tokens than the batch has {modality}s"
                        )
                    tokens_left -= item_tokens[item]
                    item += 1
                if item == first:
                    continue
                for key in hook.item_keys:
                    if key in batch:
                        rows[row][key] = batch[key][first:item]
                for key in hook.patch_keys:
                    if key in batch:
                        rows[row][key] = batch[key][patch_start[first] : patch_start[item]]
        return rows

    def repeat_rows(self, batch: dict[str, Any], group: int) -> dict[str, Any]:
        """Each prompt row (and its media) repeated `group` times, copies contiguous."""
        out = {
            k: batch[k].repeat_interleave(group, dim=0)
            for k in ("input_ids", "attention_mask", *self.token_keys, *self.row_keys)
            if k in batch
        }
        rows = self.media_per_row(batch)
        for key in {k for row in rows for k in row}:
            out[key] = cat_padded([row[key] for row in rows for _ in range(group) if key in row])
        out.update({k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)})  # batch flags
        return out

    def forward_inputs(
        self,
        batch: dict[str, Any],
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        model=None,
    ) -> dict[str, Any]:
        """Inputs of a training forward over prompt + completion.

        batch: `collate` output for B prompts. completion_ids, completion_mask: [N, T] with
        N = B * G: the G completions of a prompt are contiguous (advantages depend on it), so each
        prompt row (and its media) is repeated G times. Per-token tensors get zeros over the
        completion, except on the media tokens of a multi-turn trajectory's tool turns (whose
        media the batch then carries after the prompt's: `templates/turns.py`). With `model`, `position_ids` are added exactly as `generate` computes them
        ([3, N, L + T] from the model's own mRoPE index for Qwen families; [N, L + T] from the
        attention mask otherwise). They are optional: without them the forward computes the
        same positions for media rows, and text-only rows differ only by a per-row shift,
        which RoPE ignores.
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
        # A sampled completion is text (placeholders are never sampled): its types are 0. A
        # multi-turn trajectory carries the media of tool turns: their tokens get their types.
        completion_types = self.token_type_inputs(completion_ids)  # {key: [N, T]}
        for key in self.token_keys:
            if key in batch or bool(completion_types[key].any()):
                prompt_types = batch.get(key)
                if prompt_types is None:
                    prompt_types = torch.zeros_like(batch["input_ids"])
                inputs[key] = torch.cat([prompt_types, completion_types[key].to(prompt_types.dtype)], dim=1)  # [N, L + T]
        if model is not None:
            inputs["position_ids"] = self.position_ids(model, inputs)
        return inputs

    def position_ids(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """Position ids for a forward, as `generate` computes them: [N, seq_len] 1-D positions here.

        Families with 3-D (mRoPE) positions override this with the model's own index. Every
        position the trainer computes comes from this one hook (`prompt_positions` too).
        """
        return positions_from_mask(inputs["attention_mask"])

    def prompt_positions(self, model, prompt_inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of a left-padded prompt batch and where text after it continues.

        Returns (positions, next_position): [B, P] and [B] for 1-D positions, [3, B, P] and [3, B]
        for mRoPE; completion token t of prompt b sits at `next_position[..., b] + t`. Computed by
        `position_ids` over the prompt with one text token appended, so it is right whatever the
        prompt ends with (an image's last positions run ahead of its token count under mRoPE).
        """
        attention_mask = prompt_inputs["attention_mask"]  # [B, P]
        if not bool(attention_mask[:, -1].all()):  # the prompt's last state must be its last column
            raise ValueError("the prompt batch must be left-padded (template.collate does this)")
        extended = dict(prompt_inputs)
        one = torch.ones_like(prompt_inputs["input_ids"][:, :1])  # [B, 1]: any text token
        extended["input_ids"] = torch.cat([prompt_inputs["input_ids"], one], dim=1)
        extended["attention_mask"] = torch.cat([attention_mask, one.to(attention_mask.dtype)], dim=1)
        for key in self.token_keys:
            types = prompt_inputs.get(key)
            if types is None:
                types = torch.zeros_like(prompt_inputs["input_ids"])
            extended[key] = torch.cat([types, torch.zeros_like(one).to(types.dtype)], dim=1)
        positions = self.position_ids(model, extended)  # [B, P + 1] or [3, B, P + 1]
        return positions[..., :-1], positions[..., -1]

    # ----------------------------------------------------------------------------------------
    # Loading
    # ----------------------------------------------------------------------------------------

    def bind_checkpoint(self, path: str) -> None:
        """Called with the checkpoint's folder once it is known (`load_template`): a template whose
        module paths depend on the model (the generic path, templates/generic.py) finds them here."""

    @classmethod
    def model_class(cls, config) -> tuple[type, Any, dict[str, Any]]:
        """(class, config, from_pretrained kwargs) that load this family's checkpoint for training.

        AutoModelForMultimodalLM for image / video / audio models (it covers
        AutoModelForImageTextToText and audio LMs), AutoModelForCausalLM for text models. A
        family whose checkpoints hold more than the part GRPO trains overrides this.
        """
        from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

        multimodal = type(config) in AutoModelForMultimodalLM._model_mapping
        return (AutoModelForMultimodalLM if multimodal else AutoModelForCausalLM), config, {}

    def vllm_config(self, config: dict) -> dict:
        """The config.json vLLM should load for a checkpoint of this family whose config.json is
        `config` (where vLLM registers the family under another architecture); default: `config`."""
        return config

    def vllm_unsupported(self) -> str | None:
        """Why vLLM cannot run this checkpoint of the family (said at start-up with --use_vllm), or None."""
        return None

    def vllm_prompt_problem(self, prompt: PromptInputs) -> str | None:
        """Why vLLM cannot take this prompt as the policy does (said in the error naming the sample), or None."""
        return None

    @classmethod
    def vllm_weight_name(cls, name: str) -> str:
        """A weight's name as vLLM loads it: `vllm_weight_names` applied in order.

        >>> class T(Template): vllm_weight_names = ((r"^model\\.language_model\\.", "language_model.model."),)
        >>> T.vllm_weight_name("model.language_model.norm.weight"), T.vllm_weight_name("lm_head.weight")
        ('language_model.model.norm.weight', 'lm_head.weight')
        """
        for pattern, replacement in cls.vllm_weight_names:
            name = re.sub(pattern, replacement, name)
        return name

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
        if self.box_convention == "rel1":
            return float(width), float(height)
        if self.box_convention == "abs_input":
            in_width, in_height = input_size
            return width / in_width, height / in_height
        raise ConfigError(
            f"template {self.name!r} has no box convention (it takes {', '.join(self.modalities) or 'text'}); "
            "box rewards need an image model"
        )

    def box_mapper(self, prompt: PromptInputs):
        """A callable `(box, image_index=0) -> box in original pixels` for one prompt's images.

        The engine hands one per completion to rewards as the `to_image_box` column.
        """

        def to_image_box(box, image_index: int = 0) -> list[float]:
            if image_index >= len(prompt.image_sizes):
                raise DataError(
                    f"sample {prompt.id}: a box refers to image {image_index}, but the prompt has "
                    f"{len(prompt.image_sizes)} image(s)"
                )
            return self.box_to_image(box, prompt.image_sizes[image_index], prompt.input_sizes[image_index])

        return to_image_box

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a completion: pass with the eos id to generate."""
        return sorted({self.token_id(t) for t in self.stop_tokens})

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a completion: the tokenizer's eos and the family's stop tokens."""
        return sorted(i for i in {self.tokenizer.eos_token_id, *self.stop_token_ids} if i is not None)

    @property
    def completion_pad_id(self) -> int:
        """The id after a completion's end (right padding of completion rows)."""
        return self.pad_token_id if self.pad_token_id is not None else self.eos_token_ids[0]

    def decode(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
        """Completion texts: the tokens up to EOS, special tokens dropped."""
        rows = completion_ids.masked_fill(completion_mask == 0, self.completion_pad_id).tolist()
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    @property
    def suppress_token_ids(self) -> list[int]:
        """Ids a policy must never sample (placeholders, media delimiters): pass to generate."""
        return sorted({self.token_id(t) for t in self.never_sample_tokens})


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """1-D positions of a left-padded batch as `generate` computes them: 0, 1, ... over the real
    tokens, 1 on padding. attention_mask [N, L] -> [N, L]."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate on dim 0, zero-padding trailing dims to the largest shape first.

    >>> cat_padded([torch.ones(1, 2), torch.ones(2, 3)]).tolist()
    [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    if len({tuple(t.shape[1:]) for t in tensors}) > 1:
        shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
        padded = []
        for t in tensors:
            out = t.new_zeros((t.shape[0], *shape))
            out[tuple(slice(0, n) for n in t.shape)] = t
            padded.append(out)
        tensors = padded
    return torch.cat(tensors, dim=0)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

def _normalise(name: str) -> str:
    """'qwen2_5_vl', 'Qwen2.5-VL' and 'qwen2-5-vl' name the same template."""
    return re.sub(r"[._\-]", "-", name.strip().lower())


TEMPLATES = Registry("model_type", flag="--model_type", normalise=_normalise)


def register_template(name: str):
    """Class decorator: register a Template under `name` (`--model_type`). Duplicates are an error."""

    def register(cls: type[Template]) -> type[Template]:
        convention = getattr(cls, "box_convention", None)
        if convention not in BOX_CONVENTIONS:  # checked here: a plugin's typo would mis-scale every box reward
            raise ConfigError(
                f"template {name!r} ({describe(cls)}) declares box_convention {convention!r}; give one of "
                + ", ".join(repr(c) for c in BOX_CONVENTIONS) + " ('' for a family that reads no boxes)"
            )
        TEMPLATES.register(name, cls)
        cls.name = name
        return cls

    return register


def template_names() -> list[str]:
    """Registered template names, sorted."""
    return TEMPLATES.names()


def templates_for_hf_type(hf_model_type: str) -> list[str]:
    """Names of the registered templates that declare `hf_model_type` in their `hf_model_types`.

    >>> templates_for_hf_type("qwen2_5_vl"), templates_for_hf_type("bert")
    (['qwen2.5-vl'], [])
    """
    return sorted(name for name, cls in TEMPLATES.items() if hf_model_type in cls.__dict__.get("hf_model_types", ()))


def template_class(model_type: str) -> type[Template]:
    """The registered template class of `model_type` (a ConfigError listing the known ones)."""
    return TEMPLATES.get(model_type, hint="A family of your own: --template_plugin (docs/custom_template.md).")


def get_template(model_type: str, processor, **kwargs) -> Template:
    """The registered template for `model_type` ('qwen2-vl', 'qwen2_vl' ...), bound to `processor`.

    kwargs are the template's options (see MediaOptions), e.g. `min_pixels`, `max_pixels`.
    """
    return template_class(model_type)(processor, **kwargs)
