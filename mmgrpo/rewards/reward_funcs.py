"""The reward registry, plugin loading, and `compute_rewards`, which the engine calls once a step.

A reward is a plain function `f(completions: list[str], **columns) -> list[float | None]`: one
value per completion, None to skip that sample for this reward. Columns are lists aligned with
completions (`solution`, `sample_id`, `to_image_box`, and every other dataset column).

    >>> @register_reward("doc_is_short")
    ... def is_short(completions, **columns):
    ...     return [float(len(c) < 10) for c in completions]
    >>> get_reward("doc_is_short") is is_short
    True
    >>> per_func, total = compute_rewards(["doc_is_short", is_short], [1.0, 0.5], ["ok", "far too long"], {})
    >>> per_func.tolist(), total.tolist()
    ([[1.0, 0.0], [1.0, 0.0]], [1.5, 0.0])
    >>> REWARDS.unregister("doc_is_short")  # (keeps the registry as it was for other tests)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

from mmgrpo.errors import ConfigError, RewardError
from mmgrpo.registry import Registry, import_plugin
from mmgrpo.rewards.timeout import RewardTimeout, call_with_timeout

logger = logging.getLogger("mmgrpo.rewards")

RewardFunc = Callable[..., list]


def _load_builtins() -> None:
    # The built-in rewards register themselves when the package is imported.
    import mmgrpo.rewards  # noqa: F401


REWARDS = Registry("reward", flag="--reward_funcs", load=_load_builtins)
PLUGIN_HINT = "For your own reward pass 'path/to/file.py:function_name'."
_WARNED: set[str] = set()  # warnings already logged (once per reward and kind)
# The largest reward magnitude accepted. Rewards live in float32 (1e300 would become inf there) and are
# weighted and summed; anything near this is a bug (a count of bytes, an unnormalised log-likelihood).
MAX_REWARD = 1e6


def register_reward(name: str):
    """Decorator: register a reward under `name` (what `--reward_funcs` takes).

    A second registration under the same name is a ConfigError, never a silent override.
    """

    def decorator(func: RewardFunc) -> RewardFunc:
        if not callable(func):
            raise ConfigError(f"reward '{name}' must be a function, got {type(func).__name__}")
        REWARDS.register(name, func)
        func.reward_name = name
        return func

    return decorator


def reward_names() -> list[str]:
    """Names of the registered rewards, sorted."""
    return REWARDS.names()


def get_reward(spec: str | RewardFunc) -> RewardFunc:
    """A reward function from a registered name or a `path/to/file.py:function` plugin.

    A callable is returned unchanged. The plugin file is executed once as a module (so it may
    import anything and may itself use `@register_reward`); the function need not be registered.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a reward is a registered name or 'path/to/file.py:function', got {spec!r}")
    spec = spec.strip()
    if spec not in REWARDS and (":" in spec or spec.endswith(".py")):
        return _load_plugin(spec)
    return REWARDS.get(spec, hint=PLUGIN_HINT)


def reward_name(func: RewardFunc) -> str:
    """The name a reward is logged and reported under."""
    return getattr(func, "reward_name", None) or getattr(func, "__name__", None) or repr(func)


def _load_plugin(spec: str) -> RewardFunc:
    path, sep, func_name = spec.rpartition(":")
    if not sep or not path or not func_name:
        raise ConfigError(
            f"reward plugin '{spec}' must be 'path/to/file.py:function_name' "
            "(the file path, a colon, then the function defined in it)"
        )
    if not path.endswith(".py"):
        raise ConfigError(
            f"reward plugin '{spec}': '{path}' is not a .py file; write 'path/to/file.py:{func_name}'"
        )
    module = import_plugin(path, "reward plugin")
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"reward plugin '{spec}': {path} defines no function '{func_name}'. "
            f"Functions it defines: {', '.join(found) or 'none'}"
        )
    if getattr(func, "reward_name", None) is None:
        try:
            func.reward_name = func_name
        except AttributeError:  # e.g. a bound method or a C function
            pass
    return func


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


def _sample_label(index: int, columns: dict) -> str:
    ids = columns.get("sample_id")
    if isinstance(ids, (list, tuple)) and index < len(ids):
        return f"sample {index} (id {ids[index]!r})"
    return f"sample {index}"


def _to_float(value, name: str, index: int, columns: dict, on_error: str = "raise") -> float:
    """A reward value as a float; None becomes NaN (skipped). A NaN, an inf or a magnitude over MAX_REWARD
    is a RewardError naming the reward and the sample (with on_error="none": skipped, with a warning once); anything
    else non-numeric is always a RewardError."""
    if value is None:
        return math.nan
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward '{name}' returned {value!r} for {_sample_label(index, columns)}; "
            "a reward returns a float (or None to skip the sample)"
        ) from None
    if not math.isfinite(number) or abs(number) > MAX_REWARD:
        message = (
            f"reward '{name}' returned {number} for {_sample_label(index, columns)}; a reward must be a finite "
            f"number within +-{MAX_REWARD:g} (return None to skip a sample); --reward_errors none skips such "
            "values with a warning"
        )
        if on_error == "raise":
            raise RewardError(message)
        _warn_once(f"nonfinite:{name}", message + " [warned once; later ones are skipped silently]")
        return math.nan  # skipped: never trained on
    return number


def _timed_out(name: str, n: int, columns: dict, timeout: float, on_error: str, what: str = "a batch of") -> list:
    """A call past --reward_timeout: a RewardError, or (on_error="none") None for each sample."""
    message = (
        f"reward '{name}' did not return within --reward_timeout {timeout:g} s on {what} {n} completion(s) "
        f"(first: {_sample_label(0, columns)}); it may be stuck (a network call, an endless loop). Fix it or raise "
        "--reward_timeout; --reward_errors none scores such calls None (skipped) with a warning"
    )
    if on_error == "raise":
        raise RewardError(message)
    _warn_once(f"timeout:{name}", message + " [warned once; later timeouts are skipped silently]")
    return [None] * n


def _no_exit(func: RewardFunc, name: str) -> RewardFunc:
    """`func`, with a SystemExit it raises (sys.exit, exit()) turned into a RewardError naming it: a reward
    must never end the run (and `--reward_errors none` does not skip it: it is a bug, not a bad sample)."""

    def call(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except SystemExit as exc:
            raise _RewardExit(
                f"reward '{name}' called sys.exit({exc.code!r}) (raised SystemExit); a reward must return its "
                "values (or raise an exception for a sample it cannot score), never end the program"
            ) from None

    return call


class _RewardExit(BaseException):  # noqa: N818 (passes the reward's batch-then-sample retry untouched)
    pass


def _call_one_reward(
    func: RewardFunc, completions: list[str], columns: dict, on_error: str, timeout: float | None = None
) -> list[float]:
    """Run one reward on the batch; on an exception, rerun sample by sample to name the culprit.

    Each call is limited to `timeout` seconds (mmgrpo/rewards/timeout.py); the sample-by-sample
    reruns share one more `timeout`.
    """
    name = reward_name(func)
    n = len(completions)
    func = _no_exit(func, name)
    try:
        values = call_with_timeout(func, (completions,), columns, timeout=timeout, name=name)
    except RewardTimeout:
        values = _timed_out(name, n, columns, timeout, on_error)
    except Exception as batch_exc:
        values = []
        deadline = time.monotonic() + timeout if timeout else None
        for i in range(n):
            one_columns = {k: v[i : i + 1] for k, v in columns.items()}
            try:
                left = None if deadline is None else max(0.01, deadline - time.monotonic())
                one = call_with_timeout(func, (completions[i : i + 1],), one_columns, timeout=left, name=name)
                if one is None or len(one) != 1:
                    raise ValueError(f"returned {one!r} for a batch of one")
                values.append(one[0])
            except RewardTimeout:
                values.extend(_timed_out(name, n - i, {k: v[i:] for k, v in columns.items()}, timeout, on_error,
                                         "samples rerun one by one after the batch raised:"))
                break
            except Exception as exc:
                message = (
                    f"reward '{name}' raised on {_sample_label(i, columns)}: {type(exc).__name__}: {exc} "
                    f"(columns given: {', '.join(sorted(columns)) or 'none'}). Fix the reward or the dataset "
                    "column it reads; --reward_errors none scores such samples None (skipped) with a warning"
                )
                if on_error == "raise":
                    raise RewardError(message) from exc
                _warn_once(f"raised:{name}", message + " [warned once; later failures are skipped silently]")
                values.append(None)
        if all(v is not None for v in values) and on_error == "raise":
            # Each sample alone works: the failure depends on the batch as a whole.
            raise RewardError(
                f"reward '{name}' raised on a batch of {n} but not on any sample alone: "
                f"{type(batch_exc).__name__}: {batch_exc}"
            ) from batch_exc
    if values is None or not hasattr(values, "__len__"):
        raise RewardError(
            f"reward '{name}' returned {type(values).__name__}; it must return a list, one value per completion"
        )
    if len(values) != n:
        raise RewardError(
            f"reward '{name}' returned {len(values)} values for {n} completions; it must return one "
            "value per completion (None to skip one)"
        )
    return [_to_float(v, name, i, columns, on_error) for i, v in enumerate(values)]


def compute_rewards(
    funcs: Sequence[RewardFunc | str],
    weights: Sequence[float] | None,
    completions: list[str],
    columns: dict[str, list] | None = None,
    *,
    on_error: str = "raise",
    timeout: float | None = None,
):
    """Run every reward on a batch and combine them.

    Returns `(per_func, total)`, float32 torch tensors:
    - `per_func` [num_funcs, N]: each reward's values, NaN where a reward returned None
      (or, with `on_error="none"`, raised);
    - `total` [N]: `sum_f weight_f * reward_f` over the rewards that returned a value for that
      sample (None counts as absent, as TRL's nansum). A sample no reward scored gets 0.0 and a
      warning (once); `per_func[:, i].isnan().all()` tells the caller which samples those are.

    `weights` None means 1.0 each. `columns` are lists aligned with `completions`; a `sample_id`
    column, when present, is named in errors. A reward that raises is a RewardError naming the
    reward, the sample and the exception; `on_error="none"` instead logs a warning once per
    reward and scores the failing samples None. A NaN or inf value is an error the same way
    (never a reward to train on). `timeout` (seconds, --reward_timeout) limits each reward call:
    past it, an error, or with `on_error="none"` None for that call's samples
    (mmgrpo/rewards/timeout.py says how a stuck call is stopped). A reward returning the wrong
    number of values is always a RewardError.

    >>> def half(completions, **columns):
    ...     return [0.5 if c else None for c in completions]
    >>> per_func, total = compute_rewards([half, "answer_format"], [2.0, 1.0], ["<answer>x</answer>", ""], {})
    >>> per_func.tolist()
    [[0.5, nan], [1.0, 0.0]]
    >>> total.tolist()
    [2.0, 0.0]
    """
    import torch

    if on_error not in ("raise", "none"):
        raise ConfigError(f"on_error must be 'raise' or 'none', got {on_error!r}")
    funcs = [get_reward(f) for f in funcs]
    if not funcs:
        raise ConfigError(
            "no reward functions given; pass at least one, e.g. --reward_funcs format vqa_accuracy"
        )
    weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(funcs):
        raise ConfigError(
            f"{len(weights)} reward weights for {len(funcs)} reward functions "
            f"({', '.join(reward_name(f) for f in funcs)}); give one weight per function"
        )
    completions = list(completions)
    columns = dict(columns or {})
    n = len(completions)
    for key, column in columns.items():
        if not isinstance(column, (list, tuple)) or len(column) != n:
            length = len(column) if hasattr(column, "__len__") else type(column).__name__
            raise ValueError(
                f"reward column '{key}' must be a list of {n} values (one per completion), got {length}"
            )
        columns[key] = list(column)

    # each reward gets its own lists: one that rewrites them in place cannot change what the next one scores
    try:
        scores = [
            _call_one_reward(f, list(completions), {k: list(v) for k, v in columns.items()}, on_error, timeout)
            for f in funcs
        ]
    except _RewardExit as exc:
        raise RewardError(str(exc)) from None
    per_func = torch.tensor(scores, dtype=torch.float32).reshape(len(funcs), n)  # [num_funcs, N]
    weight = torch.tensor(weights, dtype=torch.float32).unsqueeze(1)  # [num_funcs, 1]
    total = (per_func * weight).nansum(dim=0)  # [N]
    unscored = per_func.isnan().all(dim=0)  # [N]
    if unscored.any():
        first = int(unscored.nonzero()[0])
        _warn_once(
            "unscored",
            f"no reward returned a value for {int(unscored.sum())} of {n} samples (first: "
            f"{_sample_label(first, columns)}); they get total reward 0.0. [warned once]",
        )
    return per_func, total
