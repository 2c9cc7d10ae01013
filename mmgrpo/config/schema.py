"""Every option of `mmgrpo train` and `mmgrpo sft`, in one place.

Nested dataclasses are the single source of truth. The docstring under each field is its
`--help` text; `flag(default, domain, resume=...)` beside it declares the values it may take and
what a resumed run may do with it (mmgrpo/config/domains.py). A YAML file (`--config run.yaml`,
nested by section or flat) overrides the defaults, and command-line flags override the YAML. Flag
names follow TRL and ms-swift. Turning them into flags is mmgrpo/config/flags.py; the rules
between flags, mmgrpo/config/checks.py; the checks that need a part (a registered loss, vLLM
installed, the world size), mmgrpo/training/startup_checks.py.

    >>> cfg = TrainConfig.from_args(["--num_generations", "8", "--beta", "0"])
    >>> cfg.rollout.num_generations, cfg.algo.beta
    (8, 0.0)
    >>> TrainConfig.from_args(["--scale_rewards", "none", "--epsilon_high", "none"]).algo.scale_rewards
    'none'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mmgrpo.config.checks import validate_sft, validate_train
from mmgrpo.config.domains import Number, OneOf, above, at_least, check_domains, count, flag
from mmgrpo.config.flags import build_parser, config_from_namespace

DEFAULT_MODEL = "tiny:qwen2-vl"  # the Python API's default; the commands require --model
UNSET_RATE = "or leave it unset for --learning_rate"  # a part's own learning rate


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL
    """Model folder, hub id (from the HF cache, offline too), or `tiny:<family>` for a tiny random checkpoint built
    offline. Required by `mmgrpo train` and `mmgrpo sft` (the Python API's default is tiny:qwen2-vl)."""
    model_type: str | None = None
    """Template name (`qwen2-vl`, `qwen2.5-vl`, ...). None: inferred from `tiny:<family>`, a training checkpoint's
    mmgrpo.json, or the checkpoint's config.json `model_type`."""
    max_pixels: int | None = flag(None, count(1, what="a number of pixels"))
    """Upper bound on an image's pixels after resizing (fewer visual tokens, less memory)."""
    min_pixels: int | None = flag(None, count(1, what="a number of pixels"))
    """Lower bound on an image's pixels after resizing."""
    video_fps: float = flag(2.0, above(0, what="frames per second"))
    """Frames per second sampled from a video file."""
    video_nframes: int | None = flag(None, count(1, what="a number of frames"))
    """A fixed number of frames per video (overrides `video_fps`)."""
    use_audio_in_video: bool = False
    """Qwen2.5-Omni: decode each video's sound track and feed it interleaved with the frames (every video needs sound)."""
    template_plugin: list[str] = field(default_factory=list)
    """Python files (`my_template.py`) or modules (`my_pkg.templates`) that register templates, imported before `--model_type` is looked up."""
    attn_implementation: str = flag(
        "sdpa", OneOf("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"), resume="operational")
    """The attention kernels (transformers' and TRL's name): `sdpa` (PyTorch's fused attention where the model's classes
    implement it, eager in parts that do not: transformers' default), `eager`, `flash_attention_2`
    (the flash-attn package, CUDA), `flash_attention_3` (flash_attn_interface, Hopper), `flex_attention`. The shared-prefix
    fast path runs on sdpa and eager; with another kernel the step takes the naive path and says so once."""
    gradient_checkpointing: bool = flag(False, resume="operational")
    """Recompute activations in backward: about 20% slower, much less activation memory."""
    shared_prefix: bool = flag(True, resume="operational")
    """Run each prompt and its media once per group of G (rollout and log-probs); exact, faster."""
    # ---- which weights train (mmgrpo/models/train_type.py) ----
    train_type: str = flag("full", OneOf("full", "lora", "fusion"))
    """`full` (every weight not frozen), `lora` (peft adapters only; the reference model is the base) or `fusion`
    (only the --fusion_module modules; the reference is the model without them, no copy)."""
    lora_rank: int = flag(8, count(1))
    """LoRA rank r."""
    lora_alpha: int = flag(32, above(0))
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_dropout: float = flag(0.05, Number(0, 1, high_open=True, what="a probability"))
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """LoRA targets: all-linear | llm | vision | aligner (parts, via the template) or layer names (q_proj v_proj)."""
    freeze_vit: bool = False
    """Freeze the vision (and audio) tower: no gradient in full training, no adapters with LoRA."""
    freeze_aligner: bool = False
    """Freeze the aligner (projector between the vision tower and the LLM)."""
    freeze_llm: bool = False
    """Freeze the language model and LM head."""
    # ---- fusion modules (mmgrpo/fusion/, docs/fusion.md) ----
    fusion_module: str | None = None
    """Insert a trainable module after each --fusion_layers decoder layer through which the text attends to the
    sample's modality features (the tower's output after the projector): `gated_xattn`, `coattn`, or a name
    registered with `register_fusion` (--fusion_plugin). Its tanh gate starts at 0: at step 0 the model is the base."""
    fusion_layers: list[str] = field(default_factory=list)
    """Decoder layers (0-based) after which the modules go, e.g. `4,20`. Empty: the middle layer."""
    fusion_plugin: list[str] = field(default_factory=list)
    """Python files or modules that call `register_fusion` (imported before --fusion_module is looked up)."""


@dataclass
class DataConfig:
    dataset: list[str] = field(default_factory=lambda: ["shapes-color"])
    """Registered names (`name`, `name:split`), files (.json/.jsonl/.parquet) or mixtures (`a:0.7 b:0.3`)."""
    dataset_registry: list[str] = field(default_factory=list)
    """Extra dataset registry YAML files (also read from $MMGRPO_DATASET_REGISTRY)."""
    split: str = "train"
    """Split to train on when a dataset spec names none."""
    system: str | None = None
    """A system prompt for every row that has no system turn of its own, in place of the datasets' (ms-swift's name;
    `--system ""`: none). None: each dataset's registry `system_prompt`."""
    media_root: str | None = None
    """The folder a bare data file's relative image/video/audio paths are read from (default: the file's own folder;
    registry entries keep their `media_root`)."""
    max_prompt_length: int = flag(2048, count(1), resume="operational")
    """Longest prompt in tokens, media tokens included. Longer prompts are an error."""
    dataloader_num_workers: int = flag(2, count(0), resume="operational")
    """Worker processes that decode media and encode prompts ahead of the training step."""


@dataclass
class RolloutConfig:
    num_generations: int = flag(8, count(2, what="a group size", hint="GRPO compares the completions of a prompt"))
    """G: completions sampled per prompt. Advantages are computed within each group of G."""
    max_completion_length: int = flag(256, count(1))
    """Longest completion in tokens; longer ones are cut (and count as truncated). With --max_turns > 1 it bounds
    the whole episode after the prompt: the model's turns and the tool turns between them (image tokens included)."""
    temperature: float = flag(1.0, above(0, hint="log-probs are divided by it"))
    """Sampling temperature (log-probs are computed at the same temperature)."""
    top_p: float = flag(1.0, Number(0, 1, low_open=True, what="a probability", hint="1: no nucleus filter"))
    """Nucleus sampling threshold."""
    top_k: int = flag(0, count(0, what="a number of tokens", hint="0: no top-k filter"))
    """Top-k sampling (0 = off)."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length from the loss (DAPO)."""
    suppress_eos: bool = False
    """For benchmarks and memory checks, not for learning: EOS ids are never sampled (suppressed like the
    placeholder ids), so every completion is --max_completion_length tokens (TRL users pass
    `generation_kwargs={"suppress_tokens": [...]}` for the same)."""
    max_turns: int = flag(1, count(1, hint="1: single turn"))
    """Model turns per episode (ms-swift's name). 1: single-turn rollouts. More: a turn that calls a tool
    (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) gets the tool's answer and another turn, up to
    this many; only the model's own tokens are trained (docs/tools.md). Needs --tools."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: registered names (`image_zoom_in_tool`) or `path/file.py:fn` plugins."""
    tool_timeout: float = flag(10.0, above(0, what="seconds", finite=False), resume="operational")
    """Seconds a tool call may run; a slower one is answered with an error message (counted in tools/errors)."""
    async_generate: bool = flag(False, resume="staleness")
    """Generate the next step's completions while this step trains (one-step off-policy, ms-swift's name): the
    same as --max_staleness 1. The rollout engine samples from its own copy of the weights, one optimizer step
    old; see --vllm_importance_sampling_correction."""
    max_staleness: int | None = flag(None, count(1, what="K", hint=(
        "the most optimizer steps a rollout's weights may lag behind the policy it trains; 1: one step off-policy, "
        "as --async_generate; leave it out to train synchronously")), resume="staleness")
    """Asynchronous training with bounded staleness: rollouts are generated up to K steps ahead of the trainer,
    step t's on the weights of step t - 1 - K (so K steps stale; 1 is --async_generate), and a rollout staler than
    K is never trained on (dropped and generated again, rollout/dropped_stale). Larger K absorbs rollouts that
    take longer than a step. None: synchronous, or 1 with --async_generate (mmgrpo/rollout/pipeline.py)."""
    partial_rollouts: bool = False
    """With --max_staleness K >= 2: a rollout generated ahead pauses at every weight update and continues on the new
    weights (verl's partial rollout, slime's --partial-rollout), so a completion's later tokens are fresher: step s's
    rollout is generated in K chunks on versions s - 1 - K .. s - 2, each token tagged with its version (the oldest
    bounds the staleness). The in-process shared-prefix engine (a continued chunk re-decodes the tokens so far
    teacher-forced on the new weights) and vLLM, colocated or servers (a continued completion is prefilled anew
    from its tokens); docs/vllm.md, Partial rollouts."""
    partial_rollout_tokens: int | None = flag(None, count(1, what="a number of tokens"))
    """--partial_rollouts: the most tokens a completion gains in each chunk but its last (which finishes it).
    None: ceil(--max_completion_length / K)."""
    # ---- which completions the step trains on (mmgrpo/rollout/rounds.py) ----
    dynamic_sample: bool = False
    """DAPO dynamic sampling (ms-swift's name): groups whose G rewards are all equal are dropped and more
    prompts are rolled out until the batch holds B groups that differ, at most --max_resample_times extra rounds."""
    max_resample_times: int = flag(3, count(0))
    """--dynamic_sample: extra rollout rounds per step at most; then the step goes on with what it has (said once)."""
    first_stage_generations: int = flag(0, count(0, hint="0: off"))
    """Two-stage generation: K < G completions per prompt first; only prompts whose K disagree or fail get the
    other G - K (a prompt whose K all got the batch's best reward leaves the batch). 0: off."""
    # ---- vLLM (mmgrpo/rollout/vllm_*.py, docs/vllm.md) ----
    use_vllm: bool = False
    """Roll out with vLLM (TRL / ms-swift name): `pip install mmgrpo[vllm]` on GPUs. Off: the in-process engines."""
    vllm_mode: str = flag("colocate", OneOf("colocate", "server"))
    """`colocate`: a vLLM engine in the training process (one per rank); `server`: a `mmgrpo rollout-server` elsewhere."""
    vllm_gpu_memory_utilization: float = flag(0.3, Number(0, 1, low_open=True, what="a share"), resume="operational")
    """Colocate on GPUs: the share of GPU memory vLLM takes for its weights and KV cache."""
    vllm_max_model_len: int | None = flag(None, count(1), resume="operational")
    """Longest prompt + completion vLLM holds. None: --max_prompt_length + --max_completion_length."""
    vllm_tensor_parallel_size: int = flag(1, count(1), resume="operational")
    """Colocate on GPUs: ranks that share one vLLM engine by tensor parallelism."""
    vllm_enable_sleep_mode: bool = flag(False, resume="operational")
    """Colocate on GPUs: vLLM releases its KV cache and moves its weights to host memory between rollouts."""
    vllm_kv_cache_memory_bytes: int | None = flag(None, count(1, what="a number of bytes", hint="e.g. 268435456"),
                                                  resume="operational")
    """vLLM's KV cache in bytes (vLLM on CPU: default 256 MiB; on GPUs it overrides --vllm_gpu_memory_utilization)."""
    vllm_server_host: list[str] = flag(factory=lambda: ["127.0.0.1"], resume="operational")
    """Server mode: the host of each `mmgrpo rollout-server` (one host for all ports, or one per port)."""
    vllm_server_port: list[int] = flag(factory=lambda: [8000], domain=Number(1, 65535, integer=True, what="a port"),
                                       resume="operational")
    """Server mode: the port of each server (one port for all hosts, or one per host). Rank r of W sends its
    prompts to server r mod S (with more servers than ranks: spread over servers r, r + W, ...)."""
    vllm_server_timeout: float = flag(240.0, above(0, what="seconds", finite=False), resume="operational")
    """Server mode: seconds to wait for the servers at start-up, for any one request, and for any collective of
    the weight group, before the run stops with a line naming the server."""
    vllm_weight_transfer: str = flag("collective", OneOf("collective", "http"), resume="operational")
    """Server mode: how weights reach the servers. `collective`: broadcast from trainer rank 0 over a process
    group of their own (NCCL where trainer and servers are all on GPUs, gloo otherwise); `http`: safetensors
    chunks (through /dev/shm to a server on this host)."""
    vllm_weight_bucket_mb: int = flag(256, count(1, what="MB", hint="a bucket always holds at least one fused layer's weights"),
                                      resume="operational")
    """Server mode: weights travel in buckets of about this many MB (a fused layer's weights never split)."""
    vllm_group_host: str | None = flag(None, resume="operational")
    """Server mode, collective transfer: the address of trainer rank 0 that every server reaches. None: the
    address of this host on the route to the servers (127.0.0.1 when they all run here)."""
    vllm_group_port: int = flag(0, Number(0, 65535, integer=True, what="a port", hint="0: a free one"), resume="operational")
    """Server mode, collective transfer: the port of the weight group's store on trainer rank 0. 0: a free one."""

    @property
    def staleness_bound(self) -> int:
        """K of asynchronous training (--max_staleness, or 1 for --async_generate); 0: synchronous."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.async_generate else 0

    @property
    def chunk_tokens(self) -> int:
        """--partial_rollouts: the tokens a completion gains per chunk but its last (--partial_rollout_tokens,
        else ceil(--max_completion_length / K))."""
        if self.partial_rollout_tokens is not None:
            return self.partial_rollout_tokens
        return -(-self.max_completion_length // max(1, self.staleness_bound))


@dataclass
class AlgoConfig:
    reward_funcs: list[str] = field(default_factory=list)
    """Reward names or `path/file.py:fn` plugins, each for every row; `DATASET:REWARD` (the part before the first colon names one of the run's datasets) scores that dataset's rows only (docs/rewards.md). Empty: each dataset's own defaults."""
    reward_weights: list[float] | None = None
    """One weight per reward (default 1.0 each), in the order: --reward_funcs, then --reward_model(s), then the judge."""
    reward_model: list[str] = field(default_factory=list)
    """HF sequence-classification reward models (folders; `tiny:reward-qwen2` for a tiny one) scoring prompt + completion."""
    reward_model_device: str | None = flag(None, resume="operational")
    """Device of the reward models and the judge (e.g. `cuda:1`). None: this process's GPU, else the CPU."""
    reward_model_batch_size: int = flag(16, count(1), resume="operational")
    """Completions per forward of a reward model, and per generate call of the judge."""
    judge_model: str | None = None
    """A vision-language model as a generative judge (docs/rewards.md): it sees the images, question, reference and
    completion; its parsed reply is the reward `judge`."""
    judge_model_type: str | None = None
    """The judge's template (inferred from its checkpoint when not given)."""
    judge_prompt: str | None = None
    """A text file: the judge's prompt with {question}, {reference} and {completion}. None: the built-in one."""
    judge_parse: str = flag("score", OneOf("score", "verdict"))
    """How the judge's reply becomes a reward: `score` (the last "Score: N" / --judge_score_max) or `verdict`
    ("Verdict: correct|incorrect" -> 1|0). Unparsable: None for that sample, counted as judge/unparsed."""
    judge_score_max: float = flag(10.0, above(0))
    """The top of the judge's score scale (`score` parsing)."""
    judge_max_new_tokens: int = flag(64, count(1))
    """Longest judge reply in tokens (greedy)."""
    judge_use_vllm: bool = False
    """Run the judge on a colocated vLLM engine of its own (sized by the --vllm_* flags) instead of HF/shared-prefix."""
    reward_kwargs: str | None = None
    """Options of named rewards, JSON: `{"cosine": {"cosine_max_len": 512}, "repetition": {"repetition_n_grams": 4}}`
    (docs/rewards.md lists each reward's options)."""
    reward_errors: str = flag("raise", OneOf("raise", "none"), resume="operational")
    """What a raising reward, a NaN/inf reward or one past --reward_timeout does: `raise` stops with the reward and sample named; `none` skips those samples (with a warning)."""
    missing_solution: str = flag("error", OneOf("error", "skip"))
    """Rows with no `solution` (None or absent) where a reward needs one to grade (vqa_accuracy, exact_match, iou,
    giou, iou@0.5, math_accuracy, number_closeness, cosine, a plugin with a required `solution` argument): `error` stops
    at start-up naming the dataset and rows; `skip` scores those samples None for such rewards (skipped, as a reward's
    own None), counted each step as reward/missing_solution."""
    reward_timeout: float = flag(300.0, at_least(0, what="seconds", hint="0: no limit"), resume="operational")
    """Seconds one reward call (a batch) may take before it is stopped and counts as an error (--reward_errors). 0: no limit."""
    loss_type: str = "dapo"
    """Loss aggregation: grpo | bnpo | dr_grpo | dapo | cispo (see docs/algorithm.md), or a loss registered with `register_loss`."""
    beta: float = flag(0.04, at_least(0))
    """KL coefficient to the reference model (k3 estimator). 0 loads no reference model."""
    teacher_model: str | None = None
    """On-policy distillation: a model of the same family and tokenizer (folder, hub id, tiny:) whose per-token
    log-probs of the student's own completions become a reward, log p_teacher - log p_student per token, weighted by
    --teacher_kl_coef and added to the rewards' advantages (docs/algorithm.md). Sharded like the reference under FSDP2 / ZeRO-3."""
    teacher_kl_coef: float = flag(1.0, at_least(0))
    """--teacher_model's weight: each completion token's advantage gains teacher_kl_coef x (log p_teacher - log p_student)."""
    teacher_server_host: str = flag("127.0.0.1", resume="operational")
    """--teacher_server_port's host."""
    teacher_server_port: int | None = flag(None, domain=Number(1, 65535, integer=True, what="a port"), resume="operational")
    """A `mmgrpo rollout-server --model <--teacher_model>` that scores the student's completions (vLLM's prompt
    log-probs of prompt + completion) instead of a teacher in the trainer's processes; the server checks it serves
    --teacher_model. Unset: the teacher is loaded in the trainer (sharded like the reference)."""
    epsilon: float = flag(0.2, above(0))
    """Lower clipping range of the importance ratio."""
    epsilon_high: float | None = flag(0.28, at_least(0))
    """Upper clipping range (clip-higher, DAPO). None: same as epsilon."""
    delta: float | None = flag(None, above(1, what="a ratio bound"))
    """Dual clip (TRL's name): for negative advantages the ratio is capped at delta (> 1 + epsilon_high). None: off."""
    entropy_coeff: float = flag(0.0, at_least(0, what="a bonus", hint="e.g. 0.001; 0 turns it off"))
    """Entropy bonus (verl's name): the loss minus entropy_coeff x the policy's mean entropy over the update's
    completion tokens, so sampling stays spread out (e.g. 0.001-0.01). 0: off (the entropy is still logged)."""
    scale_rewards: str = flag("group", OneOf("group", "batch", "none"))
    """Advantage scaling: group (divide by group std) | batch | none (what Dr. GRPO prescribes: use it with --loss_type dr_grpo)."""
    num_iterations: int = flag(1, count(1))
    """Optimisation passes over each rollout batch (mu); >1 uses old log-probs in the ratio."""
    importance_sampling_level: str = "token"
    """`token` (GRPO) or `sequence` (GSPO)."""
    advantage_estimator: str = "grpo"
    """How rewards become advantages: `grpo` (reward minus the group mean) or `rloo` (minus the mean of the
    other G - 1), then scaled per --scale_rewards; or an estimator registered with `register_advantage`."""
    vllm_importance_sampling_correction: bool = True
    """Where completions come from other weights than the policy's own module (vLLM, --async_generate): recompute
    their log-probs with the policy and weight each token's loss by the trainer/sampler probability ratio (TRL's name)."""
    vllm_importance_sampling_mode: str = "token_truncate"
    """token_truncate | token_mask | sequence_truncate | sequence_mask | geometric_truncate | geometric_mask: the
    trainer/sampler ratio per token, per completion, or per completion as the geometric mean over its tokens; ratios
    outside [--vllm_importance_sampling_floor, --vllm_importance_sampling_cap] are cut to the band (truncate) or
    zeroed (mask; token_mask with a floor is IcePop's two-sided mask). Formulas: docs/algorithm.md."""
    vllm_importance_sampling_cap: float = flag(3.0, above(0, what="a ratio", finite=False))
    """Upper bound of the importance sampling ratio (TRL's name; its newer name is vllm_importance_sampling_clip_max)."""
    vllm_importance_sampling_floor: float | None = flag(None, at_least(0, what="a ratio"))
    """Lower bound of the ratio (unset: none); with a *_mask mode, e.g. 0.5 with a cap of 5, tokens or completions the
    trainer finds far less likely than the sampler did are left out as well."""
    opsm_delta: float | None = flag(None, at_least(0))
    """Off-policy sequence masking (DeepSeek-V3.2): leave out a completion whose advantage is negative and whose mean
    log(sampler / trainer) probability over its tokens exceeds this (e.g. 0.1 to 1). Unset: off."""
    modality_weights: list[str] = field(default_factory=list)
    """`image=1.0 video=0.5`: each completion's advantage times its sample's modality weight (text, image, video, audio, mixed; default 1)."""
    dynamic_modality_weights: bool = False
    """Advantage weights from the training signal (mmgrpo/grpo/dynamic_weights.py): each modality's weight moves its
    mean |advantage| towards the others', within [1/4, 4], logged as weights/<name>; on top of --modality_weights."""
    dynamic_weights_by: str = flag("modality", OneOf("modality", "dataset"))
    """--dynamic_modality_weights per `modality` or per `dataset` of a mixture."""
    max_tokens_per_microbatch: int = flag(0, count(0, hint="0: fixed micro-batches"))
    """Token budget of a log-prob forward (prompt + completion tokens, padding included; with the shared
    prefix a prompt counts once): prompt groups of similar completion length are packed under it, and
    each rollout batch is one optimizer update. 0: micro-batches of per_device_train_batch_size rows."""
    routing_replay: str = flag("off", OneOf("off", "rollout"))
    """Mixture-of-experts policies (docs/models.md, "Mixture of experts"): `rollout` records the experts each token
    was routed to while sampling (the HF rollout engine) and replays them in the trainer's old, reference and policy
    forwards, so their log-probs of sampled tokens are the sampler's (R3, "rollout routing replay"; the router's
    probabilities still come from the current weights, so it trains). `off`: each forward routes by itself. Where
    routes are recorded, routing/mismatch_fraction logs how often the trainer's own choice differs."""
    router_aux_loss_coef: float = flag(0.0, at_least(0, what="a coefficient", hint="0: off"))
    """Mixture-of-experts policies: add this times the routers' load-balancing loss (transformers' Switch-style
    loss, the mean over layers; the config's own router_aux_loss_coef is 0.001 for Qwen3-VL-MoE) to each update's
    loss, logged as routing/aux_loss. 0: off (TRL's and ms-swift's name)."""


@dataclass
class OptimConfig:
    optim: str = flag("adamw_torch_fused", OneOf("adamw_torch_fused", "adamw_torch"))
    """`adamw_torch_fused` (one kernel per step over all tensors, no temporaries: 2.5x faster on CPU,
    lower peak memory) or `adamw_torch` (torch's for-each/for-loop AdamW). Same update either way."""
    learning_rate: float = flag(1e-6, at_least(0, hint="e.g. 1e-6"), resume="schedule")  # > 0 for GRPO (checks.py)
    """Peak learning rate of AdamW."""
    vit_lr: float | None = flag(None, above(0, hint=UNSET_RATE), resume="schedule")
    """Peak learning rate of the vision (and audio) tower, the aligner excluded (ms-swift's name); its own parameter
    group on the same schedule, logged as learning_rate/vit. None: --learning_rate."""
    aligner_lr: float | None = flag(None, above(0, hint=UNSET_RATE), resume="schedule")
    """Peak learning rate of the aligner (the projector into the LLM), logged as learning_rate/aligner. None: --learning_rate."""
    fusion_lr: float | None = flag(None, above(0, hint=UNSET_RATE), resume="schedule")
    """Peak learning rate of the --fusion_module modules, logged as learning_rate/fusion. None: --learning_rate."""
    weight_decay: float = flag(0.0, at_least(0))
    """AdamW weight decay."""
    adam_beta1: float = flag(0.9, Number(0, 1, high_open=True))
    """AdamW beta1."""
    adam_beta2: float = flag(0.99, Number(0, 1, high_open=True))
    """AdamW beta2 (0.99 reacts faster than 0.999 to the shifting RL gradients)."""
    warmup_ratio: float = flag(0.0, Number(0, 1, what="a fraction of the steps"), resume="schedule")
    """Fraction of max_steps with a linear warm-up from 0 (ceil(ratio x steps) steps, as in HF)."""
    warmup_steps: int = flag(0, count(0, hint="0: --warmup_ratio decides"), resume="schedule")
    """Steps of linear warm-up from 0; when above 0 it overrides --warmup_ratio (as in HF)."""
    lr_scheduler_type: str = flag("cosine_with_min_lr", resume="schedule")
    """HF's schedules by name: linear | cosine (to 0) | cosine_with_min_lr (to --lr_scheduler_kwargs min_lr_rate of the
    peak, default 0.1) | constant (no warm-up) | constant_with_warmup | warmup_stable_decay (the peak, then a cosine
    over the last --lr_scheduler_kwargs num_decay_steps to min_lr_ratio of it)."""
    lr_scheduler_kwargs: str | None = flag(None, resume="schedule")
    """The schedule's options as JSON, e.g. `{"min_lr_rate": 0.05}` (cosine_with_min_lr), `{"num_cycles": 1.0}` (cosine)."""
    max_grad_norm: float = flag(1.0, at_least(0, hint="0: no clipping"))
    """Gradient clipping by global norm (0 = off)."""
    per_device_train_batch_size: int = flag(8, count(1))
    """Completions per micro-batch (as in TRL: must be a multiple of num_generations... per step)."""
    gradient_accumulation_steps: int = flag(1, count(1))
    """Micro-batches per optimizer update. A rollout batch is batch_size x accumulation completions."""


@dataclass
class EvalConfig:
    eval_dataset: list[str] = field(default_factory=list)
    """Evaluate during training on these `NAME[:split]` (split default: test) or data files. Empty: never."""
    eval_steps: int = flag(0, count(0, hint="0: only after the last step"), resume="operational")
    """Evaluate every N steps, and after the last step. 0: only after the last step."""
    eval_metrics: list[str] = field(default_factory=list)
    """Metrics, as `mmgrpo eval --metrics` takes them. Empty: the eval dataset's reward functions."""
    eval_limit: int | None = flag(None, count(1, hint="or leave it unset for the whole split"))
    """Evaluate on the first N samples of the split only. None: all of them."""
    per_device_eval_batch_size: int = flag(32, count(1), resume="operational")
    """Prompts per generate call during evaluation (greedy, one completion each)."""
    metric_for_best_model: str | None = None
    """Keep output_dir/checkpoint-best at the best value of this eval metric. None: the first eval metric."""
    greater_is_better: bool = True
    """Whether a larger metric_for_best_model is better."""
    fusion_probe_steps: int = flag(0, count(0, hint="0: off"))
    """Every N steps, measure on a few of the step's completions how much the policy relies on each modality:
    the mean token log-prob with the medium against with it blanked (fusion/reliance/<modality>), and the share of
    attention the completion gives each modality's tokens per layer band (fusion/attention/<modality>/<band>).
    0: never (docs/fusion.md)."""
    fusion_probe_rows: int = flag(4, count(1))
    """Completions the probe reads (one per prompt, the first prompts of the step)."""


@dataclass
class DistConfig:
    """Beyond one process (mmgrpo/parallel/, docs/distributed.md): launch with torchrun."""

    parallel: str = flag("none", OneOf("none", "fsdp2", "zero3"))
    """none (one process) | fsdp2 (PyTorch FSDP2) | zero3 (DeepSpeed ZeRO-3). Under torchrun pick fsdp2 or zero3."""
    deepspeed: str | None = None
    """As in ms-swift: `zero3` or a DeepSpeed JSON path ("auto" values filled from the flags). Implies --parallel zero3."""
    offload_optimizer: bool = flag(False, resume="operational")
    """ZeRO-3: keep optimizer states (and the step) on the CPU."""
    offload_param: bool = flag(False, resume="operational")
    """ZeRO-3: keep parameters on the CPU between uses. FSDP2: CPUOffloadPolicy (parameters, gradients, optimizer)."""
    ddp_timeout: int = flag(1800, above(0, what="seconds"), resume="operational")
    """Seconds a collective waits for the other ranks before failing (a dead or hung rank stops the run)."""
    gather_for_generation: bool = flag(True, resume="operational")
    """FSDP2 / ZeRO-3 rollouts gather the full weights once per rollout (fast); false: every decoding step gathers (less memory)."""
    sequence_parallel_size: int = flag(1, count(1))
    """Ranks that split each row's tokens (Ulysses; mmgrpo/forward/sequence_parallel.py): consecutive groups of this many
    ranks share their prompts and run the log-prob forwards on 1/N of each row's tokens. With --parallel fsdp2."""

    @property
    def strategy(self) -> str:
        """The strategy these flags name: --deepspeed means zero3."""
        return "zero3" if self.deepspeed else (self.parallel or "none")


@dataclass
class RunOptions:
    """Options every command that trains has (GRPO and SFT): where the run goes, how long, how it is logged."""

    output_dir: str = flag("runs/latest", resume="not_compared")
    """Where metrics.jsonl, completions.jsonl, TensorBoard events, checkpoints and config.yaml go."""
    max_steps: int = flag(100, count(-1, hint="-1: by epochs"), resume="schedule")
    """Rollout steps (each: generate, reward, num_iterations optimizer updates). -1: by epochs."""
    num_train_epochs: float = flag(1.0, at_least(0), resume="schedule")
    """Epochs over the prompts, used when max_steps is -1."""
    save_steps: int = flag(0, count(0, hint="0: only at the end"), resume="operational")
    """Save a checkpoint every N steps (0: only at the end)."""
    save_total_limit: int | None = flag(None, count(1, what="a number of checkpoints", hint="or leave it unset to keep all"),
                                        resume="operational")
    """Keep only the newest N complete checkpoint-N folders (checkpoint-best is kept apart). None: keep all."""
    resume_from_checkpoint: str | None = flag(None, resume="not_compared")
    """`latest` (the newest complete checkpoint in --output_dir) or a checkpoint folder: continue that run exactly (weights, optimizer, schedule, RNGs, data position); the reference model stays --model."""
    save_in_background: bool = flag(False, resume="operational")
    """Write checkpoints from a thread after copying them to memory (one process; the final save is awaited). See docs/training.md."""
    overwrite_output_dir: bool = flag(False, resume="not_compared")
    """Start afresh in a non-empty --output_dir: the earlier run's files there (metrics, completions, events, checkpoints, eval/) are deleted; other files stay."""
    run_name: str | None = flag(None, resume="not_compared")
    """The run's name in W&B and MLflow (HF's name). None: the --output_dir folder's name."""
    logging_steps: int = flag(1, count(1), resume="operational")
    """Print and log every N steps."""
    report_to: list[str] = flag(factory=lambda: ["tensorboard"], resume="operational")
    """Trackers beside metrics.jsonl: any of `tensorboard` `wandb` `mlflow` (with the completions table), or `none`
    (docs/training.md; WANDB_MODE=offline and MLflow's file store need no network)."""
    seed: int = flag(0, Number(0, 2**32 - 1, integer=True, what="a seed"))
    """Seeds data order, sampling and initialisation."""
    full_determinism: bool = flag(False, resume="operational")
    """Deterministic GPU kernels (torch.use_deterministic_algorithms, cuBLAS's fixed workspace, cuDNN): two runs with one seed, or a resumed run and the uninterrupted one, then agree on a GPU as they do on the CPU; some kernels get slower (HF's name)."""
    bf16: bool | None = None
    """bfloat16 autocast over fp32 master weights. Unset: on where the GPU has bfloat16 (Ampere and later), float32
    on the CPU and on older GPUs (said in one line); `--bf16` on the CPU: CPU bfloat16 autocast; `--bf16 false`: float32."""
    fp16: bool = False
    """float16 autocast over fp32 master weights with dynamic loss scaling, for GPUs without bfloat16 (V100, T4):
    the loss is scaled before backward, a step whose gradients overflow is skipped and the scale halved
    (`fp16/overflow` and `fp16/loss_scale` in the metrics; not counted by --max_nonfinite_steps while the scale is above 1)."""
    torch_dtype: str | None = flag(None, OneOf("auto", "bfloat16", "float16", "float32"))
    """The precision the forwards compute in, by the name TRL and ms-swift use: `bfloat16` is --bf16, `float16` --fp16,
    `float32` neither, `auto` (or unset) --bf16's default. The master weights and optimizer states stay float32."""
    torch_threads: int | None = flag(None, count(1), resume="operational")
    """torch intra-op threads (CPU). Default: torch's choice."""

    # ---- loading ---------------------------------------------------------------------------

    @classmethod
    def from_args(cls, argv: list[str] | None = None, required: tuple[str, ...] = ()):
        """Defaults <- `--config` YAML <- command-line flags. `required`: dotted fields the flags or the
        YAML must set (the commands require `model.model`: a user's run never falls back to the tiny model)."""
        parser = build_parser(cls)
        ns = parser.parse_args(argv)
        return config_from_namespace(cls, ns, required)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def precision(self) -> str:
        """What the forwards compute in: `bf16`, `fp16` or `fp32` (after start-up resolved --bf16, --fp16 and --torch_dtype)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class TrainConfig(RunOptions):
    """GRPO training: every option of `mmgrpo train`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log_completions: int = flag(4, count(0), resume="operational")
    """Prompts per step written to completions.jsonl (all G completions of each)."""
    max_nonfinite_steps: int = flag(5, count(1), resume="operational")
    """Stop after this many steps with a NaN/inf loss or gradient norm (each one is skipped with a warning)."""
    save_strategy: str = flag("steps", OneOf("steps", "no"), resume="operational")
    """`steps`: a checkpoint every --save_steps and after the last step; `no`: no checkpoint-N at all (HF's name;
    for benchmarks and throwaway runs: --eval_dataset's checkpoint-best is still kept, and a --save_on_signal
    signal still saves the step it stops at)."""
    save_on_signal: list[str] = flag(factory=lambda: ["SIGTERM", "SIGUSR1"], resume="operational")
    """Signals that stop the run cleanly (what Slurm and cloud schedulers send before they kill): the step in progress
    finishes, a checkpoint of it is saved, and the run exits with status 75 and a line saying how to resume; a second
    signal exits at once (status 128 + its number), earlier checkpoints intact. `none`: their default effect (docs/training.md)."""

    def validate(self) -> None:
        """Each flag against its domain, then the rules between flags: checks only, no part needed.
        `mmgrpo.training.startup_checks.check_train_flags` runs these and the checks that need a part."""
        check_domains(self)
        validate_train(self)


@dataclass
class SFTConfig(RunOptions):
    """Supervised warm start: cross-entropy on the dataset's reference answers (one process)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # a 3B-7B model's full SFT: 1e-5 (ms-swift's full-tuning default; TRL's SFTConfig has 2e-5), 8 samples a
    # micro-batch (TRL's); tiny models learn at 1e-3, and the demo's configs say so
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(learning_rate=1e-5, per_device_train_batch_size=8))
    eval: EvalConfig = field(default_factory=EvalConfig)
    max_steps: int = flag(200, count(-1, hint="-1: by epochs"), resume="schedule")
    """Optimizer steps of supervised training (each: per_device_train_batch_size x gradient_accumulation_steps samples). -1: by epochs."""
    max_completion_length: int = flag(64, count(1))
    """Tokens generated per answer by the evaluations during SFT (a dataset's own budget in the registry wins)."""
    stop_at: str | None = None
    """Stop at the first evaluation where an eval metric reaches a value, `METRIC>=VALUE` or `METRIC<=VALUE`
    (e.g. `shapes-color/vqa_accuracy>=0.5`): a warm start that reads the task yet leaves GRPO room to lift it.
    Needs --eval_dataset and --eval_steps. None: train all --max_steps."""
    loss_normalization: str = flag("token", OneOf("token", "sample"))
    """How the answer tokens' losses become one: `token`, the mean over all target tokens of the step
    (a 27-token box then outweighs a 5-token count answer 5 to 1); `sample`, each answer's mean, then
    the mean over answers, so every sample of a mixture weighs the same whatever its length."""

    def validate(self) -> None:
        """Each flag against its domain, then the rules between flags: checks only, no part needed.
        `mmgrpo.training.startup_checks.check_sft_flags` runs these and the checks that need a part."""
        check_domains(self)
        validate_sft(self)
