"""Weights by the names vLLM loads them: the checkpoint vLLM starts from and every weight sync, both
renamed by the one rule list of the family's template (`Template.vllm_weight_names`).

    path = vllm_checkpoint(model_path, template)      # model_path, or a renamed view of it
    llm = vllm.LLM(model=path, ...)
    reload_weights(llm, vllm_named(named_tensors, template))   # a sync, in place

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

Fused expert banks: where vLLM loads a family's banks ([experts, ., .]) as its published checkpoints
store them, the last two dims swapped from transformers' (`Template.vllm_expert_banks_transposed`:
Qwen3-VL-MoE), a sync sends them transposed and the view writes them transposed. On CPU a sync also
prepacks the fused-MoE layers it reaches for vLLM's kernel again (`reload_weights`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import torch

from mmgrpo.errors import CheckpointError, ConfigError

INDEX_FILE = "model.safetensors.index.json"


# A fused expert bank: [experts, 2 x width, hidden] (gate_up_proj) or [experts, hidden, width] (down_proj)
# as transformers 5 holds them
EXPERT_BANK = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def vllm_named(named_tensors: Iterable[tuple[str, torch.Tensor]], template):
    """(HF name, tensor) pairs -> (name vLLM loads, tensor), lazily (one tensor at a time); the fused
    expert banks transposed (a view) where vLLM loads them so (`Template.vllm_expert_banks_transposed`)."""
    transpose = template.vllm_expert_banks_transposed
    for name, tensor in named_tensors:
        if transpose and EXPERT_BANK.search(name):
            tensor = tensor.transpose(-1, -2)  # [experts, hidden, 2 x width] / [experts, width, hidden]
        yield template.vllm_weight_name(name), tensor


def reload_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's in-place `reload_weights` of (name vLLM loads, tensor) pairs, one tensor at a time.

    On CPU, vLLM 0.32 prepacks each fused-MoE layer's expert banks (w13, w2) for its CPU kernel when the
    checkpoint loads, but not when a reload processes the layer again: the kernel would then read the
    synced experts unpacked (0.1 to 1.5 nat per token on the tiny MoE models). While the reload runs,
    each such layer that receives weights is prepacked as at start-up; layers that receive nothing keep
    their packed weights."""
    cpu = not torch.cuda.is_available()
    if cpu:
        llm.apply_model(_prepack_cpu_experts_on_reload)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
    finally:
        if cpu:
            llm.apply_model(_plain_reload)


def _cpu_expert_layers(model):
    """(layer, its quant method, its CPU experts kernel) for each fused-MoE layer vLLM runs on its CPU kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            yield layer, method, experts


def _prepack_cpu_experts_on_reload(model) -> int:
    count = 0
    for _, method, experts in _cpu_expert_layers(model):
        method.process_weights_after_loading = partial(_process_and_prepack, type(method).process_weights_after_loading,
                                                       method, experts)
        count += 1
    return count


def _process_and_prepack(process, method, experts, layer) -> None:
    process(method, layer)  # a reload: the new values copied in, unpacked
    experts.process_weights_after_loading(layer)  # the CPU kernel's layout, as at start-up


def _plain_reload(model) -> None:
    for _, method, _ in _cpu_expert_layers(model):
        method.__dict__.pop("process_weights_after_loading", None)


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
    transposed = transformers_expert_banks(folder) if template.vllm_expert_banks_transposed else set()
    config = json.loads((folder / "config.json").read_text())
    vllm_config = template.vllm_config(config)
    if not renamed and not transposed and vllm_config == config:
        return model_path
    from mmgrpo.models.tiny import default_cache_dir, publish_checkpoint

    files = sorted(p for p in folder.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps({
        "folder": str(folder.resolve()),
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "rules": template.vllm_weight_names,
        "transposed": sorted(transposed),
        "config": vllm_config,
    }).encode()).hexdigest()[:12]
    target = default_cache_dir().parent / "vllm" / f"{folder.resolve().name}-{key}"
    if not (target / "config.json").exists():
        new_config = vllm_config if vllm_config != config else None
        publish_checkpoint(target, lambda tmp: _write_view(files, renamed, transposed, new_config, tmp))
    return str(target)


def transformers_expert_banks(folder: Path) -> set[str]:
    """The fused expert banks of the folder's safetensors files stored as transformers 5 holds and saves
    them, gate_up_proj [experts, 2 x width, hidden] and down_proj [experts, hidden, width], not as the
    published checkpoints store them (the last two dims swapped). A layer's two shapes tell the layouts
    apart, also where one of them is square (tiny models)."""
    banks: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, entry in safetensors_header(file).items():
            if (match := EXPERT_BANK.search(name)) is not None:
                banks.setdefault(name[: match.start()], {})[match.group(1)] = (name, entry["shape"])
    found = set()
    for layer in banks.values():
        if len(layer) == 2:
            (gate_up_name, gate_up), (down_name, down) = layer["gate_up_proj"], layer["down_proj"]
            if gate_up[-2] == 2 * down[-1] and gate_up[-1] == down[-2]:
                found |= {gate_up_name, down_name}
    return found


def _write_view(files: list[Path], renamed: dict[str, str], transposed: set[str], config: dict | None,
                out: Path) -> None:
    """Link `files` into `out`, but rename the tensors of the safetensors files (and their index), swap
    the last two dims of those in `transposed`, and write `config` (None: the checkpoint's own) as config.json."""
    for file in files:
        if file.suffix == ".safetensors" and (renamed or transposed):
            _rewrite_safetensors(file, out / file.name, renamed, transposed)
        elif file.name == INDEX_FILE and renamed:
            index = json.loads(file.read_text())
            index["weight_map"] = {renamed.get(k, k): v for k, v in index["weight_map"].items()}
            (out / file.name).write_text(json.dumps(index, indent=2))
        elif file.name == "config.json" and config is not None:
            (out / file.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            os.symlink(file.resolve(), out / file.name)


def _rewrite_safetensors(source: Path, target: Path, renamed: dict[str, str], transposed: set[str]) -> None:
    """A copy of `source` whose header names the tensors by `renamed`; the tensor bytes are copied as
    they are (their offsets are relative to the end of the header, which may change length), then each
    tensor in `transposed` is written over its own bytes with its last two dims swapped (one at a time)."""
    with open(source, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        swapped = [name for name in header if name in transposed]
        new_header = {}
        for name, entry in header.items():
            if name in transposed:
                *lead, rows, cols = entry["shape"]
                entry = {**entry, "shape": [*lead, cols, rows]}
            new_header[renamed.get(name, name)] = entry
        data = json.dumps(new_header, separators=(",", ":")).encode()
        data += b" " * (-len(data) % 8)  # safetensors pads its header to 8 bytes
        with open(target, "wb") as out:
            out.write(struct.pack("<Q", len(data)))
            out.write(data)
            shutil.copyfileobj(f, out, 64 << 20)
            for name in swapped:
                begin, end = header[name]["data_offsets"]
                *lead, rows, cols = header[name]["shape"]
                f.seek(8 + size + begin)
                raw = torch.frombuffer(bytearray(f.read(end - begin)), dtype=torch.uint8)
                item = (end - begin) // max(1, math.prod(header[name]["shape"]))  # bytes per element, any dtype
                out.seek(8 + len(data) + begin)
                out.write(raw.view(*lead, rows, cols, item).transpose(-2, -3).contiguous().numpy().tobytes())


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
