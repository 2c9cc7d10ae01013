"""Every script in benchmarks/ runs end to end at tiny settings, as a user would start it, so a
change to what a script calls breaks a test here, not the user's run. Figures are not checked
(benchmarks print them); the exit code and the script's own final output are.

The vLLM ones run in .venv-vllm: tests/test_vllm_benchmarks.py. benchmarks/cuda_check.py needs a
GPU and is exercised by its own --dry_run_on_cpu where it has one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# script -> (arguments at tiny settings, a text its output must contain). {tmp} is a fresh folder.
SMOKE = {
    "answer_distribution.py": (["--model", "tiny:qwen2-vl", "--limit", "4"], ""),
    "async_rollout.py": (["--repeats", "1", "--steps", "1", "--warmup", "0", "--num_generations", "2", "--prompts", "1",
                          "--max_completion_length", "4", "--image_size", "56"], ""),
    "checkpoint_stall.py": (["--sizes", "tiny", "--repeats", "1", "--steps", "2"], ""),
    "data_workers.py": (["--steps", "3", "--skip", "1", "--pairs", "1"], ""),
    "entropy_kernel.py": (["cpu"], ""),
    "feature_probe.py": (["--train_rows", "16", "--test_rows", "8"], ""),
    "judge.py": (["--prompts", "1", "--num_generations", "2", "--completion_tokens", "4", "--judge_tokens", "2",
                  "--batch_size", "2", "--repeats", "1"], ""),
    "mixed_lengths.py": (["--prompts", "4", "--num_generations", "2", "--long_every", "2", "--short", "2", "--long", "4",
                          "--repeats", "1"], ""),
    "scaling.py": (["--steps", "2", "--repeats", "1", "--hidden_size", "64", "--layers", "1",
                    "--output", "{tmp}/scaling.md"], ""),
    "shared_prefix.py": (["--num_prompts", "1", "--num_generations", "2", "--max_new_tokens", "4", "--repeats", "1",
                          "--image_size", "56"], ""),
    "vs_trl.py": (["--preset", "small", "--repeats", "1", "--steps", "2", "--work_dir", "{tmp}/work"], ""),
    "token_budget.py": (["--prompts", "2", "--num_generations", "2", "--repeats", "1"], ""),
    "zoom_tool.py": (["--models", "tiny:qwen2-vl", "--model_type", "qwen2-vl", "--limit", "2",
                      "--max_completion_length", "16", "--batch_size", "2"], ""),
    "learning_vs_trl.py": (["--tasks", "shapes-color", "--seeds", "0", "--steps", "2", "--save_every", "1",
                            "--eval_limit", "4", "--num_generations", "2", "--prompts_per_step", "2",
                            "--max_completion_length", "8", "--sft_model", "tiny:qwen2-vl",
                            "--work_dir", "{tmp}/work", "--output_dir", "{tmp}/out"], ""),
}
ELSEWHERE = {"rollout_engines.py": "tests/test_vllm_benchmarks.py", "cuda_check.py": "a GPU (its own --dry_run_on_cpu)"}


def run_script(script: str, args: list[str], tmp_path: Path, python: str = sys.executable) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = subprocess.run([python, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{script} {' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts == set(SMOKE) | set(ELSEWHERE), f"no smoke run for {sorted(scripts - set(SMOKE) - set(ELSEWHERE))}"


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_at_tiny_settings(script, tmp_path):
    args, expected = SMOKE[script]
    output = run_script(script, args, tmp_path)
    assert expected in output
