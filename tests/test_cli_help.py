"""Every command's --help answers at once: it parses its flags before importing torch and the models."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmgrpo.cli import COMMANDS

PROBE = """
import sys
from mmgrpo.cli import main
try:
    main([sys.argv[1], "--help"])
except SystemExit:
    pass
print(sorted(name for name in ("torch", "transformers", "vllm") if name in sys.modules))
"""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_imports_no_heavy_library(command):
    done = subprocess.run([sys.executable, "-c", PROBE, command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert "usage:" in done.stdout and lines[-1] == "[]", f"mmgrpo {command} --help imported {lines[-1]}"
