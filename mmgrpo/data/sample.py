"""One sample schema for every dataset format and modality.

A row from any loader becomes a `Sample` (media still as references) through `normalize_row`;
a DataLoader worker turns it into a `LoadedSample` (media decoded) with `Sample.load_media`.
Templates only ever see `LoadedSample`.

Rows may look like any of these (one JSON object each; see docs/data.md):

    {"messages": [{"role": "user", "content": "<image>What colour is it?"}], "images": ["a.png"], "solution": "red"}
    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}], "images": "a.png"}
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Colour?"}]}]}
    {"query": "What colour is it?", "response": "red", "images": ["a.png"]}

>>> s = normalize_row({"query": "<image>Colour?", "response": "red", "images": "a.png"},
...                   dataset="toy", split="train", index=7)
>>> s.id, s.messages[-1], s.images, s.columns["solution"], s.modality
('toy/train/7', {'role': 'user', 'content': '<image>Colour?'}, ['a.png'], 'red', 'image')
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmgrpo.errors import DataError
from mmgrpo.processors.video import Video  # noqa: F401  (part of the sample schema: LoadedSample.videos)

if TYPE_CHECKING:
    pass

MEDIA_KINDS = ("images", "videos", "audios")
MEDIA_TAGS = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}
ROLES = ("system", "user", "assistant", "tool")  # tool: a tool's answer in a multi-turn conversation
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# Columns normalize_row consumes; every other column reaches Sample.columns unchanged.
_STRUCTURAL = ("messages", "query", "system", *MEDIA_KINDS)


def dataset_of(sample_id: str) -> str:
    """"shapes-color/train/12" -> "shapes-color" (dataset names may contain "/")."""
    return sample_id.rsplit("/", 2)[0]


@dataclass
class Sample:
    """A dataset row in the one schema mmgrpo understands (media not yet decoded)."""

    id: str  # "<dataset>/<split>/<row index>": named in every error and in completions.jsonl
    messages: list[dict]  # [{"role": ..., "content": str | list[part]}]
    images: list = field(default_factory=list)  # path | bytes | data URI | PIL.Image
    videos: list = field(default_factory=list)  # path | list of frame refs
    audios: list = field(default_factory=list)  # path | bytes | (array, sampling_rate)
    columns: dict = field(default_factory=dict)  # "solution" and every other column, for rewards
    media_root: str | None = None

    @property
    def modality(self) -> str:
        kinds = [k[:-1] for k in MEDIA_KINDS if getattr(self, k)]
        return kinds[0] if len(kinds) == 1 else ("text" if not kinds else "mixed")

    def load_media(
        self,
        *,
        fps: float = 2.0,
        nframes: int | None = None,
        max_frames: int | None = None,
        sampling_rate: int = 16000,
        audio_in_video: bool = False,
        max_audio_samples: int | None = None,
    ) -> LoadedSample:
        """Decode every medium; a failure is a `DataError` naming this sample, the field and the file.

        fps / nframes / max_frames: video frame sampling (see `mmgrpo.processors.video.load_video`).
        sampling_rate: the rate audio is resampled to (the model's feature extractor rate).
        audio_in_video: also decode each video file's sound track, at `sampling_rate`, into `Video.audio`.
        max_audio_samples: the longest clip the audio encoder takes; a longer clip (or sound track) is cut to
            it, with one warning per dataset saying by how much (`Template.max_audio_samples`).
        """
        from mmgrpo.processors.audio import load_audio
        from mmgrpo.processors.image import load_image
        from mmgrpo.processors.video import load_video

        decoders = {
            "images": lambda ref: load_image(ref, self.media_root),
            "videos": lambda ref: load_video(
                ref,
                fps=fps,
                nframes=nframes,
                max_frames=max_frames,
                media_root=self.media_root,
                audio_sampling_rate=sampling_rate if audio_in_video else None,
            ),
            "audios": lambda ref: load_audio(ref, sampling_rate, self.media_root),
        }
        decoded = {}
        for kind, decode in decoders.items():
            decoded[kind] = []
            for position, ref in enumerate(getattr(self, kind)):
                try:
                    decoded[kind].append(decode(ref))
                except DataError as err:
                    raise DataError(f"sample {self.id}, field '{kind}[{position}]': {err}") from None
                except Exception as err:  # a decoder bug or an exotic file: still name the sample
                    raise DataError(
                        f"sample {self.id}, field '{kind}[{position}]': cannot load it "
                        f"({type(err).__name__}: {err}); check the file"
                    ) from err
        if max_audio_samples:
            decoded["audios"] = [
                _cut_audio(audio, max_audio_samples, sampling_rate, f"sample {self.id}, field 'audios[{position}]'")
                for position, audio in enumerate(decoded["audios"])
            ]
            for position, video in enumerate(decoded["videos"]):
                if video.audio is not None:
                    where = f"sample {self.id}, the sound track of 'videos[{position}]'"
                    video.audio = _cut_audio(video.audio, max_audio_samples, sampling_rate, where)
        return LoadedSample(id=self.id, messages=self.messages, columns=self.columns, **decoded)


_CUT_WARNED: set[str] = set()  # datasets whose long audio was reported already (once per dataset and process)


def _cut_audio(audio, max_samples: int, sampling_rate: int, where: str):
    """`audio` cut to its first `max_samples` samples (what the encoder takes); the first cut of a dataset
    is reported in one warning saying how much was cut.

    >>> import numpy as np
    >>> _cut_audio(np.zeros(5, np.float32), 3, 1, "sample doctest/train/0, field 'audios[0]'").shape
    (3,)
    """
    if len(audio) <= max_samples:
        return audio
    dataset = dataset_of(where.split(",")[0].removeprefix("sample "))
    if dataset not in _CUT_WARNED:
        _CUT_WARNED.add(dataset)
        import logging

        logging.getLogger("mmgrpo.data").warning(
            "%s: audio is %.1f s long; the audio encoder takes %.1f s, so the last %.1f s are cut. Longer clips of "
            "dataset %s are cut the same way (reported once); split the clips to keep all of them.",
            where, len(audio) / sampling_rate, max_samples / sampling_rate, (len(audio) - max_samples) / sampling_rate,
            dataset,
        )
    return audio[:max_samples]


@dataclass
class LoadedSample:
    """A `Sample` with its media decoded: what a template encodes."""

    id: str
    messages: list[dict]
    images: list = field(default_factory=list)  # PIL.Image.Image, RGB
    videos: list = field(default_factory=list)  # Video
    audios: list = field(default_factory=list)  # float32 mono numpy arrays at the requested rate
    columns: dict = field(default_factory=dict)

    @property
    def modality(self) -> str:
        kinds = [k[:-1] for k in MEDIA_KINDS if getattr(self, k)]
        return kinds[0] if len(kinds) == 1 else ("text" if not kinds else "mixed")


def normalize_row(
    row: dict,
    *,
    dataset: str,
    split: str = "train",
    index: int = 0,
    columns: dict[str, str] | None = None,
    media_root: str | os.PathLike | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
) -> Sample:
    """Turn one raw row into a `Sample`; a malformed row is a `DataError` naming dataset, row and field.

    row: a `messages` row or a `query` (+ `response`, `system`) row, with `images` / `videos` /
        `audios` (a list, or one reference; `image` / `video` / `audio` are accepted as names too),
        and any other columns, which reach `Sample.columns` unchanged.
    columns: renames applied first, {source column: schema column}, e.g. {"question": "query"}.
    media_root: the folder relative media paths are resolved against.
    system_prompt: used when the row has no system turn (and no `system` column); None for none.

    The final assistant turn, if any, is the answer the policy must generate: it leaves the prompt
    and is kept as `columns["reference_response"]`. A `response` also becomes `columns["solution"]`
    when the row has no `solution`.
    """
    where = _Where(dataset, split, index)
    row = dict(row)
    if columns:
        row = _rename_columns(row, columns, where)
    for kind in MEDIA_KINDS:  # a single-medium column is often named "image"
        if kind not in row and kind[:-1] in row:
            row[kind] = row.pop(kind[:-1])
    media = {kind: _as_media_list(row.pop(kind, None), kind, where) for kind in MEDIA_KINDS}
    if row.get("messages") is not None and row.get("query") is not None:
        raise DataError(where.field("query", "the row has both `messages` and `query`; give the prompt one way "
                                             "(a renamed column may have made the second)"))
    if is_missing(row.get("solution")):
        row.pop("solution", None)  # NaN (a Parquet null read by pandas) or "": no reference answer
    extra = {key: value for key, value in row.items() if key not in _STRUCTURAL}
    messages = _row_messages(row, media, extra, where)
    if messages[-1]["role"] == "assistant":
        extra["reference_response"] = _text_of(messages.pop()["content"])
    if not any(message["role"] == "user" for message in messages):
        raise DataError(where.field("messages", "has no user turn; the prompt needs one"))
    _add_system_turn(messages, row, system_prompt, where)
    _check_placeholders(messages, media, where)
    return Sample(
        id=f"{dataset}/{split}/{index}",
        messages=messages,
        columns=extra,
        media_root=None if media_root is None else os.fspath(media_root),
        **media,
    )


def is_missing(value) -> bool:
    """A reference answer that is none: None, a float NaN (a pandas / Parquet null) or blank text.

    >>> is_missing(None), is_missing(float("nan")), is_missing("  "), is_missing("0"), is_missing(0)
    (True, True, True, False, False)
    """
    if value is None:
        return True
    if isinstance(value, float):
        return value != value
    return isinstance(value, str) and not value.strip()


def _row_messages(row: dict, media: dict[str, list], extra: dict, where: _Where) -> list[dict]:
    """The conversation of a `messages` row (its inline media moved into `media`) or of a `query`
    row (placeholders put in front where the query has none; a `response` is the assistant turn,
    and `extra["solution"]` where the row has none)."""
    if row.get("messages") is not None:
        messages, inline = _normalize_messages(row["messages"], where)
        for kind, refs in inline.items():
            if refs and media[kind]:
                raise DataError(
                    where.field(
                        kind,
                        f"media are given both inline in the message parts and in '{kind}'; "
                        "give them in one place",
                    )
                )
            if refs:
                media[kind] = refs
        return messages
    if row.get("query") is not None:
        query = row["query"]
        if not isinstance(query, str):
            raise DataError(where.field("query", f"must be a string, got {type(query).__name__}"))
        # A query row without placeholders gets them in front, in the order images, videos, audios.
        prefix = "".join(
            MEDIA_TAGS[kind] * len(media[kind]) for kind in MEDIA_KINDS if MEDIA_TAGS[kind] not in query
        )
        messages = [{"role": "user", "content": prefix + query}]
        response = row.get("response")
        if response is not None:
            extra.setdefault("solution", response)
            messages.append(
                {"role": "assistant", "content": response if isinstance(response, str) else str(response)}
            )
        return messages
    raise DataError(
        f"{where}: the row has neither 'messages' nor 'query' (it has {sorted(row)}); "
        "rename a column with 'columns' in the registry entry, e.g. {question: query}"
    )


def _add_system_turn(messages: list[dict], row: dict, system_prompt: str | None, where: _Where) -> None:
    """A system turn first where the messages have none: the row's `system` column, else `system_prompt`."""
    if any(message["role"] == "system" for message in messages):
        return
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(where.field("system", f"must be a string, got {type(system).__name__}"))
    if system or system_prompt:
        messages.insert(0, {"role": "system", "content": system or system_prompt})


def _check_placeholders(messages: list[dict], media: dict[str, list], where: _Where) -> None:
    """DataError unless the messages hold one placeholder per image, video and audio."""
    for kind, tag in MEDIA_TAGS.items():
        placeholders = _count_placeholders(messages, kind)
        if placeholders != len(media[kind]):
            raise DataError(
                where.field(
                    kind,
                    f"the messages hold {placeholders} {tag} placeholder(s) but '{kind}' has "
                    f"{len(media[kind])} entr{'y' if len(media[kind]) == 1 else 'ies'}; put one {tag} tag "
                    f'(or {{"type": "{kind[:-1]}"}} part) in the messages per entry',
                )
            )


class _Where:
    """Names a row in error messages: "dataset 'x' (split 'train'), row 3"."""

    def __init__(self, dataset: str, split: str, index: int):
        self.text = f"dataset {dataset!r} (split {split!r}), row {index}"

    def __str__(self) -> str:
        return self.text

    def field(self, name: str, problem: str) -> str:
        return f"{self.text}, field {name!r}: {problem}"


def _rename_columns(row: dict, mapping: dict[str, str], where: _Where) -> dict:
    for source, target in mapping.items():
        if source not in row:
            raise DataError(
                f"{where}: the column mapping renames {source!r} -> {target!r} but the row has no column "
                f"{source!r} (it has {sorted(row)}); fix 'columns' in the dataset's registry entry"
            )
    moved = {target: row.pop(source) for source, target in mapping.items()}  # all at once: swaps work
    for target in moved:
        if target in row:  # a column of that name that is not itself renamed away: one would be lost
            source = next(s for s, t in mapping.items() if t == target)
            raise DataError(f"{where}: the column mapping renames {source!r} -> {target!r} but the row already has a "
                            f"{target!r} column; rename that one too, or map another column in 'columns'")
    row.update(moved)
    return row


def _as_media_list(value, kind: str, where: _Where) -> list:
    """A list holds one entry per medium; anything else (a path, bytes, a tuple) is one medium."""
    if value is None:
        return []
    refs = list(value) if isinstance(value, list) else [value]
    for position, ref in enumerate(refs):
        if ref is None or (isinstance(ref, (str, bytes, list)) and len(ref) == 0):
            raise DataError(where.field(f"{kind}[{position}]", "is empty; give a path or the media bytes"))
    return refs


def _normalize_messages(messages, where: _Where) -> tuple[list[dict], dict[str, list]]:
    """Validated copies of the messages, and media found inline in typed parts."""
    if not isinstance(messages, list) or not messages:
        raise DataError(where.field("messages", "must be a non-empty list of {role, content} objects"))
    inline = {kind: [] for kind in MEDIA_KINDS}
    parts_without_ref = {kind: 0 for kind in MEDIA_KINDS}
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(where.field(f"messages[{i}]", f"must be an object, got {type(message).__name__}"))
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(where.field(f"messages[{i}].role", f"is {role!r}; use one of {', '.join(ROLES)}"))
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise DataError(
                where.field(
                    f"messages[{i}].content",
                    f"must be a string or a list of parts, got {type(content).__name__}",
                )
            )
        parts = []
        for j, part in enumerate(content):
            name = f"messages[{i}].content[{j}]"
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            if not isinstance(part, dict):
                raise DataError(where.field(name, f"must be an object, got {type(part).__name__}"))
            # Arrow fills keys that other rows have with null: drop them
            part = {key: value for key, value in part.items() if value is not None}
            kind = f"{part.get('type')}s"
            if part.get("type") == "text":
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise DataError(where.field(f"{name}.text", "must be a string"))
                for tag in MEDIA_TAGS.values():
                    if tag in text:
                        raise DataError(
                            where.field(
                                name,
                                f'a text part holds a {tag} tag; use a {{"type": '
                                f'"{tag[1:-1]}"}} part instead',
                            )
                        )
                parts.append({"type": "text", "text": text})
            elif kind in MEDIA_KINDS:
                ref = part.get(part["type"])
                if ref is None:
                    parts_without_ref[kind] += 1
                else:
                    inline[kind].append(ref)
                parts.append({"type": part["type"]})
            else:
                raise DataError(
                    where.field(
                        f"{name}.type", f"is {part.get('type')!r}; use one of text, image, video, audio"
                    )
                )
        out.append({"role": role, "content": parts})
    for kind in MEDIA_KINDS:
        if inline[kind] and parts_without_ref[kind]:
            raise DataError(
                where.field(
                    "messages",
                    f"some {kind[:-1]} parts carry their media and some do not; "
                    f"give every {kind[:-1]} inline, or none and list them in '{kind}'",
                )
            )
    return out, inline


def _count_placeholders(messages: list[dict], kind: str) -> int:
    count = 0
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            count += content.count(MEDIA_TAGS[kind])
        else:
            count += sum(1 for part in content if part["type"] == kind[:-1])
    return count


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part["type"] == "text")
