"""Loaders: JSON, JSONL, Parquet, CSV and saved datasets folders give lazy rows; bad files give DataErrors."""

import io
import json

import datasets
import PIL.Image
import pytest

from mmgrpo.data.loaders import folder_splits, load_rows
from mmgrpo.errors import DataError

ROWS = [
    {"messages": [{"role": "user", "content": "<image>Colour?"}], "images": ["a.png"], "solution": "red"},
    {
        "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        "images": ["b.png"],
        "solution": ["blue", "navy"],  # a list here, a string above: mixed types are fine
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert len(rows) == 2
    assert rows[0] == ROWS[0]
    assert rows[1]["messages"][0]["content"][1] == {"type": "text", "text": "Colour?"}
    assert rows[1]["solution"] == ["blue", "navy"]


def test_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(
        json.dumps([{"query": "q1", "response": "r1"}, {"query": "q2", "response": "r2"}], indent=2)
    )
    rows = load_rows(path)
    assert len(rows) == 2 and rows[1] == {"query": "q2", "response": "r2"}


def test_parquet_csv_and_several_files(tmp_path):
    table = datasets.Dataset.from_list([{"query": f"q{i}", "solution": str(i)} for i in range(3)])
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    rows = load_rows(tmp_path / "d.parquet")
    assert len(rows) == 3 and rows[2] == {"query": "q2", "solution": "2"}
    assert load_rows(tmp_path / "d.csv")[1]["query"] == "q1"
    both = load_rows([tmp_path / "d.parquet", tmp_path / "d.parquet"])
    assert len(both) == 6


def test_saved_folder_keeps_media_undecoded(tmp_path):
    image = PIL.Image.new("RGB", (4, 4), "green")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    features = datasets.Features(
        {
            "query": datasets.Value("string"),
            "image": datasets.Image(),
            "frames": datasets.List(datasets.Image()),
        }
    )
    table = datasets.Dataset.from_dict(
        {"query": ["<image>Colour?"], "image": [image], "frames": [[image, image]]}, features=features
    )
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "dict"))
    table.save_to_disk(str(tmp_path / "single"))

    assert folder_splits(tmp_path / "dict") == ["train", "test"]
    assert folder_splits(tmp_path / "single") == ["train"]
    row = load_rows(tmp_path / "dict", split="test")[0]
    assert set(row["image"]) == {"bytes", "path"} and row["image"]["bytes"][:4] == b"\x89PNG"
    assert isinstance(row["frames"][1], dict)
    assert load_rows(tmp_path / "single")[0]["query"] == "<image>Colour?"
    with pytest.raises(DataError, match="no split 'validation'.*train, test"):
        load_rows(tmp_path / "dict", split="validation")


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="not found.*nope.jsonl"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DataError, match=r"d.txt.*'\.txt'"):
        load_rows(tmp_path / "d.txt")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl is empty"):
        load_rows(tmp_path / "empty.jsonl")


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"query": "a"}\n{"query": "b"}\n{"query": "c"\n{"query": "d"}\n')
    with pytest.raises(DataError) as caught:
        load_rows(path)
    assert "bad.jsonl, line 3" in str(caught.value)

    path = tmp_path / "bad.json"
    path.write_text('[\n  {"query": "a"},\n  {"query": b}\n]\n')
    with pytest.raises(DataError) as caught:
        load_rows(path)
    assert "bad.json, line 3" in str(caught.value)

    path = tmp_path / "list_line.jsonl"
    path.write_text('{"query": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match="list_line.jsonl, line 2"):
        load_rows(path)
