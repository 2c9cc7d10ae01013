"""Is a model folder whole? Cheap checks before `from_pretrained`, so that a missing, truncated or
corrupt file is one line naming it instead of a traceback from deep inside transformers.

    check_model_folder("runs/x/checkpoint-8")        # CheckpointError, or nothing

What is checked (reading headers only, a few milliseconds even for large models):
- a staging folder (`checkpoint-N.tmp`) or a checkpoint whose completeness marker says a file is
  missing or has another size than when it was saved (mmgrpo/runstate/checkpoint.py);
- every top-level `.json` file (config, tokenizer, processor, generation config, the safetensors
  index) is non-empty valid JSON;
- every `.safetensors` file's header parses and its tensors end exactly at the end of the file;
  every shard a `*.safetensors.index.json` names is there;
- with `weights=True`: a folder with `config.json` holds a weights file from_pretrained reads
  (model.safetensors, pytorch_model.bin, their indexes, or a LoRA adapter).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

from mmgrpo.errors import CheckpointError
from mmgrpo.runstate.checkpoint import MARKER, STAGING_SUFFIX, checkpoint_problem

# what from_pretrained loads weights from (a LoRA checkpoint: the adapter)
MODEL_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
WHAT_TO_DO = "re-save or copy the folder again, or load an earlier checkpoint"


def check_model_folder(path: str | os.PathLike, *, weights: bool = False) -> None:
    """Raise a one-line CheckpointError if a file of the model folder `path` is missing, truncated
    or corrupt (see the module docstring); return None when everything checked is whole.

    >>> import tempfile
    >>> scratch = tempfile.TemporaryDirectory(); folder = Path(scratch.name)  # removed with `scratch`
    >>> _ = (folder / "config.json").write_text("")
    >>> check_model_folder(folder)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mmgrpo.errors.CheckpointError: model folder ...: config.json is empty (0 bytes); re-save or copy the folder again, or load an earlier checkpoint
    """
    folder = Path(path)
    where = f"model folder {folder}"
    if folder.name.endswith(STAGING_SUFFIX):
        raise CheckpointError(f"{where} is a save that has not finished (or was killed): load {folder.name.removesuffix(STAGING_SUFFIX)} or an earlier checkpoint")
    if (folder / MARKER).is_file():
        problem = checkpoint_problem(folder)
        if problem is not None:
            raise CheckpointError(f"{where}: {problem}; {WHAT_TO_DO}")
    for file in sorted(folder.glob("*.json")):
        _check_json(file, where)
    for index in sorted(folder.glob("*.safetensors.index.json")):
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise CheckpointError(f"{where}: {index.name} names {missing[0]}, which is missing ({len(missing)} of {len(shards)} shards); {WHAT_TO_DO}")
    for file in sorted(folder.glob("*.safetensors")):
        _check_safetensors(file, where)
    for file in sorted(folder.glob("*.bin")):
        if file.stat().st_size == 0 or not zipfile.is_zipfile(file):
            raise CheckpointError(f"{where}: {file.name} is not a readable torch file (empty or truncated); {WHAT_TO_DO}")
    if weights and (folder / "config.json").is_file() and not any((folder / name).is_file() for name in MODEL_WEIGHT_FILES):
        # another .pt / .bin (a checkpoint's optimizer.pt) is no model: from_pretrained would raise an OSError
        raise CheckpointError(f"{where}: config.json but no weights file (model.safetensors); {WHAT_TO_DO}")


def _check_json(file: Path, where: str) -> None:
    size = file.stat().st_size
    if size == 0:
        raise CheckpointError(f"{where}: {file.name} is empty (0 bytes); {WHAT_TO_DO}")
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: {file.name} is not UTF-8 text (corrupt); {WHAT_TO_DO}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{where}: {file.name} is not valid JSON ({err.msg} at line {err.lineno}; truncated or corrupt); {WHAT_TO_DO}"
        ) from None


def _check_safetensors(file: Path, where: str) -> None:
    """A safetensors file is 8 bytes of header length, a JSON header, then the tensors' bytes."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        header_length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_length < 2 or 8 + header_length > size:
            raise CheckpointError(f"{where}: {file.name} is truncated or not a safetensors file ({size} bytes, no readable header); {WHAT_TO_DO}")
        try:
            header = json.loads(f.read(header_length))
            ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise CheckpointError(f"{where}: {file.name} has a corrupt header; {WHAT_TO_DO}") from None
    expected = 8 + header_length + max(ends, default=0)
    if expected != size:
        state = "truncated" if size < expected else "longer than its header says (corrupt)"
        raise CheckpointError(f"{where}: {file.name} is {state}: {size} bytes, {expected} expected; {WHAT_TO_DO}")
