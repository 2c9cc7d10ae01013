""".ci/ensure_chromium, which `make test` runs first: nothing when Chromium is there; the Debian
install when it is missing and this user may install; otherwise one line saying what to run."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "ensure_chromium"


def run(*prefix, script=SCRIPT, **env):
    return subprocess.run([*prefix, "sh", str(script)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "MMGRPO_DRY_RUN": "1", **env})


def readable_by_anyone(script: Path) -> Path:
    """A copy of `script` that another user can read: the checkout may lie in a folder only its
    owner can enter (`mktemp -d` makes such folders), and so may pytest's tmp_path."""
    folder = Path(tempfile.mkdtemp(prefix="mmgrpo-chromium-"))
    folder.chmod(0o755)
    copy = folder / script.name
    shutil.copy(script, copy)
    copy.chmod(0o644)
    return copy


def test_present_means_nothing_to_do(tmp_path):
    fake = tmp_path / "chromium"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    done = run(CHROMIUM_BIN=str(fake))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.skipif(not shutil.which("apt-get") or os.geteuid() != 0, reason="the install path runs as root on Debian")
def test_missing_is_installed_from_debian_as_root():
    done = run(CHROMIUM_BIN="no-such-chromium")
    assert done.returncode == 0
    assert done.stdout.strip() == "sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium'"


@pytest.mark.skipif(not shutil.which("apt-get") or os.geteuid() != 0 or not shutil.which("runuser"),
                    reason="needs root to run the script as an unprivileged user on Debian")
def test_an_unprivileged_user_is_told_what_to_run():
    script = readable_by_anyone(SCRIPT)
    try:
        done = run("runuser", "-u", "nobody", "--", "env", script=script, CHROMIUM_BIN="no-such-chromium")
        skipped = run("runuser", "-u", "nobody", "--", "env", script=script, CHROMIUM_BIN="no-such-chromium",
                      MMGRPO_SKIP_BROWSER="1")
    finally:
        shutil.rmtree(script.parent)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("make test: headless Chromium is needed by tests/test_eval_report.py: run sudo sh -c 'apt-get")
    assert done.stderr.strip().endswith("or MMGRPO_SKIP_BROWSER=1 make test to skip that test")
    assert (skipped.returncode, skipped.stderr) == (0, "")
