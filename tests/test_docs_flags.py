"""Every `--flag` the docs name is a real flag, so a renamed flag cannot leave the docs behind.

- the flag tables of docs/*.md (rows that start with "| `--"): each flag of the first cell is a flag
  of one of mmgrpo's commands (`train`, `sft`, `eval`, `estimate`, `rollout-server` ... each has a
  parser of its own);
- every command line in docs/*.md and README.md (`mmgrpo train ...`, `python -m mmgrpo sft ...`,
  continued over `\\` lines): each flag after the command is a flag of that command.

Flags of other tools (torchrun, sbatch, the benchmarks' scripts) named in prose are not checked.
"""

import contextlib
import io
import re
import sys
from functools import cache
from pathlib import Path

import pytest

from mmgrpo.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
COMMANDS = ("train", "sft", "eval", "compare", "report", "export", "rollout-server", "estimate", "datasets", "demo",
            "viz attention")
COMMAND_LINE = re.compile(r"\bmmgrpo(?:\.cli)?\s+(" + "|".join(COMMANDS) + r")\b(.*)")
END_OF_COMMAND = re.compile(r"`|\|\s|&&|;|\)|\s#")  # a code span's end, a pipe, the next command, a comment


@cache
def command_flags(command: str) -> frozenset[str]:
    """The flags `mmgrpo <command> --help` lists."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        cli_main([*command.split(), "--help"])
    return frozenset(FLAG.findall(out.getvalue()))


def table_flags() -> list[tuple[str, int, str]]:
    """(file, line, flag) of every flag in the first cell of a flag table's row."""
    found = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("| `--"):
                found += [(path.name, number, flag) for flag in FLAG.findall(line.split(" | ")[0])]
    return found


def command_line_flags() -> list[tuple[str, str, str, str]]:
    """(file, command, flag, line) of every flag given to an mmgrpo command in the docs."""
    found = []
    for path in [*DOCS, ROOT / "README.md"]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # a command continued over lines is one line
        for line in text.splitlines():
            for match in COMMAND_LINE.finditer(line):
                given = END_OF_COMMAND.split(match.group(2))[0]
                found += [(path.name, match.group(1), flag, line.strip()) for flag in FLAG.findall(given)]
    return found


def test_every_command_has_flags():
    assert all(command_flags(command) for command in COMMANDS)
    assert "--beta" in command_flags("train") and "--stop_at" in command_flags("sft")
    assert "--stop_at" not in command_flags("train") and "--fusion_probe" in command_flags("eval")


def test_every_flag_in_a_docs_table_is_a_flag_of_a_command():
    known = frozenset().union(*map(command_flags, COMMANDS))
    rows = table_flags()
    assert len(rows) > 60  # the tables were found
    stale = [f"docs/{name}:{number}: {flag}" for name, number, flag in rows if flag not in known]
    assert not stale, "flags in the docs' tables that no command has:\n" + "\n".join(stale)


def test_every_flag_of_a_documented_command_line_is_a_flag_of_that_command():
    given = command_line_flags()
    assert len(given) > 300 and {command for _, command, _, _ in given} >= {"train", "sft", "eval", "estimate"}
    stale = [f"{name}: mmgrpo {command} {flag}   ({line[:120]})" for name, command, flag, line in given
             if flag not in command_flags(command)]
    assert not stale, "flags the docs give a command that it does not take:\n" + "\n".join(stale)


@pytest.mark.parametrize("line, command, flags", [
    ("    mmgrpo train --model tiny:qwen2-vl \\\n        --beta 0  # no reference", "train", ["--model", "--beta"]),
    ("run `mmgrpo eval --model runs/x --fusion_probe` then `--foo`", "eval", ["--model", "--fusion_probe"]),
    ("torchrun --nproc_per_node 2 -m mmgrpo sft --max_steps 10 | tee log", "sft", ["--max_steps"]),
])
def test_a_command_lines_flags_are_read_up_to_its_end(tmp_path, monkeypatch, line, command, flags):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(line + "\n")
    (tmp_path / "README.md").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [tmp_path / "docs" / "page.md"])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [(c, f) for _, c, f, _ in command_line_flags()] == [(command, flag) for flag in flags]
