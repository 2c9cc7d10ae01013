"""Load a model and its processor from a folder, a hub id (looked up in the HF cache) or `tiny:<family>`.

Every command loads in the same order (training, evaluation, attention maps):

    path, processor, template = load_template("tiny:qwen2-vl", None, max_pixels=...)  # plugins -> model type
    model = load_model(path, template=template)          # -> processor -> template -> model

model = load_model("tiny:qwen2-vl")            # float32, eval mode (any family in docs/models.md)
processor = load_processor("tiny:qwen2-vl")    # tokenizer padding_side = "left"
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from mmgrpo.errors import CheckpointError, ConfigError
from mmgrpo.hub import hub_cache_dir, hub_offline
from mmgrpo.models.integrity import check_model_folder
from mmgrpo.models.tiny import built_model_family, resolve_model_path

logger = logging.getLogger("mmgrpo.models")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def checkpoint_path(name_or_path: str, needs: tuple[str, ...] = ("config.json",)) -> str:
    """A local folder holding one of `needs` (a hub id in the HF cache -> its snapshot folder), or a
    hub id not cached while online (transformers downloads it); else a ConfigError.

    `tiny:<family>` and `random:<size>` names are built first (mmgrpo/models/tiny.py, real_configs.py).
    """
    path = resolve_model_path(name_or_path)
    local = local_model_folder(path)
    if os.path.isdir(local):
        check_model_folder(local, weights="config.json" in needs)  # a truncated or corrupt file: one line naming it
        if not any(os.path.isfile(os.path.join(local, name)) for name in needs):
            raise ConfigError(f"model {name_or_path!r}: the folder {local} has no {' or '.join(needs)}")
        return local
    if not is_hub_id(path):
        raise ConfigError(
            f"model {name_or_path!r}: no checkpoint folder at {local}; give a folder saved with "
            "save_pretrained, or tiny:<family> for a tiny random model"
        )
    if hub_offline():
        raise ConfigError(not_cached_message(path))
    return path


def is_hub_id(path: str) -> bool:
    """`org/name` with no local folder of that spelling (a local folder always wins).

    >>> is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct"), is_hub_id("./runs/x"), is_hub_id("runs/a/b")
    (True, False, False)
    """
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path))


def hub_snapshot(repo_id: str) -> str | None:
    """The cached snapshot folder of a hub id's main revision (huggingface_hub's own lookup), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True)
    except (OSError, HFValidationError, ValueError):  # LocalEntryNotFoundError is an OSError
        return None


def local_model_folder(path: str) -> str:
    """The folder a resolved model name stands for: a hub id found in the HF cache -> its snapshot
    folder; anything else unchanged (user-expanded)."""
    if is_hub_id(path):
        snapshot = hub_snapshot(path)
        if snapshot:
            return snapshot
    return os.path.expanduser(path)


def not_cached_message(repo_id: str) -> str:
    """The one line for a hub id that cannot be fetched: where it was looked for, how to get it."""
    return (
        f"model {repo_id!r} is not downloaded: not in the HF cache ({hub_cache_dir()}) and HF_HUB_OFFLINE is set "
        f"or the hub is unreachable; download it with `hf download {repo_id}`"
    )


def hub_config_file(repo_id: str) -> str:
    """config.json of a hub id not in the cache, fetched (online); unreachable: the not-cached line."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, "config.json", cache_dir=hub_cache_dir())
    except Exception:  # offline, unreachable, no such repo: one line, no traceback
        raise ConfigError(not_cached_message(repo_id)) from None


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, *, template=None, **kwargs):
    """The model in eval mode, in the class the family's template names (`Template.model_class`:
    the Auto classes, or e.g. Qwen2.5-Omni's thinker from a full checkpoint), with the fusion
    modules a training checkpoint holds inserted (mmgrpo/fusion/)."""
    from transformers import AutoConfig

    from mmgrpo.fusion.attach import attach_saved_fusion
    from mmgrpo.templates import Template

    path = checkpoint_path(name_or_path)
    if kwargs.get("attn_implementation") == "sdpa":  # transformers' own default: sdpa wherever the model's classes
        del kwargs["attn_implementation"]  # implement it, eager in the parts that do not (Gemma 4's audio tower)
    saved = AutoConfig.from_pretrained(path)
    model_class, config, extra = (template or Template).model_class(saved)
    if config is not saved:  # the template loads part of the checkpoint (a sub-config)
        extra = {**extra, "config": config}
    try:
        model = model_class.from_pretrained(path, dtype=dtype, **extra, **kwargs).eval()
    except OSError as err:  # a file transformers looks for and cannot read: one line naming the folder
        raise CheckpointError(f"model {name_or_path!r}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    except ValueError as err:  # an attention kernel asked for that the model's classes do not implement
        if "attn_implementation" not in kwargs or ("attn" not in str(err) and "attention" not in str(err)):
            raise
        raise ConfigError(f"model {name_or_path!r} with --attn_implementation {kwargs.get('attn_implementation')}: "
                          f"{str(err).splitlines()[0]} Use sdpa or eager.") from None
    attach_saved_fusion(model, path, template)
    return model


# attention kernels that need a package beyond torch and transformers: (import name, pip name, what it runs on)
ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn", "NVIDIA GPUs of compute capability 8.0 and up"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (built from flash-attention's hopper/ folder)",
                          "Hopper GPUs (H100, H200)"),
}


def check_attention(attn_implementation: str, flag: str = "--attn_implementation") -> None:
    """ConfigError, before any model loads, for a kernel whose package is missing or that needs a GPU
    this machine has not: one line naming the package and what to use instead."""
    import importlib.util

    if attn_implementation not in ATTENTION_PACKAGES:
        return
    module, package, hardware = ATTENTION_PACKAGES[attn_implementation]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{flag} {attn_implementation} needs the {package} package, which is not installed here "
                          f"(it runs on {hardware}): install it, or use sdpa (the default).")
    if not torch.cuda.is_available():
        raise ConfigError(f"{flag} {attn_implementation} runs on {hardware} and this machine has no GPU: use sdpa (the default).")


def model_skeleton(path: str, template=None) -> torch.nn.Module:
    """The model's module tree with no weights (meta device): names and layer types only, for
    checks before the weights load."""
    from transformers import AutoConfig

    return skeleton_from_config(AutoConfig.from_pretrained(checkpoint_path(path)), template)


def skeleton_from_config(config, template=None) -> torch.nn.Module:
    """`model_skeleton` of a config object (`mmgrpo estimate` reads `random:` sizes without building them)."""
    from mmgrpo.templates import Template

    model_class, config, _ = (template or Template).model_class(config)
    with torch.device("meta"):  # Auto classes build from a config with from_config, model classes with _from_config
        return model_class.from_config(config) if hasattr(model_class, "from_config") else model_class._from_config(config)


def load_processor(name_or_path: str, **kwargs):
    """AutoProcessor (a tokenizer alone for a text model) with left padding for generation."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint_path(name_or_path, PROCESSOR_FILES), **kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "left"  # not saved with a tokenizer: set at run time
    return processor


RUN_INFO_FILE = "mmgrpo.json"  # written into every checkpoint: {"model_type": template name}


def saved_run_info(path: str) -> dict:
    """What a training run recorded in its checkpoint folder (`mmgrpo.json`: model_type, and template_plugin
    for a family from a plugin), or {}."""
    import json

    info = os.path.join(local_model_folder(str(path)), RUN_INFO_FILE)
    if not os.path.isfile(info):
        return {}
    try:
        return json.loads(open(info).read())
    except (OSError, ValueError):
        return {}


def saved_model_type(path: str) -> str | None:
    """The model type a training run recorded in its checkpoint folder, or None."""
    return saved_run_info(path).get("model_type")


def infer_model_type(model: str) -> str:
    """The template name of a checkpoint when --model_type is not given: `tiny:<family>` and
    `random:<size>` name their own, a training checkpoint's `mmgrpo.json` records it, else the `model_type` of its config.json
    picks the one template that declares it (`Template.hf_model_types`). None or several: a
    ConfigError listing the choices."""
    import json

    from mmgrpo.templates import Template, template_names, templates_for_hf_type
    from mmgrpo.templates.generic import AUTO, image_text_to_text_types

    if built_model_family(model):
        return built_model_family(model)
    recorded = saved_model_type(model)
    if recorded:
        return recorded
    path = resolve_model_path(model)
    folder = local_model_folder(path)
    if os.path.isdir(folder):  # a half-written checkpoint (no mmgrpo.json yet): name what is wrong first
        check_model_folder(folder)
        config_file = os.path.join(folder, "config.json")
    elif is_hub_id(path):  # not cached: offline, the not-cached line; online, its config.json alone
        if hub_offline():
            raise ConfigError(not_cached_message(path))
        config_file = hub_config_file(path)
    else:
        config_file = os.path.join(folder, "config.json")
    choices = ", ".join(template_names())
    if not os.path.isfile(config_file):
        raise ConfigError(
            f"--model {model}: no config.json to infer the model type from; give --model_type (one of {choices})."
        )
    try:
        hf_type = json.loads(open(config_file).read()).get("model_type")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: {config_file} is not readable JSON ({exc}); give --model_type.") from None
    matches = templates_for_hf_type(hf_type) if hf_type else []
    if len(matches) == 1:
        return matches[0]
    if not matches and hf_type in image_text_to_text_types():  # no template, but transformers' generic VLM class
        logger.warning(
            "--model %s: no template declares its model_type %r, an image-text-to-text model of transformers: "
            "--model_type auto (the generic path, docs/models.md); give --model_type to choose otherwise", model, hf_type,
        )
        return AUTO
    from mmgrpo.templates.base import TEMPLATES

    served = "; ".join(
        f"{name} ({', '.join(cls.__dict__.get('hf_model_types', ())) or 'declares none'})"
        for name, cls in TEMPLATES.items() if issubclass(cls, Template)
    )
    if matches:
        raise ConfigError(
            f"--model {model}: its config.json model_type {hf_type!r} is served by several templates "
            f"({', '.join(matches)}); choose one with --model_type."
        )
    raise ConfigError(
        f"--model {model}: its config.json model_type {hf_type!r} is not one a template declares nor an image-text-to-text "
        f"model of transformers (which --model_type auto serves); give --model_type (templates and the HF types they "
        f"serve: {served}), or add a template (docs/custom_template.md)."
    )


def load_template(
    model: str, model_type: str | None, *, template_plugin=(), min_pixels=None, max_pixels=None, **options
):
    """(checkpoint path, processor, template) of a model: template plugins imported, the model type
    resolved (given, or `infer_model_type`), the processor loaded with the pixel limits written
    into it (so a checkpoint saved from it resizes as training did), the template bound to it.

    options: the template's other options (video_fps, video_nframes, Qwen2.5-Omni's use_audio_in_video ...).
    """
    from mmgrpo.templates import get_template, load_template_plugin, template_names
    from mmgrpo.templates.base import template_class

    for spec in template_plugin:  # registers templates for model_type; a bad file fails before any model loads
        load_template_plugin(spec)
    recorded = saved_run_info(model).get("template_plugin")  # a checkpoint of a plugin's family remembers it
    if recorded and not template_plugin and not (model_type and model_type in template_names()):
        if "/" in recorded and not os.path.isfile(recorded):
            raise ConfigError(f"model {model!r} was trained with the template plugin {recorded}, which is not there "
                              "any more: give its new place with --template_plugin")
        load_template_plugin(recorded)
    model_type = model_type or infer_model_type(model)  # an explicit --model_type wins
    path = resolve_model_path(model)
    processor = load_processor(path)
    if max_pixels is None:
        max_pixels = bounded_max_pixels(processor, template_class(model_type).default_max_pixels)
    keep_pixel_limits(processor, min_pixels, max_pixels)
    template = get_template(model_type, processor, min_pixels=min_pixels, max_pixels=max_pixels, **options)
    if template.transformers_problem:
        raise ConfigError(f"--model_type {model_type}: {template.transformers_problem}. Install transformers 5.23 or "
                          "later (pip install -U 'transformers>=5.23') to train or evaluate it")
    template.bind_checkpoint(checkpoint_path(path))  # the generic path finds the model's parts
    return path, processor, template


def bounded_max_pixels(processor, default_max_pixels: int | None) -> int | None:
    """The family's `default_max_pixels` where the processor allows more (said in one line), else None."""
    size = getattr(getattr(processor, "image_processor", None), "size", None)
    try:
        longest_edge = size["longest_edge"]
    except (TypeError, KeyError):
        return None
    if default_max_pixels is None or longest_edge is None or longest_edge <= default_max_pixels:
        return None
    if os.environ.get("RANK", "0") == "0":  # one line for a launched run
        print(f"mmgrpo: images get at most {default_max_pixels:,} pixels (the processor allows {longest_edge:,}); "
              "--max_pixels sets another bound", file=sys.stderr)
    return default_max_pixels


def keep_pixel_limits(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Write --min_pixels/--max_pixels into the image processor, so checkpoints (and `mmgrpo eval`
    of them) resize images exactly as training did."""
    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "size", None)
    # transformers 5 holds `size` as a SizeDict, not a dict: read its edges by key either way
    try:
        shortest_edge, longest_edge = size["shortest_edge"], size["longest_edge"]
    except (TypeError, KeyError):
        return  # a family without pixel budgets (the template rejects the flags itself)
    if shortest_edge is None or longest_edge is None:
        return
    image_processor.size = {"shortest_edge": min_pixels or shortest_edge, "longest_edge": max_pixels or longest_edge}


def template_options(model_cfg) -> dict:
    """The template options the model flags give (`load_template`'s keywords)."""
    return dict(
        template_plugin=model_cfg.template_plugin, min_pixels=model_cfg.min_pixels, max_pixels=model_cfg.max_pixels,
        video_fps=model_cfg.video_fps, video_nframes=model_cfg.video_nframes,
        **({"use_audio_in_video": True} if model_cfg.use_audio_in_video else {}),  # qwen2.5-omni's option
    )
