"""The docs run as written: every Python snippet of README.md and docs/*.md, the `>>>` examples, and
the README's commands, on a fresh checkout at the sizes they give (tiny models, a few steps).

A page's snippets run in order in one fresh interpreter, in an empty folder, after the files it
tells the reader to save (a block opening with `# my_file.py`, or introduced by "Save this as
`my_file.py`" / "`my_file.py` holds"). Blocks that are signatures rather than code (they do not
compile) and blocks marked `<!-- not run: REASON -->` (a GPU, a network) are left out; the README's
`mmgrpo` command lines run through this interpreter. (Flags in every command line of the docs:
tests/test_docs_flags.py.)
"""

import doctest
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- not run: (?P<skip>[^>]*)-->\s*)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
SAVED_AS = re.compile(r"(?:[Ss]ave this as|where) `(?P<name>[\w./-]+\.py)`(?: holds)?[^\n]*:\s*$")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")


def snippets(page: Path) -> tuple[dict[str, str], list[str]]:
    """({file name: source} to save, [code blocks to run in order]) of a page's Python blocks."""
    text = page.read_text()
    files, code = {}, []
    for match in BLOCK.finditer(text):
        if match["lang"] != "python" or match["skip"] or ">>>" in match["body"]:
            continue
        body = match["body"]
        first = body.splitlines()[0].strip()
        before = SAVED_AS.search(text[max(0, match.start() - 200):match.start()].rstrip() + "\n")
        name = first[2:].strip() if re.fullmatch(r"# [\w./-]+\.py", first) else (before["name"] if before else None)
        try:
            compile(body, f"{page.name} snippet", "exec")
        except SyntaxError:
            continue  # a signature sketch, not code
        if name:
            files[name] = body
        else:
            code.append(body)
    return files, code


RUNNABLE = [page for page in PAGES if snippets(page)[1]]


@pytest.mark.parametrize("page", RUNNABLE, ids=[page.name for page in RUNNABLE])
def test_every_python_snippet_of_a_page_runs_as_written(page, tmp_path):
    files, code = snippets(page)
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    script = "\n\n".join(f"# ---- snippet {i + 1} of {page.name}\n{block}" for i, block in enumerate(code))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{page.name}: a snippet failed:\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if ">>>" in p.read_text()], ids=lambda p: p.name)
def test_the_examples_of_a_page_give_what_it_prints(page):
    """The page's `>>>` blocks, in order, in one namespace, as doctests (`...` elides)."""
    text = "\n\n".join(match["body"] for match in BLOCK.finditer(page.read_text()) if ">>>" in match["body"])
    test = doctest.DocTestParser().get_doctest(text, {}, page.name, str(page), 0)
    failures: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=failures.append)
    assert runner.tries > 0 and runner.failures == 0, "".join(failures)


def readme_commands() -> list[list[str]]:
    """The README's `mmgrpo ...` command lines (continuations joined), as argument lists."""
    commands = []
    for match in BLOCK.finditer((ROOT / "README.md").read_text()):
        if match["lang"] not in ("bash", "sh") or match["skip"]:
            continue
        for line in match["body"].replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if re.match(r"(\.venv/bin/)?mmgrpo ", line) and line.split()[1] not in ("demo",):
                commands.append(shlex.split(line)[1:])
    return commands


def test_the_readmes_commands_run_as_written(tmp_path):
    commands = readme_commands()
    assert any(command[0] == "train" for command in commands)
    for command in commands:
        args = [arg.replace("runs/", f"{tmp_path}/runs/") if arg.startswith("runs/") else arg for arg in command]
        args = [str(ROOT / arg) if arg.startswith("mmgrpo/demo") else arg for arg in args]
        done = subprocess.run([sys.executable, "-m", "mmgrpo", *args], cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"mmgrpo {' '.join(command)}:\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr
        if command[0] == "train":  # the first command learns: its groups' rewards differ
            rows = [json.loads(line) for line in (tmp_path / "runs" / "try" / "metrics.jsonl").read_text().splitlines()]
            assert min(row["frac_reward_zero_std"] for row in rows) < 1.0
