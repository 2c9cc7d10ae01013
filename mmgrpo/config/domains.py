"""What each flag may hold and what a resumed run may do with it, declared beside the flag.

A field of the config dataclasses (mmgrpo/config/schema.py) is declared with `flag`: its default,
the values it may take (a `Number` range or a `OneOf` tuple) and its resume kind; the docstring
under it stays its `--help`. `check_domains` walks a config once and raises the one-line
ConfigError that names the first flag outside its domain, the value, and what to give.

    beta: float = flag(0.04, at_least(0))                      # the docstring under it: its --help
    save_steps: int = flag(0, count(0), resume="operational")  # may change when a run resumes

>>> at_least(0).describe(), above(0, what="seconds").describe(), count(1).describe()
('a finite number >= 0', 'seconds > 0', 'an integer >= 1')
>>> Number(0, 1, low_open=True, what="a probability").describe()
'a probability in (0, 1]'
>>> above(0).problem("learning_rate", float("nan"))
'--learning_rate nan: give a finite number > 0.'
>>> OneOf("group", "none").problem("scale_rewards", "std")
"--scale_rewards 'std': choose one of group, none."
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from mmgrpo.errors import ConfigError

# What a resumed run does when the flag differs from its checkpoint's (mmgrpo/training/resume_flags.py):
# refused: it decides what the run computes or the order it reads data in; schedule: the learning rate
# follows the new flags' schedule from the resumed step; staleness: rollouts lag at most the new K;
# operational: how the run works, not what it computes; not_compared: where the run is.
RESUME_KINDS = ("refused", "schedule", "staleness", "operational", "not_compared")


@dataclass(frozen=True)
class Number:
    """Numbers from `low` to `high` (either may be None: unbounded), each bound closed unless open;
    `integer`: whole numbers only; `finite`: NaN and inf refused. `what` names the value in the
    message ("seconds", "a probability"); `hint` follows it in brackets ("0: off")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    finite: bool = True
    what: str | None = None
    hint: str | None = None

    def admits(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        what = self.what or ("an integer" if self.integer else "a finite number" if self.finite else "a number")
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{what} {'<' if self.high_open else '<='} {self.high}"
        return what

    def problem(self, name: str, value) -> str | None:
        """The error line for `--name value`, or None when the value is in the domain."""
        if self.admits(value):
            return None
        shown = repr(value) if isinstance(value, str) else value
        return f"--{name} {shown}: give {self.describe()}{f' ({self.hint})' if self.hint else ''}."


@dataclass(frozen=True)
class OneOf:
    """One of a fixed tuple of names."""

    choices: tuple[str, ...]

    def __init__(self, *choices: str):
        object.__setattr__(self, "choices", choices)

    def problem(self, name: str, value) -> str | None:
        if value in self.choices:
            return None
        return f"--{name} {value!r}: choose one of {', '.join(self.choices)}."


def at_least(low, **options) -> Number:
    """Numbers >= low (finite unless finite=False)."""
    return Number(low, **options)


def above(low, **options) -> Number:
    """Numbers > low (finite unless finite=False)."""
    return Number(low, low_open=True, **options)


def count(low, **options) -> Number:
    """Integers >= low."""
    return Number(low, integer=True, **options)


def flag(default=dataclasses.MISSING, domain: Number | OneOf | None = None, *, factory=None, resume: str = "refused"):
    """A config field with its domain and its resume kind (RESUME_KINDS; refused unless said otherwise).
    `factory` instead of `default` for a list."""
    if resume not in RESUME_KINDS:
        raise ValueError(f"resume={resume!r}: one of {', '.join(RESUME_KINDS)}")
    metadata = {"domain": domain, "resume": resume}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def resume_kinds(config) -> dict[str, str]:
    """{flag name: resume kind} of every field of `config` (a config class or one of its instances) and of
    its sections; a field declared without `flag` is refused.

    >>> from mmgrpo.config import TrainConfig
    >>> kinds = resume_kinds(TrainConfig)
    >>> kinds["seed"], kinds["learning_rate"], kinds["save_steps"], kinds["max_staleness"], kinds["output_dir"]
    ('refused', 'schedule', 'operational', 'staleness', 'not_compared')
    """
    config = config() if isinstance(config, type) else config
    kinds = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            kinds.update(resume_kinds(value))
        else:
            kinds[field.name] = field.metadata.get("resume", "refused")
    return kinds


def check_domains(config) -> None:
    """Every field of `config` and of its sections, once, against its declared domain: the first value
    outside it is a ConfigError naming the flag, the value and what to give. None passes where the
    field's annotation allows it (`int | None`: unset)."""
    from mmgrpo.config.flags import _scalar_type

    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            check_domains(value)
            continue
        if value is None and "None" in str(field.type):
            continue
        domain = field.metadata.get("domain") or NUMERIC_DEFAULTS.get(_scalar_type(hints[field.name])[0])
        if domain is None:
            continue
        for item in value if isinstance(value, list) else [value]:  # a list's every element
            problem = domain.problem(field.name, item)
            if problem:
                raise ConfigError(problem)


# A numeric field declared without a domain still refuses NaN, infinities and the wrong kind of number.
NUMERIC_DEFAULTS = {int: Number(integer=True), float: Number()}
