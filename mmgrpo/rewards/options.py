"""Options of named rewards: `--reward_kwargs` binds keyword options to a reward by its name.

A reward's options are its keyword-only parameters with defaults (`cosine_max_len`,
`repetition_n_grams`, ...). `--reward_kwargs` is JSON mapping a reward name (as given to
`--reward_funcs`) to its options; the run fills `max_completion_length` for a reward that takes it.

    >>> from mmgrpo.rewards.repetition import repetition
    >>> bound = bind_options(repetition, "repetition", {"repetition_n_grams": 2})
    >>> bound(["go go go"]), bound.reward_name
    ([-0.5], 'repetition')
    >>> reward_options(repetition)
    ['repetition_max_penalty', 'repetition_n_grams']
"""

from __future__ import annotations

import functools
import inspect
import json

from mmgrpo.errors import ConfigError


def reward_options(func) -> list[str]:
    """The keyword-only parameters of a reward: what --reward_kwargs may set for it."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return sorted(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def parse_reward_kwargs(value) -> dict[str, dict]:
    """--reward_kwargs as {reward name: {option: value}}: a JSON string, or a mapping (YAML).

    >>> parse_reward_kwargs('{"cosine": {"cosine_max_len": 512}}')
    {'cosine': {'cosine_max_len': 512}}
    """
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--reward_kwargs is not valid JSON ({exc.msg} at character {exc.pos}); give e.g. "
                """'{"cosine": {"cosine_max_len": 512}}'"""
            ) from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError(
            """--reward_kwargs must map reward names to option objects, e.g. '{"repetition": {"repetition_n_grams": 4}}'"""
        )
    return value


def bind_options(func, name: str, options: dict, run_defaults: dict | None = None):
    """`func` with its options bound; an option it does not take is a ConfigError listing those it does.

    `run_defaults` (e.g. `max_completion_length`) are bound only where the reward takes them and
    the user gave no value.
    """
    accepted = reward_options(func)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"--reward_kwargs for reward {name!r}: unknown option(s) {', '.join(unknown)}. "
            f"It takes: {', '.join(accepted) or 'no options'}."
        )
    bound = {key: value for key, value in (run_defaults or {}).items() if key in accepted}
    bound.update(options)
    if not bound:
        return func
    wrapped = functools.partial(func, **bound)
    wrapped.reward_name = getattr(func, "reward_name", name)
    return wrapped
