"""The generic path (`--model_type auto`): any image-text-to-text model of transformers whose
processor has a chat template, with no template file.

    mmgrpo train --model HuggingFaceTB/SmolVLM-256M-Instruct --model_type auto --dataset ... --reward_funcs ...

Where a family's template (mmgrpo/templates/<family>.py) writes the chat format and each medium's
expansion itself, this one hands both to the model's own processor:

- `render`: `processor.apply_chat_template` on the messages as typed content parts
  ({"type": "image"}, {"type": "text", "text": ...}); the text keeps one placeholder per medium, as
  the chat template writes it (`<image>`, `[IMG]` ...), which is what a rollout engine takes.
- `encode_prompt`: `processor(text=[prompt_text], images=[images])` gives the
  expanded ids and every tensor the forward takes (pixel_values, image_sizes,
  pixel_attention_mask, spatial_shapes ...). The bos is not added twice: as the processor's own
  `apply_chat_template(tokenize=True)` does, special tokens are not added to a text that starts
  with the bos.
- `collate`: left padding; each media tensor is the prompts' tensors concatenated on dim 0 (zero
  padded where trailing shapes differ), which is how the processors batch them: per image
  (LLaVA-NeXT, Mistral3, LFM2-VL) or per row of images (Idefics3, SmolVLM), both read back by the
  forward in the order of the image tokens.
- the model's parts are found on it (`find_components`): the backbone at `base_model_prefix`, the
  LM head from `get_output_embeddings()`, the text decoder from `get_decoder()`, the vision tower
  from `get_encoder("image")` and the projector under one of its usual names; --vit_lr,
  --aligner_lr and --freeze_vit / --freeze_aligner are start-up errors where that part is not found.
- what ends a turn is read off the chat template (the special token it writes after an assistant
  turn); the processor's media tokens are never sampled.

What it does not do: boxes (no box convention: a box reward or metric is refused at start-up),
the fast paths (shared prefix, lean decode: always the naive forward), vLLM (its prompts are
not checked against the policy's), pixel budgets (the processor's saved settings apply), videos,
audio, and images returned by tools. Log-probs are the LM head over the backbone's last hidden state:
a model that changes its logits after the head otherwise than `final_logit_softcapping` (which is applied),
e.g. a logit scale, needs a template.
A template file adds golden prompt ids, the box convention, the fast paths and vLLM prompt parity
(docs/models.md, "The generic path"; docs/custom_template.md).
"""

from __future__ import annotations

import logging

import torch

from mmgrpo.errors import ConfigError, DataError
from mmgrpo.templates.base import TEMPLATES, Template, register_template

logger = logging.getLogger("mmgrpo.templates")

AUTO = "auto"  # the --model_type of the generic path
ALIGNER_NAMES = ("multi_modal_projector", "connector", "mm_projector", "projector", "merger", "aligner")
_ANSWER = "It is done"  # an assistant turn's text, to read what the chat template writes after it


def image_text_to_text_types() -> dict[str, str]:
    """{config model_type: model class name} of transformers' image-text-to-text Auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def served_families() -> str:
    """The families that exist, for errors: the templates by name, and what `auto` serves."""
    names = ", ".join(name for name in TEMPLATES.names() if name != AUTO)
    return (f"templates {names}; and --model_type auto for transformers' image-text-to-text models "
            "(AutoModelForImageTextToText) whose processor has a chat template")


def check_image_text_to_text(config) -> None:
    """ConfigError naming the class where a config is not one AutoModelForImageTextToText builds."""
    model_type = getattr(config, "model_type", None)
    if model_type not in image_text_to_text_types():
        raise ConfigError(
            f"--model_type auto: {type(config).__name__} (model_type {model_type!r}) is not an image-text-to-text "
            f"model of transformers, so the generic path cannot load it; the families that exist: {served_families()}. "
            "Add a template for it (docs/custom_template.md)."
        )


class ProcessorMedia:
    """One modality as the processor handles it: its placeholder and token, nothing to split.

    The processor expands and processes the medium itself (`GenericTemplate.encode_prompt`), so
    this hook has no `process`; its keys are empty because the generic collate concatenates what
    the processor gave (`GenericTemplate.media_per_row` says where that cannot be undone).
    """

    item_keys: tuple[str, ...] = ()
    patch_keys: tuple[str, ...] = ()
    row_keys: tuple[str, ...] = ()

    def __init__(self, modality: str, placeholder: str, token_id: int):
        self.modality, self.placeholder, self.token_id = modality, placeholder, token_id


def find_components(model) -> dict[str, str]:
    """Module paths of a transformers image-text-to-text model, from its standard accessors.

    backbone: the base model (`base_model_prefix`, returns last_hidden_state); lm_head:
    `get_output_embeddings()`; llm: `get_decoder()`; vision: `get_encoder("image")`; aligner: a
    child of the backbone under one of ALIGNER_NAMES. Parts not found are left out.
    """
    names = {id(module): name for name, module in model.named_modules()}

    def path(module) -> str | None:
        name = names.get(id(module)) if module is not None else None
        return name or None  # "" is the model itself: not a part

    backbone = getattr(model, model.base_model_prefix, None)
    components = {
        "backbone": path(backbone),
        "lm_head": path(model.get_output_embeddings()),
        "llm": path(model.get_decoder()),
        "vision": path(model.get_encoder(modality="image")),
    }
    if backbone is not None:
        for name in ALIGNER_NAMES:
            if isinstance(getattr(backbone, name, None), torch.nn.Module):
                components["aligner"] = path(getattr(backbone, name))
                break
    return {key: value for key, value in components.items() if value}


@register_template(AUTO)
class GenericTemplate(Template):
    """Any image-text-to-text model through its own processor and chat template (module docstring)."""

    hf_model_types = ()  # chosen for a checkpoint no template declares (mmgrpo/models/loading.py)
    box_convention = ""  # none: box rewards are refused at start-up (mmgrpo/training/startup_checks.py)
    components: dict[str, str] = {}  # found on the model when the checkpoint is known (`bind_checkpoint`)

    def __init__(self, processor, **kwargs):
        source = getattr(getattr(processor, "tokenizer", processor), "name_or_path", "") or "the model"
        if not getattr(processor, "chat_template", None):
            raise ConfigError(
                f"--model_type auto: the processor of {source} ({type(processor).__name__}) has no chat template, which "
                "the generic path renders prompts with; put the family's chat template in the model folder "
                "(chat_template.jinja), or write a template file for the family (docs/custom_template.md)."
            )
        if getattr(processor, "image_processor", None) is None:
            raise ConfigError(
                f"--model_type auto: the processor of {source} ({type(processor).__name__}) has no image processor; the generic path serves "
                "image-text-to-text models (a text-only model: --model_type qwen2 or a template file)."
            )
        for option in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
            if kwargs.get(option) is not None:
                raise ConfigError(
                    f"--{option}: the generic path (--model_type auto) resizes as the processor's saved settings say; "
                    "drop the flag, or change the processor's settings in the model folder."
                )
        super().__init__(processor, **kwargs)
        self.components = {}  # this instance's, from `bind_checkpoint`
        self.stop_tokens = self.find_stop_tokens()

    def build_media(self) -> dict:
        """Images only: how each processor takes sampled video frames differs (fps, metadata,
        frame sampling), which a template file settles; a video row is a DataError naming it."""
        return {"image": ProcessorMedia("image", *self.media_token("image"))}

    def media_token(self, modality: str) -> tuple[str, int]:
        """(placeholder text, its id) the processor expands for a modality: `processor.image_token` ..."""
        token = getattr(self.processor, f"{modality}_token", None)
        if not isinstance(token, str):
            token = getattr(token, "content", None)  # an AddedToken
        if not token:
            raise ConfigError(
                f"--model_type auto: {type(self.processor).__name__} names no {modality} token ({modality}_token); "
                "the generic path cannot tell where its media go: write a template file (docs/custom_template.md)."
            )
        return token, self.token_id(token)

    # ---- the model --------------------------------------------------------------------------

    @classmethod
    def model_class(cls, config):
        """AutoModelForImageTextToText for any class of its mapping; another class: a ConfigError naming it."""
        from transformers import AutoModelForImageTextToText

        check_image_text_to_text(config)
        return AutoModelForImageTextToText, config, {}

    def bind_checkpoint(self, path: str) -> None:
        """Find the model's parts on a weightless copy of it (meta device); one line says what the path does."""
        from transformers import AutoConfig, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(path)
        check_image_text_to_text(config)
        with torch.device("meta"):
            skeleton = AutoModelForImageTextToText.from_config(config)
        self.components = find_components(skeleton)
        if "backbone" not in self.components or "lm_head" not in self.components:
            raise ConfigError(
                f"--model_type auto: {type(skeleton).__name__} has no base model or no LM head where transformers "
                f"models keep them (found: {self.components}); write a template file (docs/custom_template.md)."
            )
        logger.warning(
            "--model_type auto: %s through %s's own chat template and processing; the naive paths only (no shared "
            "prefix, no lean decode), no box convention, no vLLM; parts: %s",
            type(skeleton).__name__, type(self.processor).__name__,
            ", ".join(f"{key}={value}" for key, value in sorted(self.components.items())),
        )

    # ---- rendering ----------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The processor's chat template on the messages as typed parts: one placeholder per medium."""
        conversation = [{**message, "content": self.content_parts(message["content"])} for message in messages]
        return self.processor.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def find_stop_tokens(self) -> tuple[str, ...]:
        """The special token the chat template writes right after an assistant turn's text (none: the eos alone)."""
        text = self.render(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANSWER}], add_generation_prompt=False
        )
        tail = text.rsplit(_ANSWER, 1)[-1] if _ANSWER in text else ""
        special = set(self.tokenizer.all_special_ids) | {
            i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special
        }
        for token_id in self.tokenizer(tail, add_special_tokens=False)["input_ids"][:2]:
            if token_id in special:
                return (self.tokenizer.convert_ids_to_tokens(token_id),)
        return ()

    @property
    def suppress_token_ids(self) -> list[int]:
        """The processor's own special tokens (`image_token`, `boi_token`, `image_break_token` ...), never sampled."""
        ids = set()
        for name in dir(self.processor):
            if not name.endswith("_token") or name.startswith("_"):
                continue
            value = getattr(self.processor, name, None)
            value = getattr(value, "content", value)
            if isinstance(value, str) and value in self.tokenizer.get_vocab():
                ids.add(self.tokenizer.convert_tokens_to_ids(value))
        return sorted(ids - set(self.eos_token_ids) - {self.tokenizer.pad_token_id})

    # ---- encoding -----------------------------------------------------------------------------

    def encode_prompt(self, sample):
        """Render with the chat template, then the processor on the text and the sample's media."""
        from mmgrpo.templates.base import PromptInputs

        self.check_media(sample)
        prompt_text = self.render(sample.messages, add_generation_prompt=True)
        try:
            out = self.process(prompt_text, list(sample.images))
        except (ValueError, TypeError, IndexError) as err:  # the processor's own complaint, with the sample named
            raise DataError(f"sample {sample.id}: {type(self.processor).__name__} failed: {err}") from None
        prompt_ids = out.pop("input_ids")[0]  # [prompt_len]
        out.pop("attention_mask", None)
        mm = {key: value[0] if key in self.token_keys else value for key, value in out.items()}
        return PromptInputs(
            id=sample.id,
            prompt_ids=prompt_ids,
            mm=mm,
            prompt_text=prompt_text,
            images=list(sample.images),
            videos=list(sample.videos),
            audios=list(sample.audios),
            image_sizes=[tuple(image.size) for image in sample.images],
            input_sizes=[tuple(image.size) for image in sample.images],  # no boxes here: the sizes are not read
            columns=dict(getattr(sample, "columns", {})),
        )

    def process(self, text: str, images: list) -> dict[str, torch.Tensor]:
        """The processor on one prompt: input_ids [1, L] and its media tensors (what `apply_chat_template` would give)."""
        kwargs = {}
        bos = self.tokenizer.bos_token
        if bos is not None and text.startswith(bos):  # the chat template wrote it: not again
            kwargs["add_special_tokens"] = False
        if images:
            kwargs["images"] = [images]
        out = self.processor(text=[text], return_tensors="pt", **kwargs)
        return {key: value for key, value in out.items() if isinstance(value, torch.Tensor)}

    def encode_media(self, sample) -> tuple[dict, dict, list]:
        """Media outside a prompt (a tool's images): not on the generic path."""
        if sample.images or sample.videos or sample.audios:
            raise DataError(
                "--model_type auto: a tool returned media, which the generic path cannot place after the prompt; "
                "write a template file for the family (docs/custom_template.md)"
            )
        return {}, {}, []

    # ---- batching -----------------------------------------------------------------------------

    @property
    def token_keys(self) -> tuple[str, ...]:
        """Per-token tensors a processor may return (left-padded, zeros over completions)."""
        return ("token_type_ids", "mm_token_type_ids")

    def token_type_inputs(self, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Types of sampled text: zeros (a completion holds no media on the generic path)."""
        return {key: torch.zeros_like(prompt_ids) for key in self.token_keys}

    def media_per_row(self, batch: dict) -> list[dict[str, torch.Tensor]]:
        """A batch's media per row: possible for one row (or no media) only, since the processors'
        tensors do not say which items are whose. The training forward repeats prompts before
        collating (mmgrpo/forward/policy.py), so it never needs this."""
        skip = {"input_ids", "attention_mask", *self.token_keys}
        media = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in skip}
        rows = batch["input_ids"].shape[0]
        if rows == 1:
            return [media]
        if not media:
            return [{} for _ in range(rows)]
        raise ConfigError(
            "--model_type auto cannot split a collated batch of several prompts with media back into rows; "
            "collate each prompt's copies instead (template.collate of the repeated prompts)"
        )

    def _box_scale(self, image_size, input_size) -> tuple[float, float]:
        raise ConfigError(
            "a reward or metric read a box, but the generic path (--model_type auto) has no box convention: it cannot "
            "map the model's boxes to image pixels; write a template file for the family that declares one "
            "(docs/custom_template.md) and pass it with --template_plugin"
        )

    def vllm_unsupported(self) -> str | None:
        return ("the generic path (--model_type auto) has no check that vLLM's prompts equal the policy's; "
                "write a template file for the family (docs/custom_template.md)")
