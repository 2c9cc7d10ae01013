"""Every script in benchmarks/ runs end to end at tiny settings, as a user would start it, so a
change to what a script calls breaks a test here, not the user's run. Figures are not checked
(benchmarks print them); the exit code and the script's own final output are.

The vLLM ones run in .venv-vllm: tests/test_vllm_benchmarks.py. benchmarks/cuda_check.py needs a
GPU and is exercised by its own --dry_run_on_cpu where it has one; benchmarks/gpu_suite.py's
--dry_run_on_cpu runs in tests/test_benchmark_gpu_suite.py, which also reads its report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# script -> (arguments at tiny settings, a text or texts its output must contain). {tmp} is a fresh folder.
SMOKE = {
    "answer_distribution.py": (["--model", "tiny:qwen2-vl", "--limit", "4"], ""),
    "checkpoint_stall.py": (["--sizes", "tiny", "--repeats", "1", "--steps", "2"], ""),
    "data_workers.py": (["--steps", "2", "--skip", "1", "--pairs", "1"], ""),
    "entropy_kernel.py": (["cpu"], ""),
    "feature_probe.py": (["--train_rows", "16", "--test_rows", "8"], ""),
    "judge.py": (["--prompts", "1", "--num_generations", "2", "--completion_tokens", "4", "--judge_tokens", "2",
                  "--batch_size", "2", "--repeats", "1"], ""),
    "mixed_lengths.py": (["--prompts", "4", "--num_generations", "2", "--long_every", "2", "--short", "2", "--long", "4",
                          "--repeats", "1"], ""),
    "scaling.py": (["--steps", "2", "--repeats", "1", "--hidden_size", "128", "--layers", "1", "--configs", "zero3:1", "fsdp2:2",
                    "--output", "{tmp}/scaling.md"], ""),
    "shared_prefix.py": (["--num_prompts", "1", "--num_generations", "2", "--max_new_tokens", "4", "--repeats", "1",
                          "--image_size", "56", "--family", "qwen2-vl,qwen3.5"], "| `qwen3.5` |"),
    # here without vLLM (its column: .venv-vllm); the greedy answers of the loop and the batched eval compared
    "eval_speed.py": (["--limit", "4", "--num_samples", "1,2", "--max_new_tokens", "4"], ("| 1 | ", "| True |")),
    # its `smoke` preset: one warm-up and one timed step per system, the FLOP-count runs included;
    # fixed-length completions in both (mmgrpo's --suppress_eos, TRL's suppress_tokens)
    "vs_trl.py": (["--preset", "smoke", "--work_dir", "{tmp}/work"],
                  ("completion length mmgrpo 4, trl 4", "samples/s", "CPU s/step", "peak RSS (MB)", "  s/step rollout",
                   "executed GFLOP/step", "mmgrpo/TRL samples/s ratio", "mmgrpo/TRL executed FLOPs ratio")),
    # --smoke: small media, G=2, one step per run; mmgrpo with 2 workers and in-process and TRL on the
    # images, mmgrpo with 2 workers on the clips; the table's rows and TRL's processor calls counted
    "media_prep.py": (["--smoke", "--work_dir", "{tmp}/work"],
                      ("media on the critical path, s/step", "share of the step", "processor calls in the trainer",
                       "workers' peak USS, MB", "mmgrpo 2 workers / TRL", "one 4-frame 112-px clip per prompt")),
    # one weight, 8 rows: one GEMM against blocks of its rows, and the two results compared
    "wide_linear.py": (["--shapes", "gate-3b", "--rows", "8", "--repeats", "1"], "| gate-3b | 11,008 x 2,048 | 8 |"),
    "token_budget.py": (["--prompts", "2", "--num_generations", "2", "--repeats", "1"], ""),
    # N = 1 and 2 ranks (torchrun, gloo) on the tiny Qwen2.5-VL: the split run's row is half the tokens
    "sequence_parallel.py": (["--smoke"], ("| 1 | 52 |", "| 2 | 26 |")),
    "zoom_tool.py": (["--models", "tiny:qwen2-vl", "--model_type", "qwen2-vl", "--limit", "2",
                      "--max_completion_length", "16", "--batch_size", "2"], ""),
    "learning_vs_trl.py": (["--tasks", "shapes-color", "--seeds", "0", "--steps", "2", "--save_every", "1",
                            "--eval_limit", "4", "--num_generations", "2", "--prompts_per_step", "2",
                            "--max_completion_length", "8", "--sft_model", "tiny:qwen2-vl",
                            "--work_dir", "{tmp}/work", "--output_dir", "{tmp}/out"], ""),
    "fusion_probe_cost.py": (["--steps", "2", "--rows", "2"], ""),
    "fusion_vs_lora.py": (["--sft_model", "tiny:qwen2-vl", "--tasks", "shapes-color", "--seeds", "0", "--steps", "1", "--probe_steps", "1", "--prompts_per_step", "4",
                           "--eval_limit", "2", "--work_dir", "{tmp}/work", "--output_dir", "{tmp}/out"], ""),
}
ELSEWHERE = {"rollout_engines.py": "tests/test_vllm_benchmarks.py", "weight_sync.py": "tests/test_vllm_weight_sync_benchmark.py",
             "cuda_check.py": "a GPU (its own --dry_run_on_cpu)",
             "gpu_suite.py": "tests/test_benchmark_gpu_suite.py (its --dry_run_on_cpu; the report's figures checked)",
             "async_rollout.py": "tests/test_async.py (its --smoke, each mode's staleness checked)",
             "soak.py": "tests/test_soak.py (its --smoke, with the samples and the slope checked)"}


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
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in output, f"{script}: no {text!r} in its output\n{output[-3000:]}"
