"""What crosses HTTP between the trainer and `mmgrpo rollout-server`: prompts with their media, and
the identity of a model.

A generate request is one uncompressed `.npz` body: `meta` (JSON: each prompt's text, its media
counts and video metadata, the sampling options per prompt, the processor options, the weight
version the trainer expects) and one uint8 / float32 array per image, video and audio clip. No
pickle crosses the wire.

    body = encode_prompts(prompts, options, processor_kwargs, sampling_rate, version)
    meta, media = decode_prompts(body)      # on the server: media[i] as `prompt_media` gives it

>>> import numpy as np
>>> from PIL import Image
>>> class P: prompt_text, images, videos, audios = "<img>hi", [Image.new("RGB", (4, 2))], [], [np.zeros(3)]
>>> meta, media = decode_prompts(encode_prompts([P()], [{"n": 2}], {}, 16000, 3))
>>> meta["prompts"][0]["text"], media[0]["images"][0].size, media[0]["audios"][0].dtype, meta["version"]
('<img>hi', (4, 2), dtype('float32'), 3)
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np


def encode_prompts(prompts: list, options: list[dict], processor_kwargs: dict, sampling_rate, version: int) -> bytes:
    arrays: dict[str, np.ndarray] = {}
    described = []
    for i, prompt in enumerate(prompts):
        for j, image in enumerate(prompt.images):
            arrays[f"image_{i}_{j}"] = np.asarray(image.convert("RGB"), dtype=np.uint8)
        videos = []
        for j, video in enumerate(prompt.videos):
            arrays[f"video_{i}_{j}"] = np.asarray(video.frames, dtype=np.uint8)
            sound = getattr(video, "audio", None)
            if sound is not None:
                arrays[f"sound_{i}_{j}"] = np.asarray(sound, dtype=np.float32)
            videos.append({"metadata": _plain(dict(video.metadata)), "sound": sound is not None})
        for j, audio in enumerate(prompt.audios):
            arrays[f"audio_{i}_{j}"] = np.asarray(audio, dtype=np.float32)
        described.append({"text": prompt.prompt_text, "images": len(prompt.images), "videos": videos,
                          "audios": len(prompt.audios)})
    meta = {"prompts": described, "options": options, "processor_kwargs": processor_kwargs,
            "sampling_rate": sampling_rate, "version": version}
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return buffer.getvalue()


def decode_prompts(body: bytes) -> tuple[dict, list[dict]]:
    """(meta, per prompt {"images": [PIL], "videos": [{"frames", "metadata", "audio"}], "audios": [array]})."""
    from PIL import Image

    with np.load(io.BytesIO(body), allow_pickle=False) as data:
        meta = json.loads(data["meta"].tobytes().decode())
        media = []
        for i, prompt in enumerate(meta["prompts"]):
            media.append({
                "images": [Image.fromarray(data[f"image_{i}_{j}"]) for j in range(prompt["images"])],
                "videos": [
                    {"frames": data[f"video_{i}_{j}"], "metadata": video["metadata"],
                     "audio": data[f"sound_{i}_{j}"] if video["sound"] else None}
                    for j, video in enumerate(prompt["videos"])
                ],
                "audios": [data[f"audio_{i}_{j}"] for j in range(prompt["audios"])],
            })
    return meta, media


def _plain(value):
    """JSON-able copy of video metadata (numpy numbers and arrays become Python ones)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def model_identity(model_path: str) -> dict:
    """What must agree between the trainer's model and the server's: architecture and text sizes.

    The weights themselves need not agree: the trainer sends its own before the first rollout.
    """
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or config.get("thinker_config", {}).get("text_config") or config
    return {
        "architectures": config.get("architectures"),
        "model_type": config.get("model_type"),
        **{key: text.get(key, config.get(key)) for key in ("hidden_size", "num_hidden_layers", "vocab_size")},
    }


def model_fingerprint(model_path: str) -> str:
    """A short hash of a checkpoint: its config (less the transformers version that wrote it), the
    names and sizes of its weight files, and the first and last MiB of each. Copies of one checkpoint
    agree on any host; another checkpoint of the same architecture (a fine-tune, another step)
    differs. Reads a few MiB, whatever the model's size.
    """
    folder = Path(model_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for file in sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:12]
