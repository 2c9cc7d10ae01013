"""Box-aware data augmentation, set per dataset by an `augment:` block in the registry YAML.

    datasets:
      - name: shapes-ground-aug
        synthetic: shapes-ground
        reward_funcs: [answer_format, iou]
        augment: {hflip: 0.5, rotate: 10, crop: 0.9, color_jitter: 0.2}

| key | value | what it does |
|---|---|---|
| `hflip`, `vflip` | probability in [0, 1] | mirror left-right / top-bottom |
| `rotate` | degrees in [0, 180] | rotate about the centre by an angle uniform in [-rotate, rotate]; corners black |
| `crop` | fraction in (0, 1] | keep a window of s x each side, s uniform in [crop, 1], placed uniformly (not resized) |
| `color_jitter` | j in [0, 1) | brightness, contrast, saturation factors each uniform in [1 - j, 1 + j] |
| `audio_noise` | std in [0, 1] | add Gaussian noise of this std to every waveform (samples lie in [-1, 1]) |
| `audio_gain` | [low, high], 0 < low <= high | multiply every waveform by a gain uniform in [low, high] |
| `synonyms` | a file (JSON or comma-separated groups) | the synonym table of the text augmentation (mmgrpo/data/text_augment.py) |
| `synonym_prob` | probability in [0, 1] | replace each known, unprotected word of the user turns with a synonym |
| `synonym_protect` | subset of [answers, option_letters, numbers] | kinds of words never replaced (default: all three) |
| `protected_words` | list of words | more words never replaced |

It runs in the DataLoader worker on each decoded sample, after `Sample.load_media` and before the
template encodes it (mmgrpo/data/prompt_batches.py), for training only (evaluation reads samples
unchanged). One set of parameters is drawn per sample from a torch.Generator seeded by
(seed, epoch, sample index), so a run is reproducible whatever the worker count, and every epoch
sees a new draw. The same parameters apply to every image of the sample and to every frame of
every video (motion stays coherent), and to every audio clip, video sound tracks included. The
transforms are torchvision.transforms.v2's, on tv_tensors: `BoundingBoxes` move with the image.

What was applied is recorded in `sample.columns["augment"]` (and so in completions.jsonl), e.g.
`{"crop": [0.04, 0.07, 0.93, 0.93], "hflip": true, "rotate": -3.71, "brightness": 1.08, ...}`
(crop: left, top, width, height as fractions of the image).

Boxes: a `solution` that is a box [x1, y1, x2, y2] (or a list of boxes) in the original pixels of
the sample's first image (else of its video frames) becomes the box around the transformed box,
clamped to the new image, so rewards still get boxes in the pixels of the image the model saw.
A crop keeps the boxes inside its window when they fit (else it lies on them). A solution that holds boxes in another
form (text, a dict) cannot be moved: with a geometric key on, that is a `DataError`.

>>> import PIL.Image
>>> from mmgrpo.data.sample import LoadedSample
>>> sample = LoadedSample(id="toy/train/0", messages=[], images=[PIL.Image.new("RGB", (100, 50))],
...                       columns={"solution": [10, 5, 30, 25]})
>>> out = Augment(hflip=1.0)(sample, seed=0, epoch=0, index=0)
>>> out.columns["solution"], out.columns["augment"]
([70.0, 5.0, 90.0, 25.0], {'hflip': True})
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmgrpo.data.sample import LoadedSample
from mmgrpo.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

# torch and torchvision are imported where used: the registry imports this module to parse the
# `augment:` block, and `mmgrpo datasets` should not wait for torch.
KEYS = ("hflip", "vflip", "rotate", "crop", "color_jitter", "audio_noise", "audio_gain",
        "synonyms", "synonym_prob", "synonym_protect", "protected_words")
COLOUR_FACTORS = ("brightness", "contrast", "saturation")


@dataclass(frozen=True)
class Augment:
    """A dataset's augmentation settings (the registry's `augment:` block); call it on a sample."""

    hflip: float = 0.0
    vflip: float = 0.0
    rotate: float = 0.0
    crop: float = 1.0
    color_jitter: float = 0.0
    audio_noise: float = 0.0
    audio_gain: tuple[float, float] = (1.0, 1.0)
    # text: synonym replacement (mmgrpo/data/text_augment.py); the table is read once, at parse time
    synonyms: str | None = None  # the file it came from (for the record)
    synonym_table: tuple = ()  # ((word, (synonym, ...)), ...): hashable, pickled to the workers
    synonym_prob: float = 0.0
    synonym_protect: tuple[str, ...] = ("answers", "option_letters", "numbers")
    protected_words: tuple[str, ...] = ()

    @property
    def geometric(self) -> bool:
        return self.hflip > 0 or self.vflip > 0 or self.rotate > 0 or self.crop < 1

    def __call__(self, sample: LoadedSample, *, seed: int, epoch: int, index: int) -> LoadedSample:
        """A new LoadedSample with transformed media, `solution` box and the "augment" column."""
        try:
            return self._apply(sample, sample_generator(seed, epoch, index))
        except DataError:
            raise
        except Exception as err:  # a medium torchvision cannot take: still name the sample
            raise DataError(f"sample {sample.id}: augmentation failed ({type(err).__name__}: {err})") from err

    def draw(self, generator: torch.Generator, *, visual: bool, audio: bool, keep=None) -> dict:
        """The parameters for one sample; `keep`: [x1, y1, x2, y2] fractions a crop should contain."""
        import torch

        def uniform(low: float, high: float) -> float:
            return low + (high - low) * float(torch.rand((), generator=generator))

        params = {}
        if visual:
            if self.crop < 1:
                scale = uniform(self.crop, 1.0)
                left = _place(uniform(0, 1), scale, None if keep is None else (keep[0], keep[2]))
                top = _place(uniform(0, 1), scale, None if keep is None else (keep[1], keep[3]))
                params["crop"] = [round(left, 4), round(top, 4), round(scale, 4), round(scale, 4)]
            if self.hflip > 0:
                params["hflip"] = uniform(0, 1) < self.hflip
            if self.vflip > 0:
                params["vflip"] = uniform(0, 1) < self.vflip
            if self.rotate > 0:
                params["rotate"] = round(uniform(-self.rotate, self.rotate), 2)
            if self.color_jitter > 0:
                for name in COLOUR_FACTORS:
                    params[name] = round(uniform(1 - self.color_jitter, 1 + self.color_jitter), 4)
        if audio:
            if tuple(self.audio_gain) != (1.0, 1.0):
                params["audio_gain"] = round(uniform(*self.audio_gain), 4)
            if self.audio_noise > 0:
                params["audio_noise"] = self.audio_noise
        return params

    def _apply(self, sample: LoadedSample, generator: torch.Generator) -> LoadedSample:
        columns = dict(sample.columns)  # never the dataset's own dict: an epoch later it must be untouched
        if sample.images:
            size = sample.images[0].size  # (width, height)
        elif sample.videos:
            size = (sample.videos[0].frames.shape[2], sample.videos[0].frames.shape[1])
        else:
            size = None
        boxes = _gold_boxes(sample, columns.get("solution")) if size is not None and self.geometric else None
        keep = None
        if boxes:
            corners = np.clip(np.asarray(boxes, dtype=float), 0, None)
            keep = [corners[:, 0].min() / size[0], corners[:, 1].min() / size[1],
                    min(1.0, corners[:, 2].max() / size[0]), min(1.0, corners[:, 3].max() / size[1])]
        has_audio = bool(sample.audios) or any(getattr(v, "audio", None) is not None for v in sample.videos)
        params = self.draw(generator, visual=size is not None, audio=has_audio, keep=keep)
        messages = sample.messages
        if self.synonym_table and self.synonym_prob > 0:  # drawn after the media keys: their draws stay as they were
            from mmgrpo.data.text_augment import augment_messages, protected_words

            protected = protected_words(columns.get("solution"), self.synonym_protect, self.protected_words)
            messages, swaps = augment_messages(sample.messages, dict(self.synonym_table), self.synonym_prob,
                                               protected, generator, self.synonym_protect)
            params["synonyms"] = swaps
        columns["augment"] = params

        import torch
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as F

        images = []
        for image in sample.images:
            pixels = _colour(_geometry(tv_tensors.Image(F.pil_to_tensor(image)), params), params)
            images.append(F.to_pil_image(pixels.as_subclass(torch.Tensor)))
        audios = [_audio(clip, params, generator) for clip in sample.audios]
        videos = []
        for video in sample.videos:
            frames = tv_tensors.Video(torch.from_numpy(np.ascontiguousarray(video.frames)).permute(0, 3, 1, 2))
            frames = _colour(_geometry(frames, params), params).as_subclass(torch.Tensor)  # [T, 3, H', W']
            metadata = {**video.metadata, "width": int(frames.shape[-1]), "height": int(frames.shape[-2])}
            track = None if video.audio is None else _audio(video.audio, params, generator)
            frames = frames.permute(0, 2, 3, 1).contiguous().numpy()  # [T, H', W', 3] uint8
            videos.append(dataclasses.replace(video, frames=frames, metadata=metadata, audio=track))
        if boxes:
            moved = _geometry(
                tv_tensors.BoundingBoxes(torch.tensor(boxes, dtype=torch.float32), format="XYXY",
                                         canvas_size=(size[1], size[0])),
                params,
            )
            moved = [[round(float(v), 2) for v in box] for box in moved.tolist()]
            columns["solution"] = moved[0] if _is_box(_as_list(columns["solution"])) else moved
        return LoadedSample(id=sample.id, messages=messages, images=images, videos=videos,
                            audios=audios, columns=columns)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A torch.Generator seeded by (seed, epoch, index): the same triple gives the same draws anywhere."""
    import torch

    entropy = [int(seed) & (2**64 - 1), int(epoch), int(index)]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def parse_augment(block, where: str) -> Augment:
    """An `augment:` block of a registry entry -> `Augment`; a bad key or value is a ConfigError.

    where: names the file and entry in errors, e.g. "dataset registry x.yaml, entry 'a'".
    """
    if not isinstance(block, dict):
        raise ConfigError(f"{where}, key 'augment': must be a mapping, e.g. {{hflip: 0.5, rotate: 10}}")

    def bad(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}, key 'augment.{key}': {problem}, got {block.get(key)!r}")

    unknown = sorted(str(key) for key in set(block) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}, key 'augment.{unknown[0]}': unknown key; allowed keys: {', '.join(KEYS)}")
    ranges = {  # key -> (low, high, low excluded, high excluded, what it is)
        "hflip": (0, 1, False, False, "a probability in [0, 1]"),
        "vflip": (0, 1, False, False, "a probability in [0, 1]"),
        "rotate": (0, 180, False, False, "the largest angle in degrees, in [0, 180]"),
        "crop": (0, 1, True, False, "the smallest kept fraction of each side, in (0, 1]"),
        "color_jitter": (0, 1, False, True, "a jitter strength in [0, 1)"),
        "audio_noise": (0, 1, False, False, "the noise standard deviation, in [0, 1]"),
    }
    values = {}
    for key, (low, high, low_open, high_open, what) in ranges.items():
        if key not in block:
            continue
        value = block[key]
        if not _is_number(value) or not (low < value if low_open else low <= value) or not (
            value < high if high_open else value <= high
        ):
            raise bad(key, f"must be {what}")
        values[key] = float(value)
    if "audio_gain" in block:
        gain = block["audio_gain"]
        if (
            not isinstance(gain, (list, tuple))
            or len(gain) != 2
            or not all(_is_number(v) and 0 < v < math.inf for v in gain)
            or gain[0] > gain[1]
        ):
            raise bad("audio_gain", "must be [low, high] with 0 < low <= high, e.g. [0.8, 1.2]")
        values["audio_gain"] = (float(gain[0]), float(gain[1]))
    values.update(_parse_text_keys(block, where, bad))
    return Augment(**values)


def _parse_text_keys(block: dict, where: str, bad) -> dict:
    """The synonym-replacement keys of an `augment:` block (mmgrpo/data/text_augment.py)."""
    from mmgrpo.data.text_augment import PROTECT_KINDS, load_synonyms

    values = {}
    if "synonym_prob" in block:
        prob = block["synonym_prob"]
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise bad("synonym_prob", "must be a probability in [0, 1]")
        if "synonyms" not in block:
            raise ConfigError(f"{where}, key 'augment.synonym_prob': needs 'augment.synonyms', the synonym file")
        values["synonym_prob"] = float(prob)
    if "synonyms" in block:
        if not isinstance(block["synonyms"], str):
            raise bad("synonyms", "must be the path of a synonym file (.json, or comma-separated groups per line)")
        table = load_synonyms(block["synonyms"], where)
        values["synonyms"] = block["synonyms"]
        values["synonym_table"] = tuple(sorted((word, tuple(syns)) for word, syns in table.items()))
        values.setdefault("synonym_prob", 0.1)
    if "synonym_protect" in block:
        kinds = block["synonym_protect"]
        if not isinstance(kinds, list) or not set(kinds) <= set(PROTECT_KINDS):
            raise bad("synonym_protect", f"must be a list of {', '.join(PROTECT_KINDS)}")
        values["synonym_protect"] = tuple(kinds)
    if "protected_words" in block:
        words = block["protected_words"]
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise bad("protected_words", "must be a list of words")
        values["protected_words"] = tuple(words)
    return values


def _place(u: float, size: float, keep: tuple[float, float] | None) -> float:
    """Start (a fraction) of a window of `size`, at u in [0, 1] of its positions that contain `keep`
    (the boxes' span), or that lie within it when it is wider than the window."""
    low, high = 0.0, 1.0 - size
    if keep is not None and keep[1] - keep[0] <= size:
        low, high = max(low, keep[1] - size), min(high, keep[0])
    elif keep is not None:
        low, high = keep[0], keep[1] - size
    return low + (high - low) * u


def _geometry(x, params: dict):
    """crop -> flips -> rotation on a tv_tensor (Image, Video or BoundingBoxes, which follow the pixels)."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    def clamp(y):  # boxes stay on the canvas after every step, as the pixels do
        return F.clamp_bounding_boxes(y) if isinstance(y, tv_tensors.BoundingBoxes) else y

    if isinstance(x, tv_tensors.BoundingBoxes):
        height, width = x.canvas_size
    else:
        height, width = x.shape[-2:]
    if "crop" in params:
        left, top, crop_w, crop_h = params["crop"]
        x = clamp(F.crop(x, top=round(top * height), left=round(left * width),
                         height=max(1, round(crop_h * height)), width=max(1, round(crop_w * width))))
    if params.get("hflip"):
        x = F.horizontal_flip(x)
    if params.get("vflip"):
        x = F.vertical_flip(x)
    if params.get("rotate"):
        x = clamp(F.rotate(x, params["rotate"], interpolation=InterpolationMode.BILINEAR, fill=0))
    return x


def _colour(pixels, params: dict):
    from torchvision.transforms.v2 import functional as F

    if "brightness" in params:
        pixels = F.adjust_brightness(pixels, params["brightness"])
    if "contrast" in params:
        pixels = F.adjust_contrast(pixels, params["contrast"])
    if "saturation" in params:
        pixels = F.adjust_saturation(pixels, params["saturation"])
    return pixels


def _audio(samples: np.ndarray, params: dict, generator: torch.Generator) -> np.ndarray:
    import torch

    out = np.asarray(samples, dtype=np.float32) * np.float32(params.get("audio_gain", 1.0))
    if "audio_noise" in params:
        noise = torch.randn(out.shape, generator=generator, dtype=torch.float32).numpy()
        out = out + np.float32(params["audio_noise"]) * noise
    return np.ascontiguousarray(out, dtype=np.float32)


def _gold_boxes(sample: LoadedSample, solution) -> list[list[float]] | None:
    """The solution's boxes if it is [x1, y1, x2, y2] or a list of them; None if it holds none."""
    solution = _as_list(solution)
    if _is_box(solution):
        return [[float(v) for v in solution]]
    if isinstance(solution, list) and solution and all(_is_box(_as_list(b)) for b in solution):
        return [[float(v) for v in _as_list(b)] for b in solution]
    if solution is None or isinstance(solution, list):
        return None  # e.g. VQA annotator answers
    from mmgrpo.data.boxes import gold_boxes

    try:
        held = gold_boxes(solution)
    except ValueError:
        held = []
    if held:
        raise DataError(
            f"sample {sample.id}: its solution {solution!r} holds boxes as {type(solution).__name__}, which "
            "augmentation cannot move; give it as [x1, y1, x2, y2] (or a list of boxes), or drop hflip, vflip, "
            "rotate and crop from the dataset's augment block"
        )
    return None


def _as_list(value):
    return value.tolist() if hasattr(value, "tolist") else (list(value) if isinstance(value, tuple) else value)


def _is_box(value) -> bool:
    return isinstance(value, list) and len(value) == 4 and all(_is_number(v) for v in value)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
