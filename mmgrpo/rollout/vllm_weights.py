"""Weights by the names vLLM loads them: the checkpoint vLLM starts from and every weight sync, both
renamed by the one rule list of the family's template (`Template.vllm_weight_names`).

    path = vllm_checkpoint(model_path, template)      # model_path, or a renamed view of it
    llm = vllm.LLM(model=path, ...)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": vllm_named(named_tensors, template)})

vLLM's model classes load a family's original Hugging Face layout (e.g. Qwen2-Audio's
`language_model.model.layers.0...`), and map some newer names themselves. transformers 5 holds some
families' weights under other names (`model.language_model.layers.0...`) and saves some folders in a
third form (transformers 5.19 writes Qwen2-Audio's LLM as `language_model.model.model.*` and drops
SigLIP's `vision_model.` level). Without a rename vLLM stops at start-up ("There is no module or
parameter named ...") or at the first sync.

The checkpoint: where the rules rename a tensor of the folder's safetensors files, or the template
gives vLLM another config (`Template.vllm_config`: Qwen2.5-Omni's thinker, which vLLM registers only
inside the full model), vLLM loads a view of the folder instead, written once per checkpoint under
`$MMGRPO_CACHE/vllm` (default ~/.cache/mmgrpo/vllm; safe to delete): the same files linked, the
config rewritten, and each safetensors file rewritten with the new names in its header and its
tensor bytes copied as they are (one file at a time through a buffer: the memory it takes is
bounded, the disk it takes is the weights' size). Checkpoints already in the original layout
(those on the Hub) are used as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from mmgrpo.errors import CheckpointError, ConfigError

INDEX_FILE = "model.safetensors.index.json"


def vllm_named(named_tensors: Iterable[tuple[str, torch.Tensor]], template):
    """(HF name, tensor) pairs -> (name vLLM loads, tensor), lazily (one tensor at a time)."""
    for name, tensor in named_tensors:
        yield template.vllm_weight_name(name), tensor


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}, "__metadata__": {...}}."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def renamed_names(folder: Path, template) -> dict[str, str]:
    """{name in the folder's safetensors files: name vLLM loads} for every tensor the rules rename;
    a CheckpointError where two tensors would get one name."""
    renamed, seen = {}, {}
    for file in sorted(folder.glob("*.safetensors")):
        for name in safetensors_header(file):
            if name == "__metadata__":
                continue
            new = template.vllm_weight_name(name)
            if new in seen:
                raise CheckpointError(
                    f"{folder}: the tensors {seen[new]} and {name} both become {new} under the vLLM names of "
                    f"--model_type {template.name} (its template's vllm_weight_names); keep one of them in the checkpoint."
                )
            seen[new] = name
            if new != name:
                renamed[name] = new
    return renamed


def vllm_checkpoint(model_path: str, template) -> str:
    """The folder vLLM should load: `model_path` where its tensor names and config are what vLLM loads
    (or it is not a local folder: vLLM fetches it), else a view of it (module docstring)."""
    folder = Path(model_path)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        return model_path
    renamed = renamed_names(folder, template) if template.vllm_weight_names else {}
    config = json.loads((folder / "config.json").read_text())
    vllm_config = template.vllm_config(config)
    if not renamed and vllm_config == config:
        return model_path
    from mmgrpo.models.tiny import default_cache_dir, publish_checkpoint

    files = sorted(p for p in folder.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps({
        "folder": str(folder.resolve()),
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "rules": template.vllm_weight_names,
        "config": vllm_config,
    }).encode()).hexdigest()[:12]
    target = default_cache_dir().parent / "vllm" / f"{folder.resolve().name}-{key}"
    if not (target / "config.json").exists():
        new_config = vllm_config if vllm_config != config else None
        publish_checkpoint(target, lambda tmp: _write_view(files, renamed, new_config, tmp))
    return str(target)


def _write_view(files: list[Path], renamed: dict[str, str], config: dict | None, out: Path) -> None:
    """Link `files` into `out`, but rename the tensors of the safetensors files (and their index) and
    write `config` (None: the checkpoint's own) as config.json."""
    for file in files:
        if file.suffix == ".safetensors" and renamed:
            _rename_safetensors(file, out / file.name, renamed)
        elif file.name == INDEX_FILE and renamed:
            index = json.loads(file.read_text())
            index["weight_map"] = {renamed.get(k, k): v for k, v in index["weight_map"].items()}
            (out / file.name).write_text(json.dumps(index, indent=2))
        elif file.name == "config.json" and config is not None:
            (out / file.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            os.symlink(file.resolve(), out / file.name)


def _rename_safetensors(source: Path, target: Path, renamed: dict[str, str]) -> None:
    """A copy of `source` whose header names the tensors by `renamed`; the tensor bytes are copied as
    they are (their offsets are relative to the end of the header, which may change length)."""
    with open(source, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        header = {renamed.get(name, name): entry for name, entry in header.items()}
        data = json.dumps(header, separators=(",", ":")).encode()
        data += b" " * (-len(data) % 8)  # safetensors pads its header to 8 bytes
        with open(target, "wb") as out:
            out.write(struct.pack("<Q", len(data)))
            out.write(data)
            shutil.copyfileobj(f, out, 64 << 20)


def weight_load_error(error: BaseException, template, model_path: str) -> ConfigError | None:
    """A start-up ConfigError naming the family where vLLM found weights it has no place for, else None."""
    text = str(error)
    if "no module or parameter named" not in text:
        return None
    import vllm

    return ConfigError(
        f"--use_vllm: vLLM {vllm.__version__} cannot load the weights of --model_type {template.name!r} from "
        f"{model_path}: {text.split('. The available')[0]}. The names vLLM loads are the family's original "
        "checkpoint layout; its template's vllm_weight_names rename others (docs/vllm.md, Families). Drop --use_vllm "
        "to roll out with the in-process engines."
    )
