"""Resume decides explicitly (mmgrpo/training/resume_flags.py): the checkpoint records the run's flags;
a resumed run that changes one it must keep is refused naming the flag with both values, before
any model loads; one that may change (the schedule, how the run is saved and logged) is allowed with
one line, takes effect by a documented rule, and config.yaml records it with its step."""

import json
import math

import pytest
import yaml

from mmgrpo.config import TrainConfig
from mmgrpo.config.domains import flag
from mmgrpo.config.flags import _leaves
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.runstate.checkpoint import save_atomically
from mmgrpo.runstate.state import TrainState
from mmgrpo.training.optim import make_scheduler
from mmgrpo.training.resume import STATE_FILE
from mmgrpo.training.resume_flags import (
    NOT_COMPARED,
    OPERATIONAL,
    REFUSED,
    SCHEDULE,
    STALENESS,
    group_peaks,
    retarget_schedule,
)
from mmgrpo.training.startup_checks import check_train_flags, fill_model_type, fill_precision

BASE = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", "vqa_accuracy", "answer_format",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "4",
        "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--report_to", "none"]


def config(out, *flags):
    return TrainConfig.from_args([*BASE, "--output_dir", str(out), *flags])


def test_every_flag_is_refused_allowed_or_not_compared():
    """Each flag's kind is declared beside it (mmgrpo/config/schema.py), refused unless said otherwise."""
    names = [path[-1] for path, _, _ in _leaves(TrainConfig)]
    kinds = [set(REFUSED), set(SCHEDULE), set(STALENESS), set(OPERATIONAL), set(NOT_COMPARED)]
    unclassified = [name for name in names if not any(name in kind for kind in kinds)]
    assert not unclassified, f"declare these flags' resume kind in mmgrpo/config/schema.py: {unclassified}"
    assert sum(len(kind) for kind in kinds) == len(set().union(*kinds)) == len(names)  # each in one kind only
    assert {"seed", "model", "loss_type"} <= kinds[0] and {"learning_rate", "max_steps"} <= kinds[1]
    with pytest.raises(ValueError, match="resume='sometimes'"):
        flag(0, resume="sometimes")


def checkpoint_of(out, *flags, step=4, in_flight=0):
    """A complete checkpoint whose run had these flags (what preflight and check_train_flags read of it)."""
    cfg = config(out, *flags)
    fill_model_type(cfg.model)  # as train() records them: --model_type from a tiny: name
    fill_precision(cfg)  # ... and --bf16 as this machine resolves it
    state = TrainState(step=step, flags=cfg.to_dict(), rollout_in_flight=in_flight)
    save_atomically(out / f"checkpoint-{step}", lambda d: (d / STATE_FILE).write_text(json.dumps(state.__dict__)))


@pytest.mark.parametrize("flags, refused", [
    (["--num_generations", "2"], "--num_generations 4 -> 2"),  # with a batch that still divides
    (["--num_generations", "3"], "--num_generations 4 -> 3"),  # named, not the batch it no longer divides
    (["--per_device_train_batch_size", "4"], "--per_device_train_batch_size 8 -> 4"),
    (["--seed", "1"], "--seed 0 -> 1"),
    (["--reward_funcs", "answer_format"], "--reward_funcs vqa_accuracy answer_format -> answer_format"),
    (["--dataset", "shapes-count"], "--dataset shapes-color -> shapes-count"),
    (["--model", "tiny:qwen2.5-vl"], "--model tiny:qwen2-vl -> tiny:qwen2.5-vl; --model_type qwen2-vl -> qwen2.5-vl"),
    (["--beta", "0"], "--beta 0.04 -> 0.0"),
    (["--temperature", "0.7", "--seed", "3"], "--seed 0 -> 3; --temperature 1.0 -> 0.7"),
])
def test_a_change_that_breaks_the_run_is_refused_naming_the_flag(tmp_path, flags, refused):
    checkpoint_of(tmp_path)
    with pytest.raises(ConfigError) as raised:
        check_train_flags(config(tmp_path, "--resume_from_checkpoint", "latest", *flags))
    assert str(raised.value) == (
        f"--resume_from_checkpoint {tmp_path / 'checkpoint-4'}: {refused}: a resumed run keeps the flags that decide what "
        "it computes and the order it reads data in (docs/training.md lists those that may change); resume with the "
        "checkpoint's values, or start a new run in another --output_dir")


def test_max_steps_below_the_checkpoint_is_refused(tmp_path):
    checkpoint_of(tmp_path, "--max_steps", "12", step=8)
    with pytest.raises(ConfigError, match=r"--max_steps 6: the checkpoint .*checkpoint-8 is at step 8, past it"):
        check_train_flags(config(tmp_path, "--resume_from_checkpoint", "latest", "--max_steps", "6"))


def test_a_component_rate_given_or_dropped_is_refused_and_a_new_one_is_allowed(tmp_path):
    checkpoint_of(tmp_path)
    with pytest.raises(ConfigError, match=r"--vit_lr None -> 0.0001: the optimizer's parameter groups would differ"):
        check_train_flags(config(tmp_path, "--resume_from_checkpoint", "latest", "--vit_lr", "1e-4"))
    checkpoint_of(tmp_path / "vit", "--vit_lr", "1e-4")
    check_train_flags(config(tmp_path / "vit", "--resume_from_checkpoint", "latest", "--vit_lr", "5e-5"))  # the schedule's rule


def test_a_synchronous_resume_of_rollouts_in_flight_is_refused_and_another_k_allowed(tmp_path):
    checkpoint_of(tmp_path, "--max_staleness", "2", in_flight=2)
    with pytest.raises(ConfigError, match=r"saved by asynchronous training with 2 rollout\(s\) in flight; resume with "
                                          r"--max_staleness 2"):
        check_train_flags(config(tmp_path, "--resume_from_checkpoint", "latest"))
    for k in ("1", "3"):  # a smaller K generates the rollouts too stale again (tests/test_async.py)
        check_train_flags(config(tmp_path, "--resume_from_checkpoint", "latest", "--max_staleness", k))


def test_a_new_learning_rate_moves_its_groups_and_leaves_a_component_rate_alone():
    import torch

    params = [torch.zeros(1, requires_grad=True) for _ in range(2)]
    optimizer = torch.optim.AdamW([{"name": "llm", "params": [params[0]], "lr": 1e-3},
                                   {"name": "vit", "params": [params[1]], "lr": 1e-4}])
    scheduler = make_scheduler(config("x", "--lr_scheduler_type", "constant").optim, optimizer, total_steps=8)
    old = {"learning_rate": 1e-3, "vit_lr": 1e-4, "aligner_lr": None, "fusion_lr": None}
    new = {**old, "learning_rate": 5e-4}
    assert group_peaks(optimizer, old) == [1e-3, 1e-4] and group_peaks(optimizer, new) == [5e-4, 1e-4]
    assert retarget_schedule(optimizer, scheduler, group_peaks(optimizer, old), group_peaks(optimizer, new)) == [5e-4, 1e-4]
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 1e-4]


def rates(out):
    return [json.loads(line)["learning_rate"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_longer_run_at_a_new_rate_follows_the_new_schedule_from_the_resumed_step(tmp_path, capfd):
    out = tmp_path / "run"
    train(config(out, "--max_steps", "4", "--save_steps", "2"))
    capfd.readouterr()
    train(config(out, "--max_steps", "8", "--save_steps", "2", "--learning_rate", "5e-4", "--logging_steps", "2",
                 "--resume_from_checkpoint", "latest"))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("mmgrpo: resume")]
    assert lines[:3] == [
        "mmgrpo: resume: --max_steps 4 -> 8: from step 5 the learning rate follows the schedule of the new flags",
        "mmgrpo: resume: --logging_steps 1 -> 2 (how the run works, not what it computes)",
        "mmgrpo: resume: --learning_rate 0.001 -> 0.0005: from step 5 the learning rate follows the schedule of the new flags",
    ]
    assert lines[3].startswith("mmgrpo: resume: step 5 trains at learning rate 0.000275 under the new schedule (0.0001 under")

    # the rates: the 4-step schedule's, then from step 5 those of an 8-step run at 5e-4 (cosine to 10% of the peak)
    import torch

    def schedule(rate, steps):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=rate)
        scheduler = make_scheduler(config(out, "--learning_rate", str(rate)).optim, optimizer, steps)
        found = []
        for _ in range(steps):
            found.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return found

    logged = rates(out)
    assert logged[:4] == pytest.approx(schedule(1e-3, 4), rel=1e-12)
    assert logged[4:] == pytest.approx(schedule(5e-4, 8)[4:], rel=1e-12)
    assert math.isclose(logged[4], 5e-4 * 0.55)  # not the floor (1e-4) the short schedule had reached

    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["max_steps"] == 8 and recorded["optim"]["learning_rate"] == 5e-4
    assert recorded["resumed"] == [{"after_step": 4, "changed": {"max_steps": [4, 8], "logging_steps": [1, 2],
                                                                "learning_rate": [0.001, 0.0005]}}]
    assert TrainConfig.from_args(["--config", str(out / "config.yaml")]).max_steps == 8  # still usable as --config
    # the next checkpoint carries the history: a second resume adds to it
    state = json.loads((out / "checkpoint-8" / STATE_FILE).read_text())
    assert state["resumed"] == recorded["resumed"] and state["flags"]["max_steps"] == 8
