"""Format rewards: 1.0 when the WHOLE completion is `<think>...</think> <answer>...</answer>`.

The community definition is the regex `<think>.*?</think>\\s*<answer>.*?</answer>` matched
against the whole completion (DOTALL). Ours matches the whole stripped completion too, and is
stricter in two ways that close reward hacks:
- the answer must contain something other than whitespace (`<answer> </answer>` scores 0.0);
- neither part may contain another think/answer tag, so a second `<answer>` or a nested
  `<think>` fails (the lazy `.*?` of the community regex lets `</answer><answer>` slip inside).
The think part may be empty (`<think></think>`), as models with thinking switched off emit it.
"""

from __future__ import annotations

import re

from mmgrpo.rewards.reward_funcs import register_reward


def make_format_reward(think: str | None = "think", answer: str = "answer"):
    """A format reward for your own tags; `think=None` requires only the answer part.

    >>> reward = make_format_reward(think="reasoning", answer="final")
    >>> reward(["<reasoning>a</reasoning>\\n<final>b</final>", "<think>a</think><answer>b</answer>"])
    [1.0, 0.0]
    """
    tags = [t for t in (think, answer) if t]
    if not answer or any(not re.fullmatch(r"[\w:.-]+", t) for t in tags):
        raise ValueError(f"format tags must be non-empty words, got think={think!r} answer={answer!r}")
    # Content that contains no opening or closing tag of either kind.
    no_tags = r"(?:(?!</?(?:" + "|".join(re.escape(t) for t in tags) + r")>).)*"
    answer_part = f"<{answer}>(?P<answer>{no_tags})</{answer}>"
    pattern = answer_part if not think else rf"<{think}>{no_tags}</{think}>\s*{answer_part}"
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(completions: list[str], **columns) -> list[float]:
        scores = []
        for completion in completions:
            match = compiled.fullmatch(completion.strip())
            scores.append(1.0 if match and match.group("answer").strip() else 0.0)
        return scores

    format_reward.__name__ = f"format_{think}_{answer}" if think else f"format_{answer}"
    format_reward.__doc__ = f"1.0 when the whole completion matches {pattern!r} with a non-blank answer."
    return format_reward


format_reward = register_reward("format")(make_format_reward())
format_reward.__doc__ = """`format`: 1.0 when the whole completion is `<think>...</think> <answer>...</answer>`.

    >>> format_reward([
    ...     "<think>two cats</think>\\n<answer>2</answer>",   # the shape we want
    ...     "  <think>multi\\nline</think><answer>\\n2\\n</answer>\\n",  # newlines anywhere are fine
    ...     "<answer>2</answer>",                             # no think part
    ...     "Sure! <think>x</think><answer>2</answer>",       # text outside the tags
    ...     "<think>x</think><answer>2</answer> done",        # text after the answer
    ...     "<think>x</think><answer> </answer>",             # empty answer
    ...     "<think>x</think><answer>1</answer><answer>2</answer>",  # two answers
    ...     "<think>a<think>b</think></think><answer>2</answer>",    # nested think
    ... ])
    [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """

answer_format_reward = register_reward("answer_format")(make_format_reward(think=None))
answer_format_reward.__doc__ = """`answer_format`: 1.0 when the whole completion is `<answer>...</answer>`.

    For models that answer without thinking.

    >>> answer_format_reward(["<answer>2</answer>", "<think>x</think><answer>2</answer>", "<answer></answer>", "2"])
    [1.0, 0.0, 0.0, 0.0]
    """
