"""The run's model-backed rewards, built once at start-up: reward models, then the judge.

    rewards = build_model_rewards(cfg)   # [RewardModelReward, ..., JudgeReward]
"""

from __future__ import annotations

from mmgrpo.rewards.judge import JudgeReward
from mmgrpo.rewards.reward_model import RewardModelReward


def build_model_rewards(cfg) -> list:
    """The run's reward models (--reward_model, in order) and judge (--judge_model), loaded now so a
    checkpoint that does not fit fails at start-up."""
    algo = cfg.algo
    rewards = [
        RewardModelReward(path, device=algo.reward_model_device, batch_size=algo.reward_model_batch_size)
        for path in algo.reward_model
    ]
    if algo.judge_model:
        rewards.append(JudgeReward(
            algo.judge_model, model_type=algo.judge_model_type, device=algo.reward_model_device,
            prompt_file=algo.judge_prompt, parse=algo.judge_parse, score_max=algo.judge_score_max,
            max_new_tokens=algo.judge_max_new_tokens, batch_size=algo.reward_model_batch_size,
            vllm=judge_vllm_options(cfg) if algo.judge_use_vllm else None,
        ))
    return rewards


def judge_vllm_options(cfg) -> dict:
    """The judge's colocated vLLM engine: room for the policy's prompt and completion, the judge's
    own words and its reply; memory as the --vllm_* flags say."""
    rollout = cfg.rollout
    return dict(
        max_model_len=cfg.data.max_prompt_length + rollout.max_completion_length + cfg.algo.judge_max_new_tokens + 256,
        seed=cfg.seed, gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=rollout.vllm_kv_cache_memory_bytes,
    )
