"""The dataset registry: named datasets described in YAML, resolved to `DatasetView`s of `Sample`s.

    view = resolve_dataset("shapes-color")          # a registry name (split "train")
    view = resolve_dataset("shapes-color:test")     # name:split
    view = resolve_dataset("data/train.jsonl")      # a file or a saved `datasets` folder
    mix = mix_datasets(["shapes-color:0.7", "shapes-count:0.3"], split="train", seed=0)
    len(view), view[0]                              # Sample("shapes-color/train/0", ...)

A dataset spec is `NAME[:SPLIT][:WEIGHT]`: after the name, a part that parses as a number is a
weight (used by `mix_datasets`), anything else is a split. So `a:0.7` is dataset `a` with weight
0.7, `a:test` its test split, `a:test:0.7` both; split names cannot be numbers.

Registry files are YAML holding `datasets:`, a list of entries (docs/data.md has the format). They
are read from, in order: the built-in `datasets_cfg/*.yaml` at the top of the mmgrpo checkout
(linked into the package as `mmgrpo/datasets_cfg`, which a wheel carries as package data), then
each file in `$MMGRPO_DATASET_REGISTRY` (os.pathsep-separated), then
`extra_files` (the CLI's `--dataset_registry FILE`). A name defined twice is an error.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmgrpo.data.augment import Augment, parse_augment
from mmgrpo.data.sample import DEFAULT_SYSTEM_PROMPT, Sample, normalize_row
from mmgrpo.errors import ConfigError, DataError

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "datasets_cfg"
ENV_VAR = "MMGRPO_DATASET_REGISTRY"
PATH_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
HUB_PREFIX = "hf:"  # --dataset hf:<repo id>[:split]: a dataset repository on the Hugging Face hub
SYNTHETIC_SPLITS = ("train", "test", "validation")  # what mmgrpo/data/synthetic.py writes
_SOURCE_KEYS = ("files", "folder", "splits", "synthetic")
_ALLOWED_KEYS = {
    "name",
    "description",
    *_SOURCE_KEYS,
    "split_column",
    "synthetic_args",
    "columns",
    "media_root",
    "system_prompt",
    "reward_funcs",
    "max_pixels",
    "max_completion_length",
    "augment",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


@dataclass
class DatasetEntry:
    """One registry entry, paths already made absolute (relative ones are relative to its YAML file)."""

    name: str
    source_file: str  # the YAML file that defined it, named in errors
    description: str = ""
    files: list[str] | None = None  # one split ("train"), or split by `split_column`
    folder: str | None = None  # a `save_to_disk` folder (its own splits) or any folder load_dataset reads
    splits: dict[str, list[str]] | None = None  # split name -> files (or folders)
    synthetic: str | None = None  # a generator in mmgrpo.data.synthetic
    synthetic_args: dict = field(default_factory=dict)
    split_column: str | None = None  # the column whose value names each row's split
    columns: dict[str, str] = field(default_factory=dict)  # source column -> schema column
    media_root: str | None = None  # default: the folder of the data file
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    reward_funcs: list[str] = field(default_factory=list)
    max_pixels: int | None = None
    max_completion_length: int | None = None  # this dataset's completion budget (None: the run's flag)
    augment: Augment | None = None  # the `augment:` block (mmgrpo/data/augment.py), training only


class DatasetView:
    """One split of one dataset: `len()`, and `view[i]` -> `Sample` (rows normalised on access)."""

    def __init__(
        self,
        name: str,
        split: str,
        rows,
        *,
        columns=None,
        media_root=None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        reward_funcs=(),
        max_pixels=None,
        description: str = "",
        row_indices: list[int] | None = None,
        augment: Augment | None = None,
        max_completion_length: int | None = None,
        source_file: str | None = None,
    ):
        self.name, self.split, self.rows = name, split, rows
        self.columns = dict(columns or {})
        self.media_root = None if media_root is None else os.fspath(media_root)
        self.system_prompt = system_prompt
        self.reward_funcs = list(reward_funcs)
        self.max_pixels = max_pixels
        self.description = description
        self.row_indices = row_indices  # rows of `rows` in this split (split_column), None for all
        self.augment = augment
        self.max_completion_length = max_completion_length
        self.source_file = source_file  # the registry file that defined it (None for a path)

    @property
    def completion_caps(self) -> dict[str, int]:
        """{dataset name: its own completion budget} where the registry gives one."""
        return {self.name: self.max_completion_length} if self.max_completion_length else {}

    def __len__(self) -> int:
        return len(self.rows) if self.row_indices is None else len(self.row_indices)

    def augment_for(self, index: int) -> Augment | None:
        """The augmentation of row `index` (the training DataLoader applies it)."""
        return self.augment

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}:{self.split} has {len(self)} rows, no row {index}")
        row_index = index if self.row_indices is None else self.row_indices[index]
        return normalize_row(
            self.rows[row_index],
            dataset=self.name,
            split=self.split,
            index=row_index,
            columns=self.columns,
            media_root=self.media_root,
            system_prompt=self.system_prompt,
        )

    def __iter__(self):
        return (self[index] for index in range(len(self)))

    def __repr__(self) -> str:
        return f"DatasetView({self.name}:{self.split}, {len(self)} rows)"


class MixedDataset:
    """Several datasets drawn by weight; `mix[i]` is a `Sample` of one of them (its id names which).

    The plan is fixed by the seed: each position picks a source with probability proportional to
    its weight, and each source hands out its rows in a seeded random order, cycling only when
    drawn more often than it has rows.
    """

    def __init__(
        self, sources: list[DatasetView], weights: list[float], *, size: int | None = None, seed: int = 0
    ):
        if not sources:
            raise ConfigError("a dataset mixture needs at least one dataset")
        for source in sources:
            if len(source) == 0:
                raise ConfigError(
                    f"dataset {source.name}:{source.split} is empty; remove it from the mixture"
                )
        self.sources, self.split = sources, sources[0].split
        total = float(sum(weights))
        if not math.isfinite(total):  # each weight is finite; 1e308 + 1e308 is not
            raise ConfigError(f"dataset weights {', '.join(f'{w:g}' for w in weights)} add up past the largest float: "
                              "give them on a smaller scale (only their ratios count).")
        self.weights = [w / total for w in weights]
        self.name = "+".join(source.name for source in sources)
        size = sum(len(source) for source in sources) if size is None else int(size)
        rng = np.random.default_rng(seed)
        self.source_ids = rng.choice(len(sources), size=size, p=self.weights)  # [size]
        self.row_ids = np.zeros(size, dtype=np.int64)  # [size]
        for k, source in enumerate(sources):
            positions = np.flatnonzero(self.source_ids == k)
            epochs = max(1, math.ceil(len(positions) / len(source)))
            order = np.concatenate([rng.permutation(len(source)) for _ in range(epochs)])
            self.row_ids[positions] = order[: len(positions)]
        self.reward_funcs = list(dict.fromkeys(f for source in sources for f in source.reward_funcs))
        pixel_limits = [source.max_pixels for source in sources if source.max_pixels]
        self.max_pixels = min(pixel_limits) if pixel_limits else None
        self.system_prompt = None  # each source applies its own

    @property
    def completion_caps(self) -> dict[str, int]:
        """{dataset name: its own completion budget} for the sources whose registry entry gives one."""
        return {name: cap for source in self.sources for name, cap in source.completion_caps.items()}

    def __len__(self) -> int:
        return len(self.source_ids)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(f"mixture {self.name} has {len(self)} rows, no row {index}")
        return self.sources[int(self.source_ids[index])][int(self.row_ids[index])]

    def augment_for(self, index: int) -> Augment | None:
        """The augmentation of the dataset that row `index` comes from."""
        return self.sources[int(self.source_ids[index])].augment

    def __iter__(self):
        return (self[index] for index in range(len(self)))

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}:{s.split}:{w:.2f}" for s, w in zip(self.sources, self.weights))
        return f"MixedDataset({parts}; {len(self)} rows)"


def parse_spec(spec: str) -> tuple[str, str | None, float | None]:
    """Split `NAME[:SPLIT][:WEIGHT]`; a number after a colon is a weight, anything else a split.

    >>> parse_spec("a"), parse_spec("a:test"), parse_spec("a:0.7"), parse_spec("a:test:2")
    (('a', None, None), ('a', 'test', None), ('a', None, 0.7), ('a', 'test', 2.0))
    >>> parse_spec("hf:lmms-lab/ChartQA:test:0.5")  # a hub dataset: NAME is hf:<repo id>
    ('hf:lmms-lab/ChartQA', 'test', 0.5)
    """
    if os.path.exists(spec):
        return spec, None, None
    if spec.startswith(HUB_PREFIX) and len(spec) > len(HUB_PREFIX):
        name, split, weight = parse_spec(spec[len(HUB_PREFIX):])
        return HUB_PREFIX + name, split, weight
    name, *rest = spec.split(":")
    split = weight = None
    if rest and _is_number(rest[-1]):
        weight = float(rest.pop())
        if not weight > 0 or math.isinf(weight):
            raise ConfigError(f"dataset spec {spec!r}: the weight must be a positive number")
    if len(rest) > 1 or (rest and not rest[0]) or not name:
        raise ConfigError(f"dataset spec {spec!r} is not of the form NAME[:SPLIT][:WEIGHT]")
    if rest:
        split = rest[0]
    return name, split, weight


def load_registry(extra_files=(), *, include_builtin: bool = True) -> dict[str, DatasetEntry]:
    """All registry entries by name: built-in files, then $MMGRPO_DATASET_REGISTRY, then `extra_files`."""
    files = sorted(BUILTIN_DIR.glob("*.yaml")) if include_builtin and BUILTIN_DIR.is_dir() else []
    files += [Path(p) for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p.strip()]
    files += [Path(p) for p in (extra_files or ())]
    entries: dict[str, DatasetEntry] = {}
    for path in files:
        for entry in read_registry_file(path):
            if entry.name in entries:
                raise ConfigError(
                    f"dataset {entry.name!r} is defined in both {entries[entry.name].source_file} and "
                    f"{entry.source_file}; rename one of them"
                )
            entries[entry.name] = entry
    return entries


def read_registry_file(path: str | os.PathLike) -> list[DatasetEntry]:
    """Parse and validate one registry YAML file."""
    import yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"dataset registry file not found: {path}")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"dataset registry {path} is not valid YAML: {err}") from None
    if document is None:
        return []
    if (
        not isinstance(document, dict)
        or not isinstance(document.get("datasets"), list)
        or set(document) - {"datasets"}
    ):
        raise ConfigError(
            f"dataset registry {path}: the file must hold one key, 'datasets', a list of entries"
        )
    entries, seen = [], set()
    for position, raw in enumerate(document["datasets"]):
        entry = _parse_entry(raw, path, position)
        if entry.name in seen:
            raise ConfigError(f"dataset registry {path}: dataset {entry.name!r} is defined twice")
        seen.add(entry.name)
        entries.append(entry)
    return entries


@dataclass
class _EntryKeys:
    """The keys of one registry entry being read: an error names the file, the entry and the key;
    a path is relative to the registry file's folder (`base`)."""

    raw: dict
    where: str
    base: Path

    def bad(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}, key {key!r}: {problem}")

    def absolute(self, value, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.bad(key, f"must be a path string, got {value!r}")
        return os.fspath(self.base / Path(value).expanduser())

    def path_list(self, value, key: str) -> list[str]:
        values = value if isinstance(value, list) else [value]
        if not values:
            raise self.bad(key, "must name at least one file")
        return [self.absolute(v, key) for v in values]


def _parse_entry(raw, path: Path, position: int) -> DatasetEntry:
    """One `datasets:` entry of registry file `path`, every key checked (the first bad one is a ConfigError)."""
    where = f"dataset registry {path}, entry #{position}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping with at least 'name' and a data source")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"{where}: key 'name' must be a string of letters, digits, '.', '_', '-', '/' (no ':'), got {name!r}"
        )
    where = f"dataset registry {path}, entry {name!r}"
    unknown = sorted(set(raw) - _ALLOWED_KEYS)
    if unknown:
        raise ConfigError(f"{where}, key {unknown[0]!r}: unknown key; allowed keys: {', '.join(sorted(_ALLOWED_KEYS))}")
    sources = [key for key in _SOURCE_KEYS if raw.get(key) is not None]
    if len(sources) != 1:
        raise ConfigError(f"{where}: give exactly one of {', '.join(_SOURCE_KEYS)} (got {sources or 'none'})")
    keys = _EntryKeys(raw, where, path.parent.resolve())
    entry = DatasetEntry(name=name, source_file=os.fspath(path))
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise keys.bad("description", "must be a string")
    entry.description = description.strip()
    _read_data_source(entry, keys)
    _read_columns(entry, keys)
    _read_limits(entry, keys)
    if raw.get("augment") is not None:
        entry.augment = parse_augment(raw["augment"], where)
    return entry


def _read_data_source(entry: DatasetEntry, keys: _EntryKeys) -> None:
    """files | folder | splits | synthetic (with synthetic_args): where the rows come from."""
    raw = keys.raw
    if raw.get("files") is not None:
        entry.files = keys.path_list(raw["files"], "files")
    if raw.get("folder") is not None:
        entry.folder = keys.absolute(raw["folder"], "folder")
    if raw.get("splits") is not None:
        splits = raw["splits"]
        if not isinstance(splits, dict) or not splits:
            raise keys.bad("splits", "must map split names to files, e.g. {train: train.jsonl, test: test.jsonl}")
        for split in splits:
            if not isinstance(split, str) or _is_number(split) or ":" in split:
                raise keys.bad(
                    "splits", f"split name {split!r} must be a string that is not a number and has no ':'"
                )
        entry.splits = {split: keys.path_list(files, f"splits.{split}") for split, files in splits.items()}
    if raw.get("synthetic") is not None:
        from mmgrpo.data.synthetic import GENERATORS

        if raw["synthetic"] not in GENERATORS:
            raise keys.bad("synthetic", f"unknown generator {raw['synthetic']!r}; known: {', '.join(GENERATORS)}")
        entry.synthetic = raw["synthetic"]
        args = raw.get("synthetic_args") or {}
        allowed = {"train_size", "test_size", "validation_size", "image_size", "seed"}
        if (
            not isinstance(args, dict)
            or set(args) - allowed
            or not all(isinstance(v, int) for v in args.values())
        ):
            raise keys.bad("synthetic_args", f"must map some of {', '.join(sorted(allowed))} to integers")
        entry.synthetic_args = dict(args)
    elif raw.get("synthetic_args") is not None:
        raise keys.bad("synthetic_args", "only applies to a 'synthetic' dataset")


def _read_columns(entry: DatasetEntry, keys: _EntryKeys) -> None:
    """How rows read: split_column, columns (renames), media_root, system_prompt, reward_funcs."""
    raw = keys.raw
    if raw.get("split_column") is not None:
        if not isinstance(raw["split_column"], str) or entry.files is None:
            raise keys.bad("split_column", "must be a column name, and applies only to 'files'")
        entry.split_column = raw["split_column"]
    columns = raw.get("columns") or {}
    if not isinstance(columns, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in columns.items()
    ):
        raise keys.bad("columns", "must map source column names to schema column names, e.g. {question: query}")
    entry.columns = dict(columns)
    if raw.get("media_root") is not None:
        entry.media_root = keys.absolute(raw["media_root"], "media_root")
    if "system_prompt" in raw:
        if raw["system_prompt"] is not None and not isinstance(raw["system_prompt"], str):
            raise keys.bad("system_prompt", "must be a string (or null for no system turn)")
        entry.system_prompt = raw["system_prompt"]
    rewards = raw.get("reward_funcs") or []
    if isinstance(rewards, str):
        rewards = [rewards]
    if not isinstance(rewards, list) or not all(isinstance(r, str) for r in rewards):
        raise keys.bad("reward_funcs", "must be a list of reward names, e.g. [format, vqa_accuracy]")
    entry.reward_funcs = rewards


def _read_limits(entry: DatasetEntry, keys: _EntryKeys) -> None:
    """The dataset's own max_pixels and max_completion_length: positive integers or absent."""
    max_pixels = keys.raw.get("max_pixels")
    if max_pixels is not None and (
        not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels <= 0
    ):
        raise keys.bad("max_pixels", f"must be a positive integer, got {max_pixels!r}")
    entry.max_pixels = max_pixels
    max_completion = keys.raw.get("max_completion_length")
    if max_completion is not None and (
        not isinstance(max_completion, int) or isinstance(max_completion, bool) or max_completion <= 0
    ):
        raise keys.bad("max_completion_length", f"must be a positive number of tokens, got {max_completion!r}")
    entry.max_completion_length = max_completion


def resolve_dataset(
    spec: str, split: str = "train", *, registry: dict[str, DatasetEntry] | None = None, extra_files=(),
    media_root: str | None = None, system_prompt: str | None = None,
) -> DatasetView:
    """A `DatasetView` for a registry name, `name:split`, or a path to a data file or folder.

    A split in the spec overrides `split`; a weight in the spec is ignored here (see `mix_datasets`).
    media_root (--media_root): where a data file's relative media paths point (default: the file's folder;
    a registry entry keeps its own). system_prompt (--system): every row's system turn where the row has
    none of its own, in place of the dataset's.
    """
    view = _resolve(spec, split, registry, extra_files, media_root)
    if system_prompt is not None:
        view.system_prompt = system_prompt or None  # --system "": no system turn
    return view


def _resolve(spec: str, split: str, registry, extra_files, media_root: str | None) -> DatasetView:
    name, spec_split, _ = parse_spec(spec)
    split = spec_split or split
    if name.startswith(HUB_PREFIX):
        view = _view_of_path(hub_dataset_folder(name[len(HUB_PREFIX):]), split)
        view.name = name[len(HUB_PREFIX):].rsplit("/", 1)[-1]  # sample ids and eval folders: the repo's name
        if media_root is not None:
            view.media_root = os.fspath(Path(media_root).expanduser().resolve())
        return view
    if _looks_like_path(name):
        if spec_split is not None and not Path(name).expanduser().is_dir():
            raise ConfigError(
                f"dataset {spec!r}: {name} is one file, with no split {spec_split!r} (a file has no splits); drop "
                f"':{spec_split}', give each split its own file, or a registry entry with 'splits' (docs/data.md)"
            )
        view = _view_of_path(Path(name), split)
        if media_root is not None:
            if not Path(media_root).expanduser().is_dir():
                raise ConfigError(f"--media_root {media_root}: no such folder (where {name}'s relative media paths point)")
            view.media_root = os.fspath(Path(media_root).expanduser().resolve())
        return view
    registry = load_registry(extra_files) if registry is None else registry
    if name not in registry:
        known = ", ".join(sorted(registry)) or "none"
        raise ConfigError(
            f"unknown dataset {name!r}; known datasets: {known} (see `mmgrpo datasets`); or give a path "
            "to a .json, .jsonl, .parquet file or a saved datasets folder, or add a registry file with "
            "--dataset_registry"
        )
    return _view_of_entry(registry[name], split)


def mix_datasets(
    specs: list[str],
    split: str = "train",
    seed: int = 0,
    *,
    size: int | None = None,
    registry: dict[str, DatasetEntry] | None = None,
    extra_files=(),
    media_root: str | None = None,
    system_prompt: str | None = None,
):
    """Datasets drawn by weight (`NAME[:SPLIT][:WEIGHT]`, default weight 1; weights need not sum to 1).

    size: rows in the mixture (default: the sum of the sources' sizes).
    A single spec without a weight returns its `DatasetView` unchanged.
    media_root, system_prompt: --media_root and --system, for each source (`resolve_dataset`).
    """
    options = {"media_root": media_root, "system_prompt": system_prompt}
    if isinstance(specs, str):
        specs = [specs]
    parsed = [parse_spec(spec) for spec in specs]
    if len(parsed) == 1 and parsed[0][2] is None and size is None:
        return resolve_dataset(specs[0], split, registry=registry, extra_files=extra_files, **options)
    registry = load_registry(extra_files) if registry is None else registry
    sources = [resolve_dataset(spec, split, registry=registry, **options) for spec in specs]
    check_distinct(sources, specs)
    weights = [1.0 if weight is None else weight for _, _, weight in parsed]
    return MixedDataset(sources, weights, size=size, seed=seed)


def check_distinct(sources: list[DatasetView], specs: list[str]) -> None:
    """ConfigError when two specs of a mixture give the same dataset and split: drawn as two
    datasets, its share of the mixture would silently double, and sample ids (which name the
    dataset) could not tell the two apart.

    >>> check_distinct([DatasetView("a", "train", []), DatasetView("a", "test", [])], ["a", "a:test"])
    """
    seen: dict[tuple[str, str], str] = {}
    for source, spec in zip(sources, specs):
        key = (source.name, source.split)
        if key in seen:
            raise ConfigError(
                f"--dataset gives {source.name} (split {source.split}) twice: {seen[key]!r} and {spec!r}; a mixture "
                f"draws each dataset once: give it once, with a weight to draw it more often (e.g. {source.name}:2), "
                "or rename one of two files that share a name"
            )
        seen[key] = spec


def describe_registry(extra_files=(), *, registry: dict[str, DatasetEntry] | None = None, on_entry=None) -> list[dict]:
    """One row per registered dataset: name, splits with sizes, modality, rewards, description.

    Sizes need the data: synthetic datasets are generated here if they are not cached yet. A
    dataset that fails to load shows its error in `splits` instead of raising.
    on_entry(name, entry): called before each dataset is read (progress).
    """
    registry = load_registry(extra_files) if registry is None else registry
    rows = []
    for name, entry in registry.items():
        if on_entry is not None:
            on_entry(name, entry)
        row = {
            "name": name,
            "splits": {},
            "modality": "?",
            "reward_funcs": entry.reward_funcs,
            "description": entry.description,
            "source_file": entry.source_file,
            "error": None,
        }
        try:
            for split in entry_splits(entry):
                view = _view_of_entry(entry, split)
                row["splits"][split] = len(view)
                if row["modality"] == "?" and len(view):
                    row["modality"] = view[0].modality
        except (DataError, ConfigError) as err:
            row["error"] = str(err)
        rows.append(row)
    return rows


def print_registry(console=None, extra_files=()) -> None:
    """Print `describe_registry()` as a rich table (the `mmgrpo datasets` command)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    with console.status("reading the registry") as status:
        def reading(name, entry):
            made = " (synthetic: its images are generated on the first read, then cached)" if entry.synthetic else ""
            status.update(f"reading {name}{made}")

        rows = describe_registry(extra_files, on_entry=reading)
    described = []
    for row in rows:
        splits = row["error"] or ", ".join(f"{split} {size}" for split, size in row["splits"].items())
        described.append((row["name"], splits, row["modality"], ", ".join(row["reward_funcs"]), row["description"]))
    if console.width < 120:  # a table would fold its description one word per line: one block per dataset
        for name, splits, modality, rewards, description in described:
            console.print(f"[bold]{escape(name)}[/bold]  {escape(modality)}  {escape(splits)}", soft_wrap=True)
            console.print(f"  rewards: {escape(rewards)}", soft_wrap=True)
            if description:
                console.print(f"  {escape(description)}", soft_wrap=True)
        return
    table = Table(title="mmgrpo datasets", show_lines=False)
    for column in ("name", "splits (rows)", "modality", "reward_funcs", "description"):
        table.add_column(column, overflow="fold")
    for cells in described:
        table.add_row(*(escape(cell) for cell in cells))  # "[x1, y1]" is text, not rich markup
    console.print(table)


def entry_splits(entry: DatasetEntry) -> list[str]:
    """The split names of a registry entry (reads the data only for `split_column` and folders)."""
    if entry.synthetic:
        return list(SYNTHETIC_SPLITS)
    if entry.splits:
        return list(entry.splits)
    if entry.split_column:
        from mmgrpo.data.loaders import load_rows

        rows = load_rows(entry.files)
        _check_split_column(rows, entry)
        return list(dict.fromkeys(str(value) for value in rows[entry.split_column]))
    if entry.folder:
        from mmgrpo.data.loaders import folder_splits

        return folder_splits(entry.folder)
    return ["train"]


def _view_of_entry(entry: DatasetEntry, split: str) -> DatasetView:
    from mmgrpo.data.loaders import load_rows

    row_indices = None
    if entry.synthetic:
        from mmgrpo.data.synthetic import synthetic_dataset_dir

        folder = synthetic_dataset_dir(entry.synthetic, **entry.synthetic_args)
        if split not in SYNTHETIC_SPLITS:
            raise ConfigError(f"dataset {entry.name!r} has no split {split!r}; it has {', '.join(SYNTHETIC_SPLITS)}")
        rows, media_root = load_rows(folder / f"{split}.jsonl"), folder
    elif entry.splits:
        if split not in entry.splits:
            raise ConfigError(
                f"dataset {entry.name!r} ({entry.source_file}) has no split {split!r}; it has {', '.join(entry.splits)}"
            )
        files = entry.splits[split]
        rows, media_root = load_rows(files), _folder_of(files[0])
    elif entry.folder:
        known = entry_splits(entry)
        if split not in known:
            raise ConfigError(
                f"dataset {entry.name!r} ({entry.source_file}) has no split {split!r}; it has {', '.join(known)}"
            )
        rows, media_root = load_rows(entry.folder, split=split), entry.folder
    else:
        rows, media_root = load_rows(entry.files), _folder_of(entry.files[0])
        if entry.split_column:
            _check_split_column(rows, entry)
            row_indices = [i for i, value in enumerate(rows[entry.split_column]) if str(value) == split]
            if not row_indices:
                known = ", ".join(dict.fromkeys(str(v) for v in rows[entry.split_column]))
                raise ConfigError(
                    f"dataset {entry.name!r} has no rows of split {split!r}; its splits: {known}"
                )
        elif split != "train":
            raise ConfigError(
                f"dataset {entry.name!r} ({entry.source_file}) has one split, train; to have {split!r}, "
                "give 'splits' or 'split_column' in its registry entry"
            )
    return DatasetView(
        entry.name,
        split,
        rows,
        columns=entry.columns,
        media_root=entry.media_root or media_root,
        system_prompt=entry.system_prompt,
        reward_funcs=entry.reward_funcs,
        max_pixels=entry.max_pixels,
        description=entry.description,
        row_indices=row_indices,
        augment=entry.augment,
        max_completion_length=entry.max_completion_length,
        source_file=entry.source_file,
    )


def hub_dataset_folder(repo_id: str) -> Path:
    """The local folder of a hub dataset repository: its snapshot in the HF cache (huggingface_hub's own
    lookup: HF_HUB_CACHE, HF_HOME), downloaded first when online and not cached. Offline and not cached:
    one line with the command that downloads it."""
    from huggingface_hub import snapshot_download

    from mmgrpo.hub import hub_cache_dir, hub_offline

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", cache_dir=hub_cache_dir(), local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid id
        pass
    hint = f"download it with `hf download {repo_id} --repo-type dataset`"
    if hub_offline():
        raise ConfigError(f"dataset hf:{repo_id} is not downloaded: not in the HF cache ({hub_cache_dir()}) "
                          f"and HF_HUB_OFFLINE is set; {hint}")
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", cache_dir=hub_cache_dir()))
    except Exception as err:  # no such repository, no network: one line
        raise ConfigError(f"dataset hf:{repo_id}: cannot be downloaded ({type(err).__name__}); check the id, or {hint} "
                          "where the hub is reachable") from None


def _view_of_path(path: Path, split: str) -> DatasetView:
    from mmgrpo.data.loaders import load_rows

    path = path.expanduser()
    folder_split = split if path.is_dir() else None
    rows = load_rows(path, split=folder_split)
    media_root = path if path.is_dir() else path.parent
    name = path.name if path.is_dir() else path.stem
    return DatasetView(name, split, rows, media_root=media_root.resolve())


def _check_split_column(rows, entry: DatasetEntry) -> None:
    if entry.split_column not in rows.column_names:
        raise ConfigError(
            f"dataset registry {entry.source_file}, entry {entry.name!r}, key 'split_column': the data has no "
            f"column {entry.split_column!r} (it has {', '.join(rows.column_names)})"
        )


def _folder_of(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(path)


def _looks_like_path(name: str) -> bool:
    return (
        os.path.exists(name)
        or name.lower().endswith(PATH_SUFFIXES)
        or name.startswith(("/", "./", "../", "~"))
    )


def _is_number(text) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True
