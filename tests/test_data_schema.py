"""normalize_row: every accepted row shape, and a DataError naming dataset, row and field for each bad one."""

import numpy as np
import PIL.Image
import pytest

from mmgrpo.data.sample import DEFAULT_SYSTEM_PROMPT, Sample, normalize_row
from mmgrpo.errors import DataError


def normalize(row, **kwargs):
    kwargs = {"dataset": "toy", "split": "train", "index": 3, **kwargs}
    return normalize_row(row, **kwargs)


def test_messages_with_tags_and_parallel_images():
    row = {
        "messages": [
            {"role": "user", "content": "<image><image>Same colour?"},
            {"role": "assistant", "content": "yes"},
        ],
        "images": ["a.png", "b.png"],
        "solution": "yes",
        "difficulty": 2,
    }
    sample = normalize(row, media_root="/data")
    assert sample.id == "toy/train/3"
    assert sample.messages == [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": "<image><image>Same colour?"},
    ]
    assert sample.images == ["a.png", "b.png"]
    assert sample.columns == {"solution": "yes", "difficulty": 2, "reference_response": "yes"}
    assert sample.media_root == "/data"
    assert sample.modality == "image"
    assert row["messages"][-1] == {"role": "assistant", "content": "yes"}  # the input row is not modified


def test_typed_parts_and_single_refs():
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "video", "text": None},
                    {"type": "text", "text": "What happens?"},
                    {"type": "audio"},
                ],
            },
        ],
        "videos": "clip.mp4",  # a single reference is a list of one
        "audios": "speech.wav",
    }
    sample = normalize(row)
    assert sample.messages[0] == {"role": "system", "content": "Be brief."}  # the row's system turn wins
    assert sample.messages[1]["content"] == [
        {"type": "video"},
        {"type": "text", "text": "What happens?"},
        {"type": "audio"},
    ]
    assert sample.videos == ["clip.mp4"] and sample.audios == ["speech.wav"]
    assert sample.modality == "mixed"


def test_inline_media_in_parts():
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "x.png"}, "Colour?"]}]}
    sample = normalize(row)
    assert sample.images == ["x.png"]
    assert sample.messages[-1]["content"] == [{"type": "image"}, {"type": "text", "text": "Colour?"}]


def test_video_as_frame_list_and_audio_tuple():
    wave = np.zeros(160, np.float32)
    row = {"query": "<video><audio>Describe.", "videos": [["f0.png", "f1.png"]], "audios": (wave, 16000)}
    sample = normalize(row)
    assert sample.videos == [["f0.png", "f1.png"]]
    assert len(sample.audios) == 1 and sample.audios[0][1] == 16000


def test_query_response_row():
    pil = PIL.Image.new("RGB", (4, 4))
    sample = normalize({"query": "Colour?", "response": "red", "system": "Short answers.", "image": pil})
    assert sample.messages == [
        {"role": "system", "content": "Short answers."},
        {"role": "user", "content": "<image>Colour?"},  # the missing tag is put in front
    ]
    assert sample.images == [pil]
    assert sample.columns == {"response": "red", "solution": "red", "reference_response": "red"}
    # an existing solution is kept; the response never reaches the prompt
    sample = normalize({"query": "2+2?", "response": "It is 4", "solution": "4"})
    assert sample.columns["solution"] == "4"
    assert all("It is 4" not in str(m["content"]) for m in sample.messages)
    assert sample.modality == "text"


def test_column_mapping_and_system_prompt_options():
    row = {"question": "<image>What is it?", "answer": "cat", "img": "c.png"}
    sample = normalize(
        row, columns={"question": "query", "answer": "solution", "img": "images"}, system_prompt=None
    )
    assert sample.messages == [{"role": "user", "content": "<image>What is it?"}]
    assert sample.columns == {"solution": "cat"} and sample.images == ["c.png"]
    sample = normalize({"query": "hi"}, system_prompt="Custom.")
    assert sample.messages[0] == {"role": "system", "content": "Custom."}


def test_arrow_style_nulls_in_parts_are_ignored():
    # datasets fills keys other rows have with None: {"type": "image", "text": None, "image": None}
    row = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "text": None, "image": None},
                    {"type": "text", "text": "Hi", "image": None},
                ],
            }
        ],
        "images": ["a.png"],
    }
    assert normalize(row).images == ["a.png"]


@pytest.mark.parametrize(
    "row, kwargs, needles",
    [
        (
            {"messages": [{"role": "user", "content": "<image><image>x"}], "images": ["a.png"]},
            {},
            ["'images'", "2 <image>", "1 entry"],
        ),
        (
            {"messages": [{"role": "user", "content": "no tag"}], "images": ["a.png"]},
            {},
            ["'images'", "0 <image>"],
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, {}, ["'videos'", "1 <video>"]),
        ({"query": "<audio>x"}, {}, ["'audios'"]),
        ({"question": "x"}, {"columns": {"prompt": "query"}}, ["'prompt'", "fix 'columns'"]),
        ({"text": "x"}, {}, ["neither 'messages' nor 'query'"]),
        ({"messages": [{"role": "bot", "content": "x"}]}, {}, ["messages[0].role", "'bot'"]),
        ({"messages": [{"role": "user", "content": 5}]}, {}, ["messages[0].content"]),
        ({"messages": [{"role": "user", "content": [{"type": "gif"}]}]}, {}, ["messages[0].content[0].type"]),
        (
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "<image> x"}]}],
                "images": ["a"],
            },
            {},
            ["messages[0].content[0]", "text part"],
        ),
        ({"messages": [{"role": "assistant", "content": "x"}]}, {}, ["no user turn"]),
        ({"messages": []}, {}, ["'messages'"]),
        ({"query": "<image>x", "images": [None]}, {}, ["images[0]", "empty"]),
        (
            {
                "messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}],
                "images": ["b.png"],
            },
            {},
            ["both inline"],
        ),
    ],
)
def test_bad_rows_name_dataset_row_and_field(row, kwargs, needles):
    with pytest.raises(DataError) as caught:
        normalize(row, **kwargs)
    message = str(caught.value)
    assert "dataset 'toy'" in message and "row 3" in message
    for needle in needles:
        assert needle in message


def test_load_media_wraps_errors_with_the_sample_id(tmp_path):
    PIL.Image.new("RGB", (5, 4), "red").save(tmp_path / "ok.png")
    sample = normalize({"query": "<image><image>x", "images": ["ok.png", "gone.png"]}, media_root=tmp_path)
    with pytest.raises(DataError) as caught:
        sample.load_media()
    message = str(caught.value)
    assert "toy/train/3" in message and "images[1]" in message and "gone.png" in message
    loaded = Sample(
        id="s/train/0", messages=sample.messages, images=["ok.png"], media_root=str(tmp_path)
    ).load_media()
    assert loaded.images[0].size == (5, 4) and loaded.images[0].mode == "RGB"
    assert loaded.modality == "image" and loaded.id == "s/train/0"
