"""Data that used to end in a traceback: a row that is not UTF-8 (the file, line and column are
named) and a split asked of a plain file (which has none); one line and exit 2 from the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.data.loaders import check_utf8, load_rows
from mmgrpo.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
GOOD = json.dumps({"messages": [{"role": "user", "content": "héllo 世界"}], "solution": "a"}, ensure_ascii=False)
LATIN1 = '{"messages": [{"role": "user", "content": "caf\xe9"}], "solution": "b"}'.encode("latin-1")


@pytest.mark.parametrize("suffix, content, line, column", [
    (".jsonl", (GOOD + "\n").encode() * 2 + LATIN1 + b"\n", 3, 47),
    (".json", b"[" + GOOD.encode() + b",\n" + LATIN1 + b"]\n", 2, 47),
    (".csv", b"query,solution\nhi,a\ncaf\xe9,b\n", 3, 4),
])
def test_a_row_that_is_not_utf8_names_file_line_and_column(tmp_path, suffix, content, line, column):
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"^{path}, line {line}: not valid UTF-8 \\(byte 0xe9 at column {column}\\); save the file as UTF-8"):
        load_rows(path)


def test_utf8_split_across_read_chunks_is_fine(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text((GOOD + "\n") * 3, encoding="utf-8")
    for chunk_size in (1, 2, 3, 5):
        check_utf8(path, chunk_size=chunk_size)
    assert len(load_rows(path)) == 3


def test_a_split_of_a_plain_file_is_an_error_the_default_split_is_not(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(GOOD + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"dataset '{path}:test': {path} is one file, with no split 'test' .*drop ':test'"):
        resolve_dataset(f"{path}:test")
    assert len(resolve_dataset(str(path), split="test")) == 1  # e.g. --eval_dataset's default split


@pytest.mark.parametrize("bad", ["latin1", "split"])
def test_the_cli_says_it_in_one_line_with_exit_code_2(tmp_path, bad):
    path = tmp_path / "rows.jsonl"
    path.write_bytes((GOOD + "\n").encode() + (LATIN1 + b"\n" if bad == "latin1" else b""))
    spec = f"{path}:test" if bad == "split" else str(path)
    completed = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--dataset", spec, "--reward_funcs", "answer_format",
         "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)),
    )
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    expected = f"{path}, line 2: not valid UTF-8" if bad == "latin1" else f"{path} is one file, with no split 'test'"
    assert completed.stderr.strip().splitlines()[-1].startswith("mmgrpo train: error: ") and expected in completed.stderr
