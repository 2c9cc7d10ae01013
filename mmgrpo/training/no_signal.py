"""A run that learns nothing says so: the one-line warning when no group has had reward variance.

GRPO learns from the differences between the G completions of a prompt. When every completion of
every prompt gets the same reward, the advantages are 0, so are the loss and the gradient, and the
run spends its steps without moving; metrics.jsonl shows it only as `frac_reward_zero_std` 1.0.

    watch = NoSignalWatch(patience=5)
    message = watch.observe(metrics)   # after each step; a line to print, once per such stretch

>>> watch = NoSignalWatch(patience=2)
>>> watch.observe({"step": 1, "frac_reward_zero_std": 1.0, "reward": 0.0})
>>> watch.observe({"step": 2, "frac_reward_zero_std": 1.0, "reward": 0.0})[:49]
'steps 1-2: no group had any reward variance (ever'
>>> watch.observe({"step": 3, "frac_reward_zero_std": 1.0, "reward": 0.0}) is None  # said once per stretch
True
"""

from __future__ import annotations


class NoSignalWatch:
    """Counts the steps in a row in which every group's rewards were equal (`frac_reward_zero_std` 1)."""

    def __init__(self, patience: int = 5):
        self.patience = patience
        self.first_step: int | None = None  # of the current stretch
        self.steps = 0
        self.rewards: list[float] = []

    def observe(self, metrics: dict) -> str | None:
        """The warning when the stretch reaches `patience` steps; None otherwise (and after it was said)."""
        if metrics.get("frac_reward_zero_std", 0.0) < 1.0:
            self.first_step, self.steps, self.rewards = None, 0, []
            return None
        if self.first_step is None:
            self.first_step = metrics["step"]
        self.steps += 1
        self.rewards.append(float(metrics.get("reward", float("nan"))))
        if self.steps != self.patience:
            return None
        return self.message(metrics["step"])

    def message(self, step: int) -> str:
        rewards = sorted(set(round(r, 4) for r in self.rewards if r == r))
        seen = ", ".join(f"{r:g}" for r in rewards[:4]) + (" ..." if len(rewards) > 4 else "")
        if rewards and rewards[-1] == 0:
            likely = ("every completion scores 0: the rewards may not match what the model writes (compare --reward_funcs "
                      "with the answers in completions.jsonl; e.g. `format` wants <think>...</think><answer>...</answer>), "
                      "or the task is too hard for this model (an SFT warm start helps: mmgrpo sft)")
        else:
            likely = ("every completion of a prompt scores alike: the task may be too easy or the sampling too narrow "
                      "(raise --temperature or --num_generations), or a reward may give one value to everything")
        return (f"steps {self.first_step}-{step}: no group had any reward variance (every group's rewards were equal; "
                f"mean reward {seen}), so the advantages, loss and gradients are 0 and the policy does not change. "
                f"Likely: {likely}.")
