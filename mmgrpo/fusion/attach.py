"""Fusion modules inserted after chosen decoder layers of a model, and their checkpoint files.

    fusion = attach_fusion(model, template, FusionSpec("gated_xattn", [1]), seed=0)
    logits = model(**batch).logits                    # the modules run after decoder layer 1
    with bypassed(model): ...                          # the base model (the reference of --train_type fusion)

The modules live in `model.fusion_modules` (a `Fusion`), so the optimizer, FSDP2, ZeRO-3 and
`state_dict` see their parameters like any other (named `fusion_modules.blocks.<layer>.*`); the
model's own modules and parameter names are untouched. Three forward hooks connect them:

    backbone (pre)     notes the call's input_ids and attention_mask: where the media tokens are
    text decoder (pre) a prompt's forward (no cache, or an empty one) takes the decoder's input at
                       the media tokens (the tower's output after the projector) as the memory
                       [rows, M, H]; a continuation (the shared prefix's completion forward, a
                       decode step) reads the memory of the prompt it continues
    each chosen layer  `prepare` once per prompt forward (e.g. keys and values of the features),
                       then the module's `forward` on the layer's output

A continuation with G rows per prompt folds each group into one row ([B * G, L, H] ->
[B, G * L, H]): the memory is computed and read once per group, never copied G times. Rows in
groups of unequal size say which prompt each row continues (`continuing_rows`, the shared-prefix
forward's micro-batches); the lean decode step (mmgrpo/rollout/lean_decode.py) calls `fuse`
itself. A naive forward over prompt + completion says where the prompt ends (`prompt_length`),
so co-attention's features read only the prompt's text, as in the shared-prefix forward.

A checkpoint holds the modules as `fusion_modules.safetensors` with `fusion_config.json`
(module name, layers, sizes, plugin files); `load_model` attaches them back (mmgrpo/models/loading.py).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from mmgrpo.config import ModelConfig
from mmgrpo.errors import CheckpointError, ConfigError
from mmgrpo.fusion.modules import get_fusion

FUSION_ATTR = "fusion_modules"  # the model's submodule; its parameters are named fusion_modules.*
CONFIG_FILE = "fusion_config.json"
WEIGHTS_FILE = "fusion_modules.safetensors"


@dataclass
class FusionSpec:
    """What a checkpoint's fusion_config.json holds (the sizes are filled in when attached)."""

    module: str
    layers: list[int]
    plugins: list[str] = field(default_factory=list)  # files / modules that register `module`
    hidden_size: int | None = None
    num_heads: int | None = None


def parse_layers(values, num_layers: int | None = None) -> list[int]:
    """--fusion_layers ("4,20", ["4", "20"] or [4, 20]) as sorted layer indices; empty -> the middle
    layer. With num_layers, an index outside the model is a ConfigError naming the valid range.

    >>> parse_layers(["4,20"]), parse_layers([]), parse_layers([], num_layers=28)
    ([4, 20], [], [14])
    """
    layers = []
    for value in values or []:
        for part in str(value).replace(",", " ").split():
            try:
                layers.append(int(part))
            except ValueError:
                raise ConfigError(f"--fusion_layers {part!r}: give decoder layer indices, e.g. --fusion_layers 4,20.") from None
    if num_layers is None:
        return sorted(set(layers))
    if not layers:
        return [num_layers // 2]
    outside = [i for i in layers if not 0 <= i < num_layers]
    if outside:
        raise ConfigError(
            f"--fusion_layers {','.join(map(str, outside))}: the model has {num_layers} decoder layers; "
            f"give indices from 0 to {num_layers - 1}."
        )
    return sorted(set(layers))


def decoder_layers(model: nn.Module, template) -> nn.ModuleList:
    decoder = model.get_submodule(template.components["llm"])
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(f"fusion modules: {template.components['llm']} has no decoder `layers` to insert them after.")
    return layers


class Fusion(nn.Module):
    """The modules after their layers, and what the hooks share during one model call."""

    def __init__(self, spec: FusionSpec, placeholder_ids: list[int]):
        super().__init__()
        factory = get_fusion(spec.module)
        self.spec = spec
        self.blocks = nn.ModuleDict(
            {str(i): factory(hidden_size=spec.hidden_size, num_heads=spec.num_heads, layer=i) for i in spec.layers}
        )
        self.placeholder_ids = list(placeholder_ids)
        self.enabled = True
        self.trained = False  # weights loaded from a checkpoint (not fresh gates at 0)
        self._checked_finite: set[int] = set()  # layers whose module's output was checked finite once
        self.reset()

    def reset(self) -> None:
        """Forget the last prompt (its memory) and the scopes."""
        self._pending = None  # (input_ids, attention_mask) of the backbone call under way
        self._memory = self._memory_mask = self._text_mask = None  # [B, M, H], [B, M], [B, L]
        self._prepared: dict[int, dict[str, torch.Tensor]] = {}  # layer -> the module's `prepare`
        self._active = self._fresh = False
        self._rows = None  # a continuation: None (row b is prompt b), ("group", G) or ("index", [n])
        self._continuing = None  # `continuing_rows`: the prompt of each row
        self._prompt_length = None  # `prompt_length`: where the prompt ends in a naive forward

    # ---- hooks ------------------------------------------------------------------------------

    def note_inputs(self, input_ids, attention_mask) -> None:
        self._pending = (input_ids, attention_mask)

    def begin(self, input_ids, inputs_embeds, attention_mask, cache) -> None:
        """The text decoder starts: a prompt's forward takes its memory, a continuation finds it."""
        self._active = self.enabled
        if not self._active:
            return
        source = inputs_embeds if inputs_embeds is not None else input_ids
        rows, length = source.shape[:2]
        if cache is not None and cache.get_seq_length() > 0:  # continuing earlier tokens of these prompts
            self.continue_rows(rows)
            return
        ids, mask = self._pending or (input_ids, attention_mask)  # the backbone's: where the media tokens are
        self._pending = None
        if inputs_embeds is None or ids is None or tuple(ids.shape) != (rows, length):  # text decoded alone: no media
            ids = torch.zeros(rows, length, dtype=torch.long, device=source.device)
        if not (torch.is_tensor(mask) and mask.dim() == 2 and mask.shape == ids.shape):
            mask = torch.ones_like(ids)
        media = torch.isin(ids, torch.tensor(self.placeholder_ids, device=ids.device)) & mask.bool()  # [B, L]
        if self._prompt_length is not None:  # a naive forward over prompt + completion: the prompt's part only
            media[:, self._prompt_length :] = False
        text = mask.bool() & ~media
        if self._prompt_length is not None:
            text[:, self._prompt_length :] = False
        counts = media.sum(1)  # [B]
        width = int(counts.max()) if rows else 0
        if width == 0:
            dtype = inputs_embeds.dtype if inputs_embeds is not None else next(self.parameters()).dtype
            self._memory = torch.zeros(rows, 0, self.spec.hidden_size, dtype=dtype, device=ids.device)  # [B, 0, H]
        else:  # the media positions of each row first, in order: [B, M]
            order = torch.argsort((~media).to(torch.int8), dim=1, stable=True)[:, :width]
            self._memory = inputs_embeds.gather(1, order[..., None].expand(-1, -1, inputs_embeds.shape[-1]))  # [B, M, H]
        self._memory_mask = torch.arange(width, device=ids.device)[None, :] < counts[:, None]  # [B, M]
        self._text_mask = text
        self._prepared, self._fresh, self._rows = {}, True, None

    def continue_rows(self, rows: int) -> None:
        """The call runs `rows` rows after their prompts' forward (a decode step, a completion)."""
        self._active, self._fresh = self.enabled, False
        if not self._active:
            return
        if self._memory_mask is None:
            raise RuntimeError("fusion modules: a forward continues prompts whose forward they never saw")
        prompts = self._memory_mask.shape[0]
        if self._continuing is not None:
            if len(self._continuing) != rows:
                raise RuntimeError(f"fusion modules: {rows} rows continue, but continuing_rows named {len(self._continuing)}")
            self._rows = ("index", self._continuing)
        elif rows == prompts:
            self._rows = None
        elif rows % prompts == 0:
            self._rows = ("group", rows // prompts)
        else:
            raise RuntimeError(f"fusion modules: {rows} rows continue {prompts} prompts; say which with continuing_rows")

    def after_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What follows decoder layer `layer` given its output hidden [rows, L, H]: the module placed
        there, while a call is under way with the modules enabled; else `hidden` unchanged. The one
        entry for the layer hooks and for decoders that run the layers themselves (rollout/lean_decode.py)."""
        if not self._active or str(layer) not in self.blocks:
            return hidden
        return self.fuse(layer, hidden)

    def fuse(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The module after `layer` on its output hidden [rows, L, H]."""
        module = self.blocks[str(layer)]
        if self._fresh:
            self._prepared[layer] = module.prepare(self._memory, self._memory_mask, hidden, self._text_mask)
        memory, mask = self._prepared[layer], self._memory_mask
        if self._rows is None:
            return self._checked(layer, hidden, module(hidden, memory, mask))
        kind, value = self._rows
        if kind == "group":  # [B * G, L, H] -> [B, G * L, H]: each group reads its prompt's memory once
            rows, length, width = hidden.shape
            prompts = mask.shape[0]
            folded_hidden = hidden.reshape(prompts, (rows // prompts) * length, width)
            folded = self._checked(layer, folded_hidden, module(folded_hidden, memory, mask))
            return folded.reshape(rows, length, width)
        memory = {key: tensor.index_select(0, value) for key, tensor in memory.items()}
        return self._checked(layer, hidden, module(hidden, memory, mask.index_select(0, value)))

    def _checked(self, layer: int, hidden: torch.Tensor, out) -> torch.Tensor:
        """The module's output, if it is a tensor of hidden's shape; its values are checked finite on its
        first call (a module that makes NaN does so at once; checking every call would sync the GPU at
        every layer). Otherwise a ConfigError naming the module, its layer and what it returned."""
        name = f"fusion module {self.spec.module!r} after decoder layer {layer}"
        if not isinstance(out, torch.Tensor) or out.shape != hidden.shape:
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(f"{name} returned {got} for hidden states of shape {list(hidden.shape)}; its forward "
                              "must return a tensor of the hidden states' shape [batch, length, hidden] (docs/fusion.md)")
        if layer not in self._checked_finite:
            if not bool(torch.isfinite(out).all()):
                raise ConfigError(f"{name} returned NaN or infinite values on its first call; check its forward "
                                  "(a division by zero, a log of 0, a mask that leaves a softmax nothing)")
            self._checked_finite.add(layer)
        return out

    def keep_prompts(self, prompts: torch.Tensor) -> None:
        """Only these prompts (indices into the current ones) decode on (a rollout dropping finished groups)."""
        if self._memory_mask is None:
            return
        self._memory_mask = self._memory_mask.index_select(0, prompts)
        self._prepared = {layer: {key: t.index_select(0, prompts) for key, t in memory.items()}
                          for layer, memory in self._prepared.items()}


class _BackboneHook:
    def __init__(self, fusion: Fusion):
        self.fusion = fusion

    def __call__(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.fusion.note_inputs(input_ids, kwargs.get("attention_mask"))


class _DecoderHook:
    def __init__(self, fusion: Fusion):
        self.fusion = fusion

    def __call__(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.fusion.begin(input_ids, kwargs.get("inputs_embeds"), kwargs.get("attention_mask"), kwargs.get("past_key_values"))


class _LayerHook:
    def __init__(self, fusion: Fusion, layer: int):
        self.fusion, self.layer = fusion, layer

    def __call__(self, module, args, output):
        if isinstance(output, tuple):
            return (self.fusion.after_layer(self.layer, output[0]), *output[1:])
        return self.fusion.after_layer(self.layer, output)


def attach_fusion(model: nn.Module, template, spec: FusionSpec, *, seed: int = 0) -> Fusion:
    """Insert the modules `spec` names after its layers; returns them (also `model.fusion_modules`).
    Fresh modules are initialised from `seed` (the same on every rank), on the model's device and dtype."""
    from mmgrpo.registry import import_plugin

    if fusion_of(model) is not None:
        raise ConfigError("the model already has fusion modules; a second set cannot be inserted.")
    for plugin in spec.plugins:
        import_plugin(plugin, "fusion plugin")
    layers = decoder_layers(model, template)
    spec.layers = parse_layers(spec.layers, len(layers))
    text_config = model.get_submodule(template.components["llm"]).config
    spec.hidden_size = spec.hidden_size or text_config.hidden_size
    spec.num_heads = spec.num_heads or text_config.num_attention_heads
    parameter = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fusion = Fusion(spec, list(template.placeholder_ids.values()))
    fusion.to(device=parameter.device, dtype=parameter.dtype if parameter.is_floating_point() else None)
    model.add_module(FUSION_ATTR, fusion)
    model.get_submodule(template.components["backbone"]).register_forward_pre_hook(_BackboneHook(fusion), with_kwargs=True)
    model.get_submodule(template.components["llm"]).register_forward_pre_hook(_DecoderHook(fusion), with_kwargs=True)
    for index in spec.layers:
        layers[index].register_forward_hook(_LayerHook(fusion, index))
    return fusion


def fusion_of(model: nn.Module) -> Fusion | None:
    """The model's fusion modules, or None."""
    return getattr(model, FUSION_ATTR, None) if isinstance(getattr(model, FUSION_ATTR, None), Fusion) else None


def decoder_fusion(decoder: nn.Module) -> Fusion | None:
    """The fusion modules whose hook sits on this text decoder (the lean decode step's way to them)."""
    for hook in decoder._forward_pre_hooks.values():
        if isinstance(hook, _DecoderHook):
            return hook.fusion
    return None


# ---- from the flags ---------------------------------------------------------------------------


def check_fusion_flags(model_cfg: ModelConfig) -> None:
    """The fusion flags, before any model loads: plugins imported, the module name registered, the
    layers readable (each rate's range and the rules between flags are mmgrpo/config's)."""
    from mmgrpo.registry import import_plugin

    for plugin in model_cfg.fusion_plugin:
        import_plugin(plugin, "fusion plugin")
    if model_cfg.fusion_module is not None:
        get_fusion(model_cfg.fusion_module)
    parse_layers(model_cfg.fusion_layers)


def check_fusion_model(model_cfg, optim_cfg, skeleton: nn.Module, template, model_path) -> None:
    """The checks that need the model's structure (a weightless skeleton) and its template: the
    layers inside the model, --vit_lr / --aligner_lr for a family that has that part, --train_type
    fusion with modules from the flags or from --model."""
    components = template.components
    for flag, parts, what in (("vit_lr", ("vision", "audio"), "vision (or audio) tower"), ("aligner_lr", ("aligner",), "aligner")):
        if getattr(optim_cfg, flag, None) is not None and not any(components.get(p) for p in parts):
            raise ConfigError(
                f"--{flag}: template {template.name!r} declares no {what} (its components: {', '.join(sorted(components))}); "
                f"drop --{flag}."
            )
    if model_cfg.fusion_module is not None:
        if not template.placeholder_ids:
            raise ConfigError(
                f"--fusion_module {model_cfg.fusion_module}: template {template.name!r} takes no image, video or audio, "
                "so there are no modality features to attend to; pick a multimodal family."
            )
        parse_layers(model_cfg.fusion_layers, len(decoder_layers(skeleton, template)))
    elif model_cfg.train_type == "fusion" and saved_spec(model_path) is None:
        raise ConfigError(
            "--train_type fusion trains fusion modules only: give --fusion_module (gated_xattn, coattn or a registered one), "
            "or a --model checkpoint that holds them."
        )


def fusion_for_training(model: nn.Module, template, model_cfg, *, seed: int) -> Fusion | None:
    """The modules a run trains: fresh ones as --fusion_module says, or the ones --model's checkpoint
    holds (load_model attached them). They train in every --train_type."""
    loaded = fusion_of(model)
    if model_cfg.fusion_module is not None:
        layers = parse_layers(model_cfg.fusion_layers, len(decoder_layers(model, template)))
        if loaded is not None:
            if (loaded.spec.module, loaded.spec.layers) != (model_cfg.fusion_module, layers):
                raise ConfigError(
                    f"--model {model_cfg.model} holds fusion modules {loaded.spec.module} after layers "
                    f"{','.join(map(str, loaded.spec.layers))}, not --fusion_module {model_cfg.fusion_module} after "
                    f"{','.join(map(str, layers))}: drop --fusion_module to continue training them, or start from the base model."
                )
        else:
            plugins = [os.path.realpath(p) if p.endswith(".py") or os.sep in p else p for p in model_cfg.fusion_plugin]
            loaded = attach_fusion(model, template, FusionSpec(model_cfg.fusion_module, layers, plugins), seed=seed)
    if loaded is not None:
        loaded.requires_grad_(True)
    return loaded


# ---- scopes -----------------------------------------------------------------------------------


@contextmanager
def bypassed(model: nn.Module):
    """The base model: every module skipped (the reference of --train_type fusion; exact, since an
    untrained gate adds exactly 0)."""
    fusion = fusion_of(model)
    if fusion is None:
        yield
        return
    was, fusion.enabled = fusion.enabled, False
    try:
        yield
    finally:
        fusion.enabled = was


def prompt_length(model: nn.Module, length: int):
    """A naive forward over prompt + completion: the prompt is its first `length` positions."""
    fusion = fusion_of(model)
    return _setting(fusion, "_prompt_length", length) if fusion is not None else nullcontext()


def continuing_rows(model: nn.Module, prompt_of_row: torch.Tensor):
    """The next continuation's row i continues prompt prompt_of_row[i] (groups of unequal size)."""
    fusion = fusion_of(model)
    return _setting(fusion, "_continuing", prompt_of_row) if fusion is not None else nullcontext()


@contextmanager
def _setting(fusion: Fusion, name: str, value):
    setattr(fusion, name, value)
    try:
        yield
    finally:
        setattr(fusion, name, None)


def keep_prompts(model: nn.Module, prompts: torch.Tensor) -> None:
    fusion = fusion_of(model)
    if fusion is not None:
        fusion.keep_prompts(prompts)


# ---- checkpoints ------------------------------------------------------------------------------


def split_fusion_state(state_dict: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(the model's own weights, the fusion modules' weights without the `fusion_modules.` prefix)."""
    prefix = FUSION_ATTR + "."
    own = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
    fusion = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    return own, fusion


def save_fusion(model: nn.Module, path, fusion_state: dict[str, torch.Tensor]) -> None:
    """fusion_modules.safetensors + fusion_config.json into checkpoint folder `path`."""
    from safetensors.torch import save_file

    fusion = fusion_of(model)
    path = Path(path)
    save_file({k: v.contiguous() for k, v in fusion_state.items()}, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(asdict(fusion.spec), indent=1) + "\n")


def saved_spec(path) -> FusionSpec | None:
    """The FusionSpec a checkpoint folder holds, or None."""
    file = Path(os.path.expanduser(str(path))) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        values = json.loads(file.read_text())
        return FusionSpec(**{k: values[k] for k in ("module", "layers", "plugins", "hidden_size", "num_heads") if k in values})
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{file} is unreadable ({err}); the checkpoint's fusion modules cannot be loaded.") from None


def load_fusion_weights(fusion: Fusion, path) -> None:
    from safetensors.torch import load_file

    file = Path(os.path.expanduser(str(path))) / WEIGHTS_FILE
    if not file.is_file():
        raise CheckpointError(f"{file.parent} has {CONFIG_FILE} but no {WEIGHTS_FILE}: the checkpoint is incomplete.")
    state = load_file(str(file))
    try:
        fusion.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{file}: does not fit the modules of {CONFIG_FILE} ({str(err).splitlines()[0]}).") from None
    fusion.trained = True


def attach_saved_fusion(model: nn.Module, path, template) -> Fusion | None:
    """The fusion modules of checkpoint folder `path`, inserted into `model` with their weights (None if it has none)."""
    spec = saved_spec(path)
    if spec is None:
        return None
    if template is None or not hasattr(template, "placeholder_ids"):
        raise ConfigError(f"{path} holds fusion modules: load it with its template (give --model_type).")
    fusion = attach_fusion(model, template, spec)
    load_fusion_weights(fusion, path)
    return fusion
