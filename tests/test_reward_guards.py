"""Rewards that must not reach training: NaN / inf values are errors naming the reward and the sample
(skips with --reward_errors none), and a call past --reward_timeout is stopped, never a hang."""

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mmgrpo.errors import RewardError
from mmgrpo.rewards import compute_rewards

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {"sample_id": ["shapes/train/0", "shapes/train/1", "shapes/train/2"]}


def half_nan(completions, **columns):
    return [0.5, float("nan"), 1.0]


def infinite(completions, **columns):
    return [1.0, 1.0, -math.inf]


@pytest.mark.parametrize("func, sample, value", [(half_nan, "sample 1 (id 'shapes/train/1')", "nan"),
                                                 (infinite, "sample 2 (id 'shapes/train/2')", "-inf")])
def test_nonfinite_rewards_are_errors_naming_reward_and_sample(func, sample, value):
    with pytest.raises(RewardError, match=f"^reward '{func.__name__}' returned {value} for {re_escape(sample)}; a reward must be a finite number"):
        compute_rewards([func], None, ["a", "b", "c"], COLUMNS)


def test_with_reward_errors_none_they_are_skipped_never_trained_on():
    per_func, total = compute_rewards([half_nan, infinite], None, ["a", "b", "c"], COLUMNS, on_error="none")
    assert per_func[0, 1].isnan() and per_func[1, 2].isnan()  # skipped, as a None would be
    assert total.tolist() == [1.5, 1.0, 1.0] and total.isfinite().all()


def re_escape(text):
    import re

    return re.escape(text)


def sleeper(completions, **columns):
    time.sleep(3600)


def swallower(completions, **columns):
    """An endless loop that catches every Exception: the timeout must still get through."""
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass


def quick(completions, **columns):
    return [1.0 for _ in completions]


@pytest.mark.parametrize("func", [sleeper, swallower])
def test_a_call_past_the_timeout_is_stopped_in_the_main_thread(func):
    threads = set(threading.enumerate())  # earlier tests' threads (e.g. a DataLoader's) are not this one's
    start = time.monotonic()
    with pytest.raises(RewardError, match=f"reward '{func.__name__}' did not return within --reward_timeout 0.5 s on a batch of 3"):
        compute_rewards([func], None, ["a", "b", "c"], COLUMNS, timeout=0.5)
    assert time.monotonic() - start < 3
    per_func, total = compute_rewards([func, quick], None, ["a", "b", "c"], COLUMNS, on_error="none", timeout=0.5)
    assert per_func[0].isnan().all() and total.tolist() == [1.0, 1.0, 1.0]
    assert set(threading.enumerate()) <= threads  # nothing left running
    assert compute_rewards([quick], None, ["a"], {}, timeout=0.5)[1].tolist() == [1.0]


def test_from_another_thread_a_stuck_call_is_abandoned_once():
    results = {}

    def loop_step():
        start = time.monotonic()
        per_func, _ = compute_rewards([sleeper, quick], None, ["a", "b"], {}, on_error="none", timeout=0.5)
        results["first"] = (time.monotonic() - start, per_func[0].isnan().all().item())
        start = time.monotonic()  # the stuck call still runs: the next call of that reward fails at once
        per_func, _ = compute_rewards([sleeper, quick], None, ["a", "b"], {}, on_error="none", timeout=0.5)
        results["second"] = (time.monotonic() - start, per_func[0].isnan().all().item())

    thread = threading.Thread(target=loop_step)
    thread.start()
    thread.join(10)
    assert results["first"][0] < 2 and results["first"][1]
    assert results["second"][0] < 0.3 and results["second"][1]
    stuck = [t for t in threading.enumerate() if t.name == "reward sleeper"]
    assert len(stuck) == 1 and stuck[0].daemon  # one abandoned thread, which does not hold up exit


def test_a_reward_stuck_in_native_code_ends_the_process_with_a_message(tmp_path):
    script = tmp_path / "native.py"
    script.write_text(
        "import ctypes\n"
        "from mmgrpo.rewards import compute_rewards, timeout\n"
        "timeout.GRACE_S = 1.0\n"
        "def native(completions, **columns):\n"
        "    ctypes.CDLL(None).system(b'sleep 8 >/dev/null 2>&1')  # waits in C and retries after signals\n"
        "compute_rewards([native], None, ['a'], {}, timeout=0.5)\n"
    )
    start = time.monotonic()
    with open(tmp_path / "stderr", "w") as stderr:  # a file, not a pipe: `sleep` would hold a pipe open after the exit
        completed = subprocess.run([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=stderr, timeout=60,
                                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert completed.returncode == 2 and time.monotonic() - start < 7.5
    message = "reward 'native' has run 2 s, past --reward_timeout 0.5, and cannot be interrupted"
    assert message in (tmp_path / "stderr").read_text()


PLUGIN = '''
import time

def nan_reward(completions, **columns):
    return [float("nan")] + [0.5] * (len(completions) - 1)

def hangs(completions, **columns):
    time.sleep(3600)
'''


@pytest.mark.parametrize("reward, message", [
    ("nan_reward", r"reward 'nan_reward' returned nan for sample 0 \(id 'shapes-color/train/\d+'\)"),
    ("hangs", "reward 'hangs' did not return within --reward_timeout 2 s"),
])
def test_train_stops_with_exit_code_2(tmp_path, reward, message):
    plugin = tmp_path / "rewards.py"
    plugin.write_text(PLUGIN)
    completed = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
         "--reward_funcs", f"{plugin}:{reward}", "--reward_timeout", "2", "--num_generations", "2",
         "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--dataloader_num_workers", "0",
         "--max_steps", "1", "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)),
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith("mmgrpo train: error: ") and __import__("re").search(message, last), last
