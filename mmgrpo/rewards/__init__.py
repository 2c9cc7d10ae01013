"""Rewards: plain functions `f(completions: list[str], **columns) -> list[float | None]`.

Built in (`--reward_funcs` names): format, answer_format, vqa_accuracy, iou, iou@0.5,
math_accuracy, exact_match, number_closeness, giou, cosine, repetition, soft_overlong. Your own: `--reward_funcs path/to/my_reward.py:my_fn`.
The engine calls `compute_rewards` once a step. See docs/rewards.md.
"""

from mmgrpo.rewards.format import answer_format_reward, format_reward, make_format_reward
from mmgrpo.rewards.iou import box_iou, giou_reward, iou_at_50_reward, iou_reward, parse_box, parse_boxes
from mmgrpo.rewards.length import cosine, soft_overlong
from mmgrpo.rewards.math import math_accuracy, math_equal
from mmgrpo.rewards.numeric import number_closeness
from mmgrpo.rewards.repetition import repetition
from mmgrpo.rewards.reward_funcs import (
    compute_rewards,
    get_reward,
    register_reward,
    reward_name,
    reward_names,
)
from mmgrpo.rewards.text import exact_match, extract_answer, make_soft_overlong, normalize_text
from mmgrpo.rewards.vqa import normalize_vqa_answer, vqa_accuracy, vqa_soft_accuracy

__all__ = [
    "answer_format_reward",
    "box_iou",
    "compute_rewards",
    "cosine",
    "exact_match",
    "extract_answer",
    "format_reward",
    "get_reward",
    "iou_at_50_reward",
    "iou_reward",
    "giou_reward",
    "reward_names",
    "make_format_reward",
    "make_soft_overlong",
    "math_accuracy",
    "math_equal",
    "normalize_text",
    "number_closeness",
    "normalize_vqa_answer",
    "parse_box",
    "parse_boxes",
    "register_reward",
    "repetition",
    "reward_name",
    "soft_overlong",
    "vqa_accuracy",
    "vqa_soft_accuracy",
]
