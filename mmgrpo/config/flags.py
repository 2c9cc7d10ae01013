"""Dataclasses <-> command line and YAML: the parser of `mmgrpo train` / `mmgrpo sft` is built from
their config dataclasses (mmgrpo/config/schema.py), and a config is read back from flags and `--config`.

Each leaf field becomes `--<name>` in the group of its section; the docstring under a field is its
`--help` text; `bool` flags take an optional true/false; list fields take several values; `none`
gives None where the annotation allows it. A YAML file may be nested by section or flat, and the
flags override it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path

import yaml

from mmgrpo.errors import ConfigError


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (its `--help` text). Cached: reading a class's
    source costs about 10 ms and a parser asks once per flag."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = nxt.value.value
    return docs


def _leaves(cls, prefix=()):
    """(path, field, owning class) for every non-dataclass field, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, prefix + (f.name,))
        else:
            yield prefix + (f.name,), tp, cls


def _scalar_type(tp):
    """(element parser, is_list) for a field annotation."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return _scalar_type(args[0])
    if origin is list:
        return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_optional(elem, optional: bool = True):
    def parse(text):
        if optional and text.lower() in ("none", "null"):  # "none" is a value of some str options
            return None
        return _parse_bool(text) if elem is bool else elem(text)

    return parse


def build_parser(cls, prog="mmgrpo train", description=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description or (cls.__doc__ or "").strip().splitlines()[0],
        allow_abbrev=False,  # `--learning` is an error, not silently --learning_rate
    )
    parser.add_argument("--config", help="YAML file of options (nested by section or flat); flags override it.")
    default = cls()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for path, tp, owner in _leaves(cls):
        name = path[-1]
        group = groups.setdefault(path[0] if len(path) > 1 else "run", parser.add_argument_group(path[0] if len(path) > 1 else "run"))
        elem, is_list = _scalar_type(tp)
        optional = type(None) in typing.get_args(tp)
        value = default
        for part in path:
            value = getattr(value, part)
        kwargs = dict(dest=".".join(path), metavar=name.upper(), default=argparse.SUPPRESS, help=f"{field_docs(owner).get(name, '')} (default: {value})".replace("%", "%%"))
        if is_list:
            group.add_argument(f"--{name}", nargs="*", type=_parse_optional(elem, optional), **kwargs)
        elif elem is bool:
            group.add_argument(f"--{name}", nargs="?", const=True, type=_parse_bool, **kwargs)
        else:
            group.add_argument(f"--{name}", type=_parse_optional(elem, optional), **kwargs)
    return parser


def _flatten_yaml(data: dict, cls, source: str) -> dict[str, object]:
    """Map a nested or flat YAML mapping to dotted field paths; unknown keys are errors."""
    by_name = {path[-1]: ".".join(path) for path, _, _ in _leaves(cls)}
    sections = {f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.type) or f.name in ("model", "data", "rollout", "algo", "optim", "eval", "dist")}
    out = {}
    for key, value in (data or {}).items():
        if key == "resumed":  # a run's config.yaml: its history of resumes, not an option
            continue
        if key in sections and isinstance(value, dict):
            for sub, sub_value in value.items():
                if sub not in by_name:
                    raise ConfigError(f"{source}: unknown option {key}.{sub}. Run `mmgrpo train --help` for the list.")
                out[by_name[sub]] = sub_value
        elif key in by_name:
            out[by_name[key]] = value
        else:
            raise ConfigError(f"{source}: unknown option {key!r}. Run `mmgrpo train --help` for the list.")
    return out


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def yaml_value(tp, value, where: str):
    """A `--config` YAML value as the flag would read it: `1e-6` (a string to PyYAML) a number, a
    scalar where a list is expected a one-item list, numbers for a string option their text. A value
    that cannot be read is a ConfigError naming the option (`where`), the value and what to give.

    >>> yaml_value(float, "1e-6", "learning_rate"), yaml_value(list[str], "format", "reward_funcs")
    (1e-06, ['format'])
    >>> yaml_value(int, 2.0, "max_steps"), yaml_value(bool | None, "false", "bf16")
    (2, False)
    >>> yaml_value(int, "ten", "max_steps")
    Traceback (most recent call last):
        ...
    mmgrpo.errors.ConfigError: max_steps: 'ten' is not an integer.
    """
    elem, is_list = _scalar_type(tp)
    if is_list:
        values = value if isinstance(value, list) else [value]
        return [yaml_value(elem, item, where) for item in values]
    if value is None:
        return None
    problem = ConfigError(f"{where}: {value!r} is not {_TYPE_NAMES.get(elem, elem.__name__)}.")
    if elem is bool:
        if isinstance(value, bool):
            return value
        try:
            return _parse_bool(str(value))
        except argparse.ArgumentTypeError:
            raise problem from None
    if elem in (int, float):
        if isinstance(value, bool):
            raise problem
        if isinstance(value, str):
            try:
                value = float(value) if elem is float or any(c in value.lower() for c in ".e") else int(value)
            except ValueError:
                raise problem from None
        if elem is int:
            if isinstance(value, float) and not value.is_integer():
                raise problem
            return int(value)
        return float(value)
    if elem is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _set_path(obj, dotted: str, value) -> None:
    *parents, name = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, name, value)


_REQUIRED_HINTS = {
    "model": "a checkpoint folder, a hub id (Qwen/Qwen2.5-VL-3B-Instruct, from the HF cache offline), or "
             "tiny:<family> for a tiny random model built offline (e.g. --model tiny:qwen2-vl)",
}


def config_from_namespace(cls, ns: argparse.Namespace, required: tuple[str, ...] = ()):
    """The config of parsed flags over the `--config` YAML over the defaults. `required`: dotted fields
    (`model.model`) that the flags or the YAML must set (a command's `--model`: no silent default)."""
    cfg = cls()
    from_yaml: set[str] = set()
    if getattr(ns, "config", None):
        path = Path(ns.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file.")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path}: not valid YAML ({exc}).") from None
        types = {".".join(leaf): tp for leaf, tp, _ in _leaves(cls)}
        for dotted, value in _flatten_yaml(data, cls, str(path)).items():
            if value is None and type(None) not in typing.get_args(types[dotted]):
                continue  # `max_steps: null`: the default, as leaving it out would give
            _set_path(cfg, dotted, yaml_value(types[dotted], value, f"--config {path}: {dotted.rsplit('.', 1)[-1]}"))
            from_yaml.add(dotted)
    for dotted in required:
        if dotted not in vars(ns) and dotted not in from_yaml:
            name = dotted.rsplit(".", 1)[-1]
            raise ConfigError(f"--{name} is required: {_REQUIRED_HINTS.get(name, 'give it on the command line or in --config')}.")
    for dotted, value in vars(ns).items():
        if "." in dotted or dotted in {f.name for f in dataclasses.fields(cls)}:
            _set_path(cfg, dotted, value)
    return cfg
