"""Flag combinations of --parallel / --deepspeed / LoRA that cannot work, checked before any
model loads. Checks only: the config is not changed (`DistConfig.strategy` is the strategy the
flags name)."""

from __future__ import annotations

from mmgrpo.errors import ConfigError
from mmgrpo.parallel.launch import env_world_size

PARALLEL_CHOICES = ("none", "fsdp2", "zero3")
TRAIN_TYPES = ("full", "lora", "fusion")


def validate_parallel(cfg) -> None:
    """Flag combinations of --parallel / --deepspeed / LoRA that cannot work, as ConfigErrors."""
    dist_cfg, model_cfg = cfg.dist, cfg.model
    requested = dist_cfg.parallel or "none"
    if dist_cfg.deepspeed and requested not in ("none", "zero3"):
        raise ConfigError(f"--deepspeed {dist_cfg.deepspeed} contradicts --parallel {requested}: DeepSpeed is --parallel zero3.")
    if requested not in PARALLEL_CHOICES:
        raise ConfigError(f"--parallel {requested!r}: choose one of {', '.join(PARALLEL_CHOICES)}.")
    world_size = env_world_size()
    if world_size > 1 and dist_cfg.strategy == "none":
        raise ConfigError(
            f"{world_size} processes were launched but --parallel is none (each would train its own copy): "
            "pass --parallel fsdp2 or --parallel zero3."
        )
    if dist_cfg.ddp_timeout <= 0:
        raise ConfigError(f"--ddp_timeout {dist_cfg.ddp_timeout}: give a positive number of seconds.")
    if (dist_cfg.offload_optimizer or dist_cfg.offload_param) and dist_cfg.strategy == "none":
        raise ConfigError("--offload_optimizer / --offload_param need --parallel zero3 (or fsdp2 for --offload_param).")
    if dist_cfg.offload_optimizer and dist_cfg.strategy == "fsdp2":
        raise ConfigError("FSDP2 offloads parameters, gradients and optimizer state together: use --offload_param.")
    per_rank = cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps
    G = cfg.rollout.num_generations
    if world_size > 1 and per_rank % G:
        raise ConfigError(
            f"{world_size} ranks: each rank rolls out whole groups, but per_device_train_batch_size "
            f"{cfg.optim.per_device_train_batch_size} x gradient_accumulation_steps {cfg.optim.gradient_accumulation_steps} "
            f"= {per_rank} completions per rank is not a multiple of --num_generations {G}. The global batch is "
            f"{per_rank} x {world_size} ranks; raise --gradient_accumulation_steps or the batch size to a multiple of {G}."
        )
    if model_cfg.train_type not in TRAIN_TYPES:
        raise ConfigError(f"--train_type {model_cfg.train_type!r}: choose one of {', '.join(TRAIN_TYPES)}.")
    if model_cfg.train_type == "lora":
        if model_cfg.lora_rank < 1 or model_cfg.lora_alpha <= 0:
            raise ConfigError(f"--lora_rank {model_cfg.lora_rank} / --lora_alpha {model_cfg.lora_alpha}: both must be positive.")
        if not 0 <= model_cfg.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout {model_cfg.lora_dropout}: must be in [0, 1).")
        if not model_cfg.target_modules:
            raise ConfigError("--train_type lora needs --target_modules (e.g. all-linear, llm, vision, aligner, q_proj).")
    if dist_cfg.strategy == "zero3":
        from mmgrpo.parallel.zero3 import deepspeed_config

        deepspeed_config(dist_cfg, cfg.optim, world_size, bf16=cfg.bf16)  # a contradicting JSON is an error now
