"""A model folder with a missing, truncated or corrupt file is one line naming the file (exit 2 from
the CLI), never a traceback from inside transformers; a whole folder passes untouched."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from mmgrpo.errors import CheckpointError
from mmgrpo.models.integrity import check_model_folder
from mmgrpo.models.loading import load_model, load_processor


@pytest.fixture
def folder(tmp_path, tiny_qwen2_vl_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_qwen2_vl_path, copy)
    return copy


def test_a_whole_folder_loads(folder):
    check_model_folder(folder, weights=True)
    load_model(str(folder))
    load_processor(str(folder))


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: truncate(d / "model.safetensors", os.path.getsize(d / "model.safetensors") // 2),
         r"model.safetensors is truncated: \d+ bytes, \d+ expected"),
        (lambda d: truncate(d / "model.safetensors", 5), r"model.safetensors is truncated or not a safetensors file \(5 bytes"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"),
         "model.safetensors has a corrupt header"),
        (lambda d: (d / "model.safetensors").unlink(), "config.json but no weights file"),
        (lambda d: truncate(d / "config.json", 0), r"config.json is empty \(0 bytes\)"),
        (lambda d: truncate(d / "config.json", 40), r"config.json is not valid JSON \(.* at line \d+; truncated or corrupt\)"),
        (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), "config.json is not UTF-8 text"),
    ],
)
def test_damaged_model_files_are_named(folder, damage, message):
    damage(folder)
    with pytest.raises(CheckpointError, match=f"^model folder {folder}: {message}") as raised:
        load_model(str(folder))
    assert "\n" not in str(raised.value) and "earlier checkpoint" in str(raised.value)


def test_a_missing_shard_of_a_sharded_checkpoint_is_named(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names model-00002-of-00002.safetensors, which is missing \\(1 of 2 shards\\)"):
        load_model(str(folder))


def test_a_truncated_tokenizer_is_named_when_the_processor_loads(folder):
    truncate(folder / "tokenizer.json", 100)
    with pytest.raises(CheckpointError, match="tokenizer.json is not valid JSON"):
        load_processor(str(folder))


def test_the_cli_says_it_in_one_line_with_exit_code_2(folder):
    truncate(folder / "model.safetensors", 1000)
    completed = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "eval", "--model", str(folder), "--model_type", "qwen2-vl",
         "--dataset", "shapes-color:test", "--output_dir", str(folder.parent / "eval")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("mmgrpo eval: error: model folder") and "model.safetensors is truncated" in lines[-1]
    assert "Traceback" not in completed.stderr
