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


def test_pip_installs_the_wheel_into_an_existing_environment(tmp_path):
    """A user's environment that already holds torch, transformers ... (here: a venv that sees this
    checkout's .venv packages through a .pth file): `pip install mmgrpo-*.whl` adds the package and the
    `mmgrpo` command, which runs from there; the wheel declares the extras docs/training.md names."""
    import email
    import sysconfig

    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("mmgrpo-*.whl"))
    metadata = email.message_from_bytes(zipfile.ZipFile(wheel).read(
        next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))))
    assert {"vllm", "deepspeed", "lora", "video", "audio", "eval"} <= set(metadata.get_all("Provides-Extra"))
    assert any(r.startswith("vllm") and 'extra == "vllm"' in r for r in metadata.get_all("Requires-Dist"))

    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "existing.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the packages already there
    installed = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                               capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import mmgrpo; print(mmgrpo.__file__)"], capture_output=True, text=True,
                           cwd=tmp_path, env=env)
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr  # the installed copy, not the checkout
    helped = subprocess.run([str(env_dir / "bin" / "mmgrpo"), "train", "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=env)
    assert helped.returncode == 0 and "--num_generations" in helped.stdout, helped.stderr[-2000:]
