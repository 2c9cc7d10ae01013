"""Flag combinations of --parallel / --deepspeed / LoRA that cannot work, checked before any
model loads (each flag's own domain, such as --parallel's names, is declared beside it in
mmgrpo/config/schema.py). Checks only: the config is not changed (`DistConfig.strategy` is the
strategy the flags name)."""

from __future__ import annotations

from mmgrpo.config import DistConfig, ModelConfig, OptimConfig
from mmgrpo.errors import ConfigError
from mmgrpo.parallel.launch import env_world_size


def validate_parallel(dist_cfg: DistConfig, model_cfg: ModelConfig, optim_cfg: OptimConfig, num_generations: int) -> None:
    """Flag combinations of --parallel / --deepspeed / LoRA that cannot work under the launched world
    size, as ConfigErrors. num_generations: --num_generations, the group each rank keeps whole."""
    requested = dist_cfg.parallel or "none"
    if dist_cfg.deepspeed and requested not in ("none", "zero3"):
        raise ConfigError(f"--deepspeed {dist_cfg.deepspeed} contradicts --parallel {requested}: DeepSpeed is --parallel zero3.")
    world_size = env_world_size()
    if world_size > 1 and dist_cfg.strategy == "none":
        raise ConfigError(
            f"{world_size} processes were launched but --parallel is none (each would train its own copy): "
            "pass --parallel fsdp2 or --parallel zero3."
        )
    if (dist_cfg.offload_optimizer or dist_cfg.offload_param) and dist_cfg.strategy == "none":
        raise ConfigError("--offload_optimizer / --offload_param need --parallel zero3 (or fsdp2 for --offload_param).")
    if dist_cfg.offload_optimizer and dist_cfg.strategy == "fsdp2":
        raise ConfigError("FSDP2 offloads parameters, gradients and optimizer state together: use --offload_param.")
    sequence = dist_cfg.sequence_parallel_size
    if sequence > 1:
        if world_size % sequence or world_size == 1:
            raise ConfigError(f"--sequence_parallel_size {sequence} does not divide the world size {world_size}: launch "
                              f"a multiple of {sequence} processes (torchrun --nproc_per_node {sequence}).")
        if dist_cfg.strategy != "fsdp2":
            raise ConfigError(f"--sequence_parallel_size {sequence} runs with --parallel fsdp2 (not {dist_cfg.strategy}).")
    per_rank = optim_cfg.per_device_train_batch_size * optim_cfg.gradient_accumulation_steps
    G = num_generations
    if world_size > 1 and per_rank % G:
        raise ConfigError(
            f"{world_size} ranks: each rank rolls out whole groups, but per_device_train_batch_size "
            f"{optim_cfg.per_device_train_batch_size} x gradient_accumulation_steps {optim_cfg.gradient_accumulation_steps} "
            f"= {per_rank} completions per rank is not a multiple of --num_generations {G}. The global batch is "
            f"{per_rank} x {world_size} ranks; raise --gradient_accumulation_steps or the batch size to a multiple of {G}."
        )
    if model_cfg.train_type == "lora" and not model_cfg.target_modules:
        raise ConfigError("--train_type lora needs --target_modules (e.g. all-linear, llm, vision, aligner, q_proj).")
