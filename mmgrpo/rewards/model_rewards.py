"""The run's model-backed rewards, built once at start-up: reward models, then the judge.

    rewards = build_model_rewards(cfg.algo)   # [RewardModelReward, ..., JudgeReward]
"""

from __future__ import annotations

from mmgrpo.rewards.judge import JudgeReward
from mmgrpo.rewards.reward_model import RewardModelReward


def build_model_rewards(algo) -> list:
    """The run's reward models (--reward_model, in order) and judge (--judge_model), loaded now so a
    checkpoint that does not fit fails at start-up."""
    rewards = [
        RewardModelReward(path, device=algo.reward_model_device, batch_size=algo.reward_model_batch_size)
        for path in algo.reward_model
    ]
    if algo.judge_model:
        rewards.append(JudgeReward(
            algo.judge_model, model_type=algo.judge_model_type, device=algo.reward_model_device,
            prompt_file=algo.judge_prompt, parse=algo.judge_parse, score_max=algo.judge_score_max,
            max_new_tokens=algo.judge_max_new_tokens, batch_size=algo.reward_model_batch_size,
        ))
    return rewards
