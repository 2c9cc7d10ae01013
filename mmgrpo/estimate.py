"""`mmgrpo estimate`: the memory one device needs for a GRPO run, by part, before any weight loads.

    mmgrpo estimate --model random:qwen2.5-vl-7b --parallel fsdp2 --world_size 8 --bf16 \\
        --gradient_checkpointing --num_generations 8 --per_device_train_batch_size 8 \\
        --max_completion_length 1024 --image_pixels 200704 --device_memory_gb 80

It takes `mmgrpo train`'s flags (parsed and checked by the same code, so a nonsense flag gives
train's error) and a few of its own: --world_size, --device_memory_gb, and the prompt's shape
(--image_pixels per image after resizing, --images_per_prompt, --prompt_text_tokens, and a video
clip: --video_seconds at train's --video_fps or --video_nframes, --video_pixels per frame). The model
may be a folder, a `tiny:` or a `random:` name (read from its config on the meta device: a
`random:qwen2.5-vl-7b` estimate builds nothing). It prints each part:

  weights       fp32 master weights (sharded over --world_size under fsdp2 / zero3)
  reference     the KL term's frozen copy (--beta > 0, full training; LoRA: the base itself)
  gradients     fp32, of what trains
  optimizer     AdamW's two fp32 moments (none on the device with --offload_optimizer)
  gathered      fsdp2 / zero3: the unsharded weights a forward holds (all of them for a rollout
                with --gather_for_generation)
  activations   what the largest training micro-batch saves for backward: decoder layers
                (prompt tokens once per prompt with the shared prefix, completion tokens per
                row, the rows' attention K/V; 1/N of each row's tokens per rank under
                --sequence_parallel_size N), the vision tower and merger where they train
                (1/N of the row's patches per rank for the Qwen-VL towers), bf16 weight copies under --bf16
  log-probs     the chunked LM head's [chunk, vocab] fp32 blocks (mmgrpo/grpo/logprobs.py)
  rollout       the K/V cache (each prompt once with the shared prefix), the prefill's largest
                intermediate, the decode step's logits
  vLLM          --use_vllm colocated: --vllm_gpu_memory_utilization of the device

and the peak (the larger of the training update and the rollout, each over what stays between
steps), whether it fits --device_memory_gb with 1 GiB + 5% kept for the CUDA context and the
allocator, and if not which parts dominate and the flags that would make it fit. It exits 0
either way: not fitting is an answer.

The activation coefficients (bytes saved per token per decoder layer, per patch per vision block)
were measured with `TrackedMemory` (mmgrpo/parallel/tracked_memory.py) on the Qwen2/Qwen2.5-VL
and Qwen3-VL layers in fp32 and under bf16 autocast, trainable and frozen; tests/test_estimate.py
checks the whole estimate against the measured peak of real GRPO steps within 15%
(`--measure` runs that check for any flags: two steps, the second's peak).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

from mmgrpo.errors import ConfigError

# torch and transformers load inside the functions: `mmgrpo estimate --help` answers at once

GB = 1e9
CUDA_RESERVE_BYTES, ALLOCATOR_SLACK = 2**30, 0.05  # context, cuBLAS workspace, NCCL; fragmentation

# Bytes saved for backward per token per decoder layer: coefficients of (h, q, i, kv, 1), where h is
# the hidden size, q = heads x head_dim, i the MLP width, kv = KV heads x head_dim. "train": the
# layer's weights train (or carry LoRA adapters); "frozen": they do not, but a gradient flows
# through to the vision tower. bf16: under autocast, plus the bf16 copies of the weights.
# Keyed by the layer's structure (read from the model, not its name): with per-head q/k norms or not.
DECODER_BYTES = {
    False: {("fp32", "train"): (32, 0, 16, 8, 8), ("fp32", "frozen"): (16, 0, 12, 8, 8),  # measured where q = h
            ("bf16", "train"): (30, 0, 8, 4, 8), ("bf16", "frozen"): (12, 0, 6, 4, 8)},
    True: {("fp32", "train"): (24, 16, 16, 16, 8), ("fp32", "frozen"): (8, 12, 12, 12, 8),
           ("bf16", "train"): (26, 10, 8, 10, 8), ("bf16", "frozen"): (8, 8, 6, 8, 8)},
}
# Bytes per patch per vision block, coefficients of (width, MLP width), by the block's MLP; and per
# patch for the patch embedding and merger (coefficients of width, plus the output width).
VISION_BYTES = {
    "gated": {"fp32": (52, 16), "bf16": (32, 8)},  # RMSNorm, gate/up/down MLP (and windows)
    "quick_gelu": {"fp32": (44, 12), "bf16": (22, 6)},  # LayerNorm, x * sigmoid(1.702 x) keeps both
    "gelu": {"fp32": (44, 8), "bf16": (22, 4)},  # LayerNorm, tanh GELU
}
MERGER_BYTES_PER_WIDTH = 22


@dataclass
class EstimateOptions:
    """What `mmgrpo estimate` takes beyond train's flags."""

    world_size: int = 1
    device_memory_gb: float = 80.0
    image_pixels: int | None = None  # per image after resizing; None: --max_pixels, else 448 x 448
    images_per_prompt: int = 1
    prompt_text_tokens: int = 64
    video_seconds: float = 0.0  # one clip per prompt this long, sampled at train's --video_fps (or --video_nframes)
    video_pixels: int | None = None  # per frame after resizing; None: 448 x 448


@dataclass
class ModelShape:
    """What the estimate needs of a model: sizes, parameter counts by part, what trains."""

    qk_norm: bool  # the decoder normalises queries and keys per head
    vision_mlp_kind: str  # a key of VISION_BYTES
    hidden: int
    q_dim: int
    intermediate: int
    kv_dim: int
    layers: int
    vocab: int
    vision_width: int = 0
    vision_mlp: int = 0
    vision_depth: int = 0
    vision_out: int = 0
    patch: int = 14
    merge: int = 2
    temporal_patch: int = 1  # video frames one patch covers (Qwen-VL: 2)
    tower_splits: bool = False  # under --sequence_parallel_size each rank's tower encodes 1/N of the frames (Qwen-VL)
    deepstack: int = 0
    params: dict[str, int] = field(default_factory=dict)  # total, vision, aligner, llm_layers, root, block, experts
    experts: int = 0  # mixture of experts: experts per sparse layer (0: a dense model)
    experts_per_token: int = 0  # the router's top-k
    trainable: int = 0  # parameters with a gradient (LoRA: the adapters)
    trains: set[str] = field(default_factory=set)  # parts that train: vision, aligner, llm
    lora_inputs: dict[str, int] = field(default_factory=dict)  # LoRA: in_features summed over each part's targets
    linear: dict[str, int] = field(default_factory=dict)  # weights of the linear layers per part (bf16 copies)


def model_config(model: str):
    """The model's transformers config: `random:` from its published numbers, anything else from its
    folder (a hub id from the HF cache)."""
    from mmgrpo.models.real_configs import RANDOM_PREFIX, parse_random_name, real_config

    if model.startswith(RANDOM_PREFIX):
        return real_config(*parse_random_name(model))
    from transformers import AutoConfig

    from mmgrpo.models.loading import checkpoint_path
    from mmgrpo.models.real_configs import REAL_SIZES

    try:
        path = checkpoint_path(model)
    except ConfigError as err:  # a hub id not downloaded: its published size needs no download
        size = next((size for size, real in REAL_SIZES.items() if real.published == model), None)
        if size is None:
            raise
        raise ConfigError(f"{err}; or estimate the same configuration without it: --model {RANDOM_PREFIX}{size}") from None
    return AutoConfig.from_pretrained(path)


@functools.lru_cache(maxsize=4)
def _skeleton(model: str, model_type: str | None):
    """(config, template class, meta-device model): built once per model, as advice re-estimates."""
    from mmgrpo.models.loading import infer_model_type, skeleton_from_config
    from mmgrpo.templates.base import TEMPLATES

    config = model_config(model)
    template_class = TEMPLATES.get(model_type or infer_model_type(model))
    return config, template_class, skeleton_from_config(config, template_class)


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def attention_widths(text) -> tuple[int, int]:
    """(q_dim, kv_dim) of a decoder layer: query heads x head_dim and KV heads x head_dim, averaged
    over the layers (rounded) where they differ, so that x layers they total the model's.

    Gemma 4's full-attention layers have wider heads (global_head_dim) and, on the larger models,
    other KV head counts: its config holds them per layer and raises on reading them globally
    (transformers' AmbiguousGlobalPerLayerAttributeError, a RuntimeError); they are read per layer then.
    """

    def widths(layer) -> tuple[int, int]:
        heads = layer.num_attention_heads
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
        return heads * head_dim, layer.num_key_value_heads * head_dim

    try:
        return widths(text)
    except RuntimeError:  # per-layer attributes
        per_layer = [widths(layer) for layer in text.per_layer_config]
    return tuple(round(sum(dims) / len(per_layer)) for dims in zip(*per_layer))


def model_shape(cfg) -> ModelShape:
    """Sizes and parameter counts from a weightless (meta device) model of `cfg.model.model`."""
    import torch

    from mmgrpo.models.train_type import lora_targets, part_of

    config, template_class, skeleton = _skeleton(cfg.model.model, cfg.model.model_type)
    skeleton.requires_grad_(True)  # `freeze` below marks what this configuration freezes
    components = template_class.components
    text = config.get_text_config()
    q_dim, kv_dim = attention_widths(text)
    first_layer = _submodule(skeleton, f"{components.get('llm')}.layers.0")
    experts, top_k = getattr(text, "num_experts", 0) or 0, getattr(text, "num_experts_per_tok", 0) or 0
    # A token's MLP activations: its k experts' widths (a dense model: the MLP's)
    intermediate = top_k * text.moe_intermediate_size if experts else text.intermediate_size
    shape = ModelShape(
        qk_norm=hasattr(getattr(first_layer, "self_attn", None), "q_norm"), vision_mlp_kind="gated",
        hidden=text.hidden_size, q_dim=q_dim, intermediate=intermediate,
        kv_dim=kv_dim, layers=text.num_hidden_layers, vocab=text.vocab_size,
        experts=experts, experts_per_token=top_k,
    )  # fmt: skip
    vision = getattr(config, "vision_config", None)
    if vision is not None and hasattr(vision, "depth"):  # a tower of blocks over merged patches
        width = getattr(vision, "embed_dim", None) or vision.hidden_size
        shape.vision_width, shape.vision_depth = width, vision.depth
        shape.vision_mlp = getattr(vision, "intermediate_size", None) or int(width * vision.mlp_ratio)
        shape.vision_out = getattr(vision, "out_hidden_size", None) or vision.hidden_size
        shape.patch, shape.merge = vision.patch_size, vision.spatial_merge_size
        shape.temporal_patch = getattr(vision, "temporal_patch_size", 1) or 1
        shape.tower_splits = template_class.frame_local_tower
        shape.deepstack = len(getattr(vision, "deepstack_visual_indexes", []) or [])
        mlp = getattr(_submodule(skeleton, f"{components.get('vision')}.blocks.0"), "mlp", None)
        if not hasattr(mlp, "gate_proj"):
            shape.vision_mlp_kind = "quick_gelu" if getattr(vision, "hidden_act", "") == "quick_gelu" else "gelu"
    params = {"total": 0, "vision": 0, "aligner": 0, "llm_layers": 0, "block": 0, "experts": 0}  # vision: the tower without its merger
    for name, param in skeleton.named_parameters():
        part = part_of(name, components)
        params["total"] += param.numel()
        if ".mlp.experts." in name and part == "llm":  # the routed experts' weights (MoE)
            params["experts"] += param.numel()
        if part in ("vision", "aligner"):
            params[part] += param.numel()
        if ".layers.0." in name and part == "llm":
            params["block"] += param.numel()
        if ".layers." in name and part == "llm":
            params["llm_layers"] += param.numel()
    # FSDP2's root unit: what is not a decoder layer or vision block (embeddings, head, final norm, merger)
    params["root"] = params["total"] - params["llm_layers"] - params["vision"]
    shape.params = params
    linear: dict[str, int] = {}
    for name, module in skeleton.named_modules():
        if isinstance(module, torch.nn.Linear) and name != components.get("lm_head"):
            part = part_of(name, components)
            linear[part] = linear.get(part, 0) + module.weight.numel()
    shape.linear = linear
    model_cfg = cfg.model
    if model_cfg.train_type == "lora":
        modules = dict(skeleton.named_modules())
        targets = lora_targets(skeleton, components, model_cfg)
        shape.trainable = sum(model_cfg.lora_rank * (modules[t].in_features + modules[t].out_features) for t in targets)
        shape.trains = {part_of(t, components) for t in targets}
        for target in targets:
            part = part_of(target, components)
            shape.lora_inputs[part] = shape.lora_inputs.get(part, 0) + modules[target].in_features
    else:
        from mmgrpo.models.train_type import freeze

        shape.trainable = freeze(skeleton, components, model_cfg)
        shape.trains = {part_of(n, components) for n, p in skeleton.named_parameters() if p.requires_grad} - {None}
    return shape


def active_parameters(shape: ModelShape) -> int:
    """Parameters one token runs through: all but the experts its router did not pick (a dense
    model: all of them). Qwen3-VL-30B-A3B: 31.07B in total, 3.89B active (k = 8 of 128 experts; 3.35B
    of them in the language model, its "A3B").

    >>> active_parameters(ModelShape(False, "gated", 8, 8, 8, 8, 1, 8, params={"total": 100, "experts": 64},
    ...                              experts=8, experts_per_token=2))
    52
    """
    experts = shape.params.get("experts", 0)
    if not shape.experts:
        return shape.params["total"]
    return shape.params["total"] - experts + experts * shape.experts_per_token // shape.experts


def moe_notes(cfg, shape: ModelShape, shard: int) -> list[str]:
    """A mixture of experts: total against active parameters, and the expert weights each device holds."""
    if not shape.experts:
        return []
    experts = shape.params["experts"]
    where = (f"sharded over {shard} devices by {cfg.dist.strategy}" if shard > 1
             else "every expert on every device (no expert parallelism here: docs/distributed.md)")
    return [f"mixture of experts: {shape.params['total'] / 1e9:.2f}B parameters, {active_parameters(shape) / 1e9:.2f}B active "
            f"per token ({shape.experts_per_token} of {shape.experts} experts); expert weights {experts / 1e9:.2f}B = "
            f"{4 * experts / shard / GB:.1f} GB fp32 per device, {where}"]


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    parts: dict[str, float]  # bytes on the device, by part (the larger phase's share for phase parts)
    phases: dict[str, float]  # bytes at each phase's peak
    notes: list[str]
    device_bytes: float
    reserve_bytes: float

    @property
    def peak_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def needed_bytes(self) -> float:
        return self.peak_bytes + self.reserve_bytes + self.parts.get("vLLM (colocated)", 0.0)

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.device_bytes


def prompt_tokens(cfg, options: EstimateOptions, shape: ModelShape) -> tuple[int, int]:
    """(prompt tokens, vision patches) of one prompt: its text, images and video clip."""
    pixels = options.image_pixels or cfg.model.max_pixels or 448 * 448
    patches = pixels // shape.patch**2 if shape.vision_depth else 0
    video = clip_patches(cfg, options, shape)
    tokens = options.prompt_text_tokens + (options.images_per_prompt * patches + video) // shape.merge**2
    return tokens, options.images_per_prompt * patches + video


def clip_patches(cfg, options: EstimateOptions, shape: ModelShape) -> int:
    """The vision tower's patches of the prompt's video clip: its frames (--video_nframes, else
    --video_seconds x --video_fps), in patches of `temporal_patch` frames, each frame --video_pixels.

    A 2-minute clip at 2 fps and 448 x 448 on Qwen2.5-VL (14-px patches of 2 frames, 2 x 2 merged):
    240 frames -> 120 x 1024 = 122,880 patches, 30,720 prompt tokens.
    """
    if not shape.vision_depth or not (options.video_seconds or cfg.model.video_nframes):
        return 0
    frames = cfg.model.video_nframes or max(1, round(options.video_seconds * cfg.model.video_fps))
    pixels = options.video_pixels or 448 * 448
    return math.ceil(frames / shape.temporal_patch) * (pixels // shape.patch**2)


@dataclass
class StepBatch:
    """A step's completions (rows) on one device, and the micro-batches they train in."""

    prompt_tokens: int  # L, of one prompt
    patches: int  # vision patches of one prompt
    step_rows: int  # completions a step
    step_prompts: int
    rows: int  # completions of a micro-batch
    micro_batches: int
    prompts: int  # prompt sequences a micro-batch runs: one per prompt with the shared prefix, else one per row


def shares_prefix(cfg) -> bool:
    """The log-prob forwards run each prompt once per group: --shared_prefix (under sequence parallelism
    too: the prompts are split, each rank keeps its heads' share of their K/V)."""
    return cfg.model.shared_prefix


def rollout_prefills_once(cfg) -> bool:
    """The rollout prefills each prompt once for its G samples (the shared-prefix engine), also under
    sequence parallelism (it samples whole rows); on a sharded model only with --gather_for_generation
    (and a family whose decode steps run lean, which the estimate takes for granted)."""
    return cfg.model.shared_prefix and (cfg.dist.strategy not in ("fsdp2", "zero3") or cfg.dist.gather_for_generation)


def step_batch(cfg, options: EstimateOptions, shape: ModelShape) -> StepBatch:
    """The step's rows and micro-batches: per_device_train_batch_size rows each, or prompt groups
    packed under --max_tokens_per_microbatch."""
    G, T = cfg.rollout.num_generations, cfg.rollout.max_completion_length
    L, patches = prompt_tokens(cfg, options, shape)
    step_rows = cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps
    step_prompts = max(1, step_rows // G)
    shared = shares_prefix(cfg)
    if cfg.algo.max_tokens_per_microbatch:
        group_tokens = (L + G * T) if shared else G * (L + T)
        rows = min(step_prompts, max(1, cfg.algo.max_tokens_per_microbatch // group_tokens)) * G
    else:
        rows = cfg.optim.per_device_train_batch_size
    prompts = math.ceil(rows / G) if shared else rows
    return StepBatch(L, patches, step_rows, step_prompts, rows, math.ceil(step_rows / rows), prompts)


def state_bytes(cfg, shape: ModelShape, shard: int, sharded: bool) -> dict[str, float]:
    """What stays on the device between steps: weights, the reference copy, gradients, AdamW's moments."""
    bf16 = cfg.bf16
    total, trainable = shape.params["total"], shape.trainable
    lora = cfg.model.train_type == "lora"
    param_offload = cfg.dist.offload_param
    optim_offload = cfg.dist.offload_optimizer or (param_offload and cfg.dist.strategy == "fsdp2")
    parts: dict[str, float] = {}
    parts["weights"] = 0.0 if param_offload else 4 * (total + (trainable if lora else 0)) / shard
    if cfg.algo.beta > 0 and not lora:
        parts["reference"] = (2 if bf16 else 4) * total / shard if (sharded or bf16) else 4 * trainable
    parts["gradients"] = 4 * trainable / shard
    parts["optimizer"] = 0.0 if optim_offload else 8 * trainable / shard
    return parts


def activation_bytes(cfg, shape: ModelShape, batch: StepBatch, shard: int) -> float:
    """What one micro-batch's forward saves for backward: decoder layers, the vision tower and
    merger where they train, autocast's bf16 weight copies."""
    # fp16 autocast saves what bf16 autocast does (2-byte activations, half-precision weight copies)
    precision, act_bytes = ("bf16", 2) if cfg.precision != "fp32" else ("fp32", 4)
    lora = cfg.model.train_type == "lora"
    L, T, rows, prompts = batch.prompt_tokens, cfg.rollout.max_completion_length, batch.rows, batch.prompts
    shared = shares_prefix(cfg)
    split = cfg.dist.sequence_parallel_size  # each rank's decoder holds 1/N of every row's tokens
    h, q, i, kv, layers = shape.hidden, shape.q_dim, shape.intermediate, shape.kv_dim, shape.layers
    mode = "train" if "llm" in shape.trains else "frozen"
    coef = DECODER_BYTES[shape.qk_norm][(precision, mode)]
    per_token = coef[0] * h + coef[1] * q + coef[2] * i + coef[3] * kv + coef[4]
    tokens = math.ceil((prompts * L + rows * T) / split)
    # each row's K/V: its prompt's, expanded, + its own (under the split, of the rank's 1/N of the heads)
    kv_rows = 2 * rows * (L + T) * kv * act_bytes / split if shared else 0
    dropout = lora and cfg.model.lora_dropout > 0  # each adapter keeps its dropped-out input and mask
    if dropout:
        per_token += shape.lora_inputs.get("llm", 0) / layers * (act_bytes + 1)
    checkpointing = cfg.model.gradient_checkpointing
    layer = tokens * per_token + kv_rows  # one decoder layer's saved tensors
    decoder = tokens * 3 * 4 * h  # embeddings, final norm
    decoder += layers * tokens * 4 * h if checkpointing else layers * layer  # checkpointing: each layer's input only
    vision_act = block = 0.0
    mb_patches = prompts * batch.patches
    if shape.tower_splits:  # each rank's tower encodes its 1/N of the images and frames (sequence_parallel.py)
        mb_patches = math.ceil(mb_patches / split)
    if shape.vision_depth and ("vision" in shape.trains or "aligner" in shape.trains):
        merger = (1 + shape.deepstack) * mb_patches * (MERGER_BYTES_PER_WIDTH * shape.vision_width + shape.vision_out) * act_bytes / 4
        vision_act = merger
        if "vision" in shape.trains:
            w_coef, mlp_coef = VISION_BYTES[shape.vision_mlp_kind][precision]
            block = mb_patches * (w_coef * shape.vision_width + mlp_coef * shape.vision_mlp
                                  + (shape.lora_inputs.get("vision", 0) / shape.vision_depth * (act_bytes + 1) if dropout else 0))
            vision_act += shape.vision_depth * (mb_patches * 4 * shape.vision_width if checkpointing else block)
    if checkpointing:  # backward recomputes one layer (or vision block) at a time
        decoder += max(layer, block)
    copies = 0.0
    if cfg.precision != "fp32":  # autocast's half-precision copy of each linear weight on the gradient's path
        on_path = shape.linear.get("llm", 0) * (1 / layers if checkpointing else 1)
        on_path += shape.linear.get("aligner", 0) if shape.trains & {"vision", "aligner"} else 0
        on_path += shape.linear.get("vision", 0) if "vision" in shape.trains else 0
        copies = 2 * on_path / shard
    return decoder + vision_act + copies


def rollout_bytes(cfg, options: EstimateOptions, shape: ModelShape, batch: StepBatch) -> dict[str, float]:
    """The rollout of the step's prompts at once, gradients freed: the K/V cache, the prefill's
    largest intermediate and the decode step's logits; with --use_vllm colocated, vLLM's share instead."""
    parts: dict[str, float] = {}
    if cfg.rollout.use_vllm:
        parts["rollout"] = 0.0
        if cfg.rollout.vllm_mode == "colocate":
            parts["vLLM (colocated)"] = cfg.rollout.vllm_gpu_memory_utilization * options.device_memory_gb * GB
        return parts
    kv_bytes = act_bytes = 2 if cfg.precision != "fp32" else 4
    L, T, patches = batch.prompt_tokens, cfg.rollout.max_completion_length, batch.patches
    step_rows, step_prompts = batch.step_rows, batch.step_prompts
    h, i, kv, layers = shape.hidden, shape.intermediate, shape.kv_dim, shape.layers
    shared = rollout_prefills_once(cfg)
    cached = (step_prompts * L + step_rows * T) if shared else step_rows * (L + T)
    kv_cache = layers * 2 * kv * cached * kv_bytes
    prefill_tokens = step_prompts * L if shared else step_rows * L
    prefill = max(prefill_tokens * (3 * i + 4 * h), step_prompts * patches * (3 * shape.vision_mlp + 4 * shape.vision_width))
    parts["rollout"] = kv_cache + prefill * act_bytes + 3 * step_rows * shape.vocab * 4
    return parts


def phase_peaks(cfg, shape: ModelShape, parts: dict[str, float], micro_batches: int, shard: int,
                gathered_train: float, gathered_rollout: float) -> dict[str, float]:
    """Bytes at the peak of the training update and of the rollout, each over what stays between steps."""
    static = parts["weights"] + parts.get("reference", 0.0) + parts["optimizer"]
    work = parts["activations"] + parts["log-probs"]
    if micro_batches > 1:  # gradients of the first micro-batches are kept while the next ones run
        update = static + parts["gradients"] + work
    else:  # the LM head's gradient comes first in backward; the layers' as their activations free
        lora = cfg.model.train_type == "lora"
        head = 4 * shape.vocab * shape.hidden if "llm" in shape.trains and not lora else 0.0
        update = static + max(work + head / shard, parts["gradients"] + parts["log-probs"])
    return {"update": update + gathered_train, "rollout": static + parts["rollout"] + gathered_rollout}


def estimate(cfg, options: EstimateOptions, shape: ModelShape | None = None) -> Estimate:
    """Per-device memory of the run `cfg` describes (module docstring)."""
    from mmgrpo.grpo.logprobs import logits_chunk_rows

    shape = shape or model_shape(cfg)
    notes: list[str] = []
    sharded = cfg.dist.strategy in ("fsdp2", "zero3")
    shard = options.world_size if sharded else 1
    parts = state_bytes(cfg, shape, shard, sharded)
    batch = step_batch(cfg, options, shape)
    L, T = batch.prompt_tokens, cfg.rollout.max_completion_length
    if L > cfg.data.max_prompt_length:
        notes.append(f"a prompt of {L} tokens is over --max_prompt_length {cfg.data.max_prompt_length}: train would stop")
    parts["activations"] = activation_bytes(cfg, shape, batch, shard)
    completion_tokens = math.ceil(batch.rows * T / cfg.dist.sequence_parallel_size)  # a rank scores its slice's
    parts["log-probs"] = 3 * min(logits_chunk_rows(shape.vocab), completion_tokens) * shape.vocab * 4
    parts.update(rollout_bytes(cfg, options, shape, batch))
    gathered_train = gathered_rollout = 0.0
    if sharded:  # fsdp2 / zero3: the unsharded weights a forward holds
        param_bytes = 2 if cfg.precision != "fp32" else 4
        gathered_train = (shape.params["root"] + shape.params["block"]) * param_bytes
        gathered_rollout = shape.params["total"] * param_bytes if cfg.dist.gather_for_generation else gathered_train
        parts["gathered"] = max(gathered_train, gathered_rollout)
    phases = phase_peaks(cfg, shape, parts, batch.micro_batches, shard, gathered_train, gathered_rollout)
    notes += moe_notes(cfg, shape, shard)
    notes.append(f"{batch.step_rows} completions per device a step in {batch.micro_batches} micro-batch(es) of "
                 f"{batch.rows}; prompt {L} tokens, completions {T}")
    device = options.device_memory_gb * GB
    return Estimate(parts, phases, notes, device, CUDA_RESERVE_BYTES + ALLOCATOR_SLACK * max(phases.values()))


# ---------------------------------------------------------------------------------------------
# Advice, the command
# ---------------------------------------------------------------------------------------------

ADVICE = (  # flags tried in this order, each where it applies
    ("--gradient_checkpointing", lambda c, o: not c.model.gradient_checkpointing),
    ("--beta 0", lambda c, o: c.algo.beta > 0 and c.model.train_type == "full"),
    ("--bf16", lambda c, o: c.precision == "fp32"),
    ("--freeze_vit", lambda c, o: c.model.train_type == "full" and not c.model.freeze_vit),
    ("--offload_optimizer", lambda c, o: c.dist.strategy == "zero3" and not c.dist.offload_optimizer),
    ("--train_type lora", lambda c, o: c.model.train_type == "full"),
    # split each row's tokens over ranks (Ulysses, docs/distributed.md): FSDP2, N dividing the ranks
    *((f"--sequence_parallel_size {n}", lambda c, o, n=n: c.dist.strategy == "fsdp2" and o.world_size % n == 0
       and c.dist.sequence_parallel_size < n and not c.rollout.use_vllm) for n in (2, 4, 8)),
)


def advice(argv: list[str], cfg, options: EstimateOptions) -> list[str]:
    """Flags that make the run fit: each one alone that does, else the fewest in ADVICE's order."""
    tried, fitting = [], []
    for flag, applies in ADVICE:
        if not applies(cfg, options):
            continue
        tried.append(flag)
        if _fits(argv + flag.split(), options):
            fitting.append(flag)
    if fitting:
        return fitting
    for count in range(2, len(tried) + 1):
        chosen = tried[:count]
        if _fits(argv + " ".join(chosen).split(), options):
            for flag in list(chosen):  # then drop those the others make unnecessary
                rest = [f for f in chosen if f != flag]
                if _fits(argv + " ".join(rest).split(), options):
                    chosen = rest
            return [" ".join(chosen)]
    return []


def _fits(argv: list[str], options: EstimateOptions) -> bool:
    from mmgrpo.config import TrainConfig
    from mmgrpo.config.flags import config_from_namespace

    try:
        return estimate(config_from_namespace(TrainConfig, build_estimate_parser().parse_args(argv)), options).fits
    except ConfigError:
        return False


def build_estimate_parser():
    from mmgrpo.config import TrainConfig
    from mmgrpo.config.flags import build_parser

    parser = build_parser(TrainConfig, prog="mmgrpo estimate", description="The memory a GRPO run needs per device, by part.")
    group = parser.add_argument_group("estimate")
    defaults = EstimateOptions()
    group.add_argument("--world_size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                       help="Processes (GPUs) of the run (default: $WORLD_SIZE or 1).")
    group.add_argument("--device_memory_gb", type=float, default=defaults.device_memory_gb,
                       help="Memory of one device in GB (default 80: an A100/H100 80GB).")
    group.add_argument("--image_pixels", type=int, default=None,
                       help="Pixels of each image after resizing (default: --max_pixels, else 448 x 448).")
    group.add_argument("--images_per_prompt", type=int, default=None,
                       help="Images per prompt (default 1; 0 with --video_seconds or --video_nframes).")
    group.add_argument("--prompt_text_tokens", type=int, default=defaults.prompt_text_tokens,
                       help="Text tokens of a prompt, chat template included (default 64).")
    group.add_argument("--video_seconds", type=float, default=defaults.video_seconds,
                       help="A video clip of this many seconds per prompt, sampled at --video_fps (or --video_nframes frames; "
                            "default 0: no clip).")
    group.add_argument("--video_pixels", type=int, default=None, help="Pixels of each video frame after resizing (default 448 x 448).")
    group.add_argument("--measure", action="store_true",
                       help="Also run two real steps of this configuration (one process) and print the second's measured peak.")
    return parser


def main(argv: list[str] | None = None) -> None:
    from mmgrpo.config import TrainConfig
    from mmgrpo.config.flags import config_from_namespace

    argv = list(argv or [])
    ns = build_estimate_parser().parse_args(argv)
    from mmgrpo.training.startup_checks import check_train_flags  # after --help
    options = EstimateOptions(world_size=ns.world_size, device_memory_gb=ns.device_memory_gb, image_pixels=ns.image_pixels,
                              images_per_prompt=ns.images_per_prompt if ns.images_per_prompt is not None
                              else 0 if ns.video_seconds or getattr(ns, "model.video_nframes", None) else 1,
                              prompt_text_tokens=ns.prompt_text_tokens,
                              video_seconds=ns.video_seconds, video_pixels=ns.video_pixels)  # fmt: skip
    for flag, value, low in (("world_size", options.world_size, 1), ("device_memory_gb", options.device_memory_gb, None),
                             ("image_pixels", options.image_pixels, 1), ("images_per_prompt", options.images_per_prompt, 0),
                             ("prompt_text_tokens", options.prompt_text_tokens, 0), ("video_seconds", options.video_seconds, 0),
                             ("video_pixels", options.video_pixels, 1)):
        if value is None:
            continue
        if not math.isfinite(value) or (value <= 0 if low is None else value < low):
            raise ConfigError(f"--{flag} {value}: give " + ("a finite number of GB > 0." if low is None else
                                                           f"{'a number' if isinstance(value, float) else 'an integer'} >= {low}."))
    cfg = config_from_namespace(TrainConfig, ns)
    if cfg.bf16 is None and not cfg.fp16 and cfg.torch_dtype in (None, "auto"):
        cfg.bf16 = True  # what train does on a GPU with bfloat16, the machines an estimate is for
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(options.world_size)  # train's checks, as under torchrun with this many ranks
    try:
        check_train_flags(cfg)
    finally:
        os.environ.pop("WORLD_SIZE") if saved is None else os.environ.__setitem__("WORLD_SIZE", saved)
    result = estimate(cfg, options)
    print(report(cfg, options, result, [a for a in argv if a != "--measure"]))
    if ns.measure:
        measured = measure_step_memory(cfg)
        phases = ", ".join(f"{name} {value / GB:.3f} GB (estimate {result.phases[name] / GB:.3f})"
                           for name, value in measured["phases"].items())
        print(f"measured peak of step 2 ({measured['device']}): {measured['peak_bytes'] / GB:.3f} GB "
              f"(estimate {result.peak_bytes / GB:.3f} GB, {result.peak_bytes / measured['peak_bytes'] - 1:+.0%}); {phases}")


def report(cfg, options: EstimateOptions, result: Estimate, argv: list[str]) -> str:
    lines = [f"mmgrpo estimate: {cfg.model.model}, {cfg.model.train_type} training, {cfg.dist.strategy} over {options.world_size} "
             f"device(s), {cfg.precision}{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}"
             + (f", rows split over {cfg.dist.sequence_parallel_size} ranks" if cfg.dist.sequence_parallel_size > 1 else "")]
    lines += [f"  {note}" for note in result.notes]
    lines.append(f"{'part':<18}{'GB per device':>14}")
    for name, value in result.parts.items():
        lines.append(f"{name:<18}{value / GB:>14.2f}")
    for phase, value in result.phases.items():
        lines.append(f"{'peak: ' + phase:<18}{value / GB:>14.2f}")
    lines.append(f"{'+ CUDA reserve':<18}{result.reserve_bytes / GB:>14.2f}   (context, workspaces, allocator slack)")
    lines.append(f"{'needed':<18}{result.needed_bytes / GB:>14.2f}   of {options.device_memory_gb:g} GB")
    if result.fits:
        lines.append(f"fits: {result.needed_bytes / result.device_bytes:.0%} of the device")
        return "\n".join(lines)
    phase = max(result.phases, key=result.phases.get)
    big = sorted((p for p in result.parts if p not in ("rollout",) or phase == "rollout"), key=result.parts.get, reverse=True)[:3]
    lines.append(f"does NOT fit: {result.needed_bytes / GB:.1f} GB needed at the {phase} peak; the largest parts: "
                 + ", ".join(f"{p} {result.parts[p] / GB:.1f} GB" for p in big))
    fixes = advice(argv, cfg, options)
    lines.append("fits with: " + (" | ".join(fixes) if fixes else "none of " + ", ".join(f for f, _ in ADVICE)
                                  + " (more devices, a smaller batch or shorter completions)"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def measure_step_memory(cfg) -> dict:
    """Two real GRPO steps of `cfg` in this process; the peak memory of the second (the first makes
    the optimizer state), of its rollout and of the rest of it (log-probs, update): the GPU's max
    allocated bytes, or on the CPU the `TrackedMemory` peak."""
    import torch

    from mmgrpo.engine import grpo_step, rollout_sampler
    from mmgrpo.parallel.tracked_memory import TrackedMemory
    from mmgrpo.runstate.state import seed_everything
    from mmgrpo.training.build import build_run
    from mmgrpo.training.startup_checks import check_train_flags

    check_train_flags(cfg)  # as engine.train does before build_run
    run = build_run(cfg)
    seed_everything(cfg.seed)
    batches = run.prompt_batches()
    grpo_step(run, next(batches), step=1)
    prompts = next(batches)
    peaks = {}
    if run.device.type == "cuda":
        def phase(name, work):
            torch.cuda.synchronize(run.device)
            torch.cuda.reset_peak_memory_stats(run.device)
            out = work()
            peaks[name] = torch.cuda.max_memory_allocated(run.device)
            return out

        device = torch.cuda.get_device_name(run.device)
    else:
        tracked = TrackedMemory(run.model, run.policy.ref_model, run.optimizer)

        def phase(name, work):
            tracked.reset_peak()
            with tracked:
                out = work()
            peaks[name] = tracked.peak_bytes
            return out

        device = "CPU, tracked tensors"
    encoded = [enc for _, enc in prompts]
    rollout = phase("rollout", lambda: rollout_sampler(run).generate(encoded, run.sampling(prompts)))  # under autocast
    phase("update", lambda given=rollout: grpo_step(run, prompts, step=2, rollout=given))
    lengths = [enc.prompt_ids.shape[-1] for enc in encoded]
    return {"peak_bytes": max(peaks.values()), "phases": peaks, "device": device, "prompt_tokens": lengths}
