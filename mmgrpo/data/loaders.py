"""Raw rows from files: JSON (a list of objects), JSON Lines, Parquet, CSV and saved `datasets` folders.

Everything goes through the Hugging Face `datasets` library, which converts a file to a
memory-mapped Arrow table once (cached under HF_DATASETS_CACHE) and hands rows out one at a time:

    rows = load_rows("data/train.jsonl")
    len(rows), rows[0]          # a dict per row, media still as references

Media columns of a saved folder (`datasets.Image`, `Audio`, `Video` features) are read with
decode=False, so a row holds `{"bytes": ..., "path": ...}` and nothing is decoded at load time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

from mmgrpo.errors import DataError

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(paths: str | os.PathLike | list, *, split: str | None = None):
    """Rows of one or more files (concatenated, in order) as a `datasets.Dataset`.

    paths: a .json / .jsonl / .parquet / .csv file, a folder written by `save_to_disk` (or any
        folder `datasets.load_dataset` reads), or a list of these.
    split: which split of a folder holding several (default: its only split, else "train").
    """
    if isinstance(paths, (list, tuple)):
        if not paths:
            raise DataError("no dataset files given")
        parts = [load_rows(path, split=split) for path in paths]
        if len(parts) == 1:
            return parts[0]
        import datasets

        try:
            return datasets.concatenate_datasets(parts)
        except (ValueError, TypeError) as err:
            names = ", ".join(os.fspath(path) for path in paths)
            raise DataError(
                f"dataset files {names} cannot be read as one table ({err}); give them the same columns"
            ) from None
    path = Path(paths).expanduser()
    if not path.exists():
        raise DataError(f"dataset file not found: {path}; check the path")
    if path.is_dir():
        return _without_media_decoding(_load_folder(path, split))
    if path.suffix.lower() not in FILE_FORMATS:
        raise DataError(
            f"cannot read dataset file {path}: unknown type {path.suffix!r}; "
            f"use one of {', '.join(FILE_FORMATS)} or a folder written by datasets' save_to_disk"
        )
    if path.stat().st_size == 0:
        raise DataError(f"dataset file {path} is empty")
    if FILE_FORMATS[path.suffix.lower()] in ("json", "csv"):
        check_utf8(path)  # datasets would load the bytes as they are and fail at the row, in a worker
    return _without_media_decoding(_load_file(path))


def check_utf8(path: Path, chunk_size: int = 1 << 20) -> None:
    """DataError naming the line and column of the first text that is not UTF-8.

    A fast pass decodes 1 MiB chunks; only when it fails is the file read line by line to say
    where (a UTF-8 character never holds a newline byte, so lines decode on their own).
    """
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}, line {number}: not valid UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1}); "
                    "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line"
                ) from None


def folder_splits(path: str | os.PathLike) -> list[str]:
    """The split names of a dataset folder (a single saved `Dataset` has one: "train")."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise DataError(f"dataset folder not found: {path}; check the path")
    if (path / "dataset_dict.json").exists():  # written by DatasetDict.save_to_disk
        try:
            return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"dataset folder {path}: unreadable dataset_dict.json ({err})") from None
    if (path / "state.json").exists():
        return ["train"]
    import datasets

    try:
        with _quiet():
            loaded = datasets.load_dataset(str(path))
    except Exception as err:
        raise DataError(f"cannot read dataset folder {path}: {_root_cause(err)}") from None
    return list(loaded) if isinstance(loaded, datasets.DatasetDict) else ["train"]


def _load_file(path: Path):
    import datasets

    builder = FILE_FORMATS[path.suffix.lower()]
    try:
        with _quiet():
            return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:
        if builder == "json":
            _raise_for_bad_json(path)
        raise DataError(
            f"cannot read dataset file {path}: {_root_cause(err)}; check that every row is an "
            "object with the same columns, each of one type"
        ) from None


def _load_folder(path: Path, split: str | None):
    import datasets

    saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    try:
        with _quiet():
            loaded = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    except Exception as err:
        raise DataError(f"cannot read dataset folder {path}: {_root_cause(err)}") from None
    if isinstance(loaded, datasets.Dataset):
        return loaded
    names = list(loaded)
    if split is None:
        split = names[0] if len(names) == 1 else "train"
    if split not in loaded:
        raise DataError(f"dataset folder {path} has no split {split!r}; it has {', '.join(names)}")
    return loaded[split]


def _raise_for_bad_json(path: Path) -> None:
    """Find the line that breaks a JSON / JSON Lines file and raise a DataError naming it."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):  # one JSON array of objects
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {err.lineno}: invalid JSON ({err.msg}); fix that line") from None
        for position, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{path}: element {position} is a {type(row).__name__}, not an object")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}, line {number}: invalid JSON ({err.msg}); fix or remove that line "
                "(JSON Lines holds one object per line)"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{path}, line {number}: a JSON {type(row).__name__}, not an object; one object per line"
            )


def _without_media_decoding(dataset):
    """The same rows with every decodable feature (Image, Audio, Video ...) set to decode=False."""

    import datasets

    media_features = tuple(
        getattr(datasets, name) for name in ("Image", "Audio", "Video") if hasattr(datasets, name)
    )

    def undecoded(feature):
        if isinstance(feature, media_features) and feature.decode:  # not Json: that one must stay decoded
            return dataclasses.replace(feature, decode=False)
        if isinstance(feature, dict):
            return {key: undecoded(value) for key, value in feature.items()}
        if hasattr(feature, "feature"):  # List / Sequence / LargeList
            return dataclasses.replace(feature, feature=undecoded(feature.feature))
        return feature

    features = dataset.features
    changed = {name: undecoded(feature) for name, feature in features.items()}
    for name, feature in changed.items():
        if feature != features[name]:
            with _quiet():
                dataset = dataset.cast_column(name, feature)
    return dataset


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"


@contextlib.contextmanager
def _quiet():
    """Silence datasets' progress bars and error logs (we raise our own message instead)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from datasets.utils import logging as ds_logging

    verbosity, bars_off = ds_logging.get_verbosity(), are_progress_bars_disabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL + 10)
    disable_progress_bars()
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if not bars_off:
            enable_progress_bars()
