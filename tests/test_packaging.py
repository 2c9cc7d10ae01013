"""The wheel carries what an installed mmgrpo needs beyond its modules: the built-in dataset registry.

Built with the venv's setuptools (no network), extracted, and imported from there in a fresh
process, away from the editable install.
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_builtin_registry(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(tmp_path.glob("mmgrpo-*.whl"))
    assert "mmgrpo/datasets_cfg/builtin.yaml" in zipfile.ZipFile(wheel).namelist()
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import mmgrpo, mmgrpo.data.catalog as r; print(mmgrpo.__file__); "
        "print(sorted(r.load_registry()))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    module_file, names = run.stdout.splitlines()[-2:]
    assert module_file.startswith(str(tmp_path / "site"))  # the extracted wheel, not the checkout
    assert "shapes-color" in names and "tones-pitch" in names
