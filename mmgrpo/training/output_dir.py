"""Checks on the output folder and the resume flag, made before any model loads.

    plan = preflight(cfg)    # ConfigError / CheckpointError now, not after minutes of loading
    ...                      # build the run
    plan.apply()             # when the run starts writing: clears or trims the folder as decided

A run writes into `--output_dir`; what is already there decides what may happen:

| the folder | flags | then |
|---|---|---|
| absent or empty | - | a new run |
| not empty | none | refused: a second run would mix its metrics and checkpoints with the first |
| not empty | `--resume_from_checkpoint latest` or a path | the run continues: `metrics.jsonl` and `completions.jsonl` keep the steps up to the checkpoint's (later lines, from the run that crashed, are dropped; the checkpoint's own step, if a kill came between its save and its log lines, is restored from the checkpoint) |
| not empty | `--overwrite_output_dir` | mmgrpo's files of the earlier run are deleted (config.yaml, metrics.jsonl, completions.jsonl, TensorBoard events, checkpoint-*, eval/, report.html, report/); any other file stays |
| held by a live run | any | refused, naming its pid and host (mmgrpo/runstate/run_lock.py): nothing there is read, repaired or deleted |

Also refused here: an output folder that is a file, lies under a file, or cannot be written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mmgrpo.errors import ConfigError
from mmgrpo.parallel.launch import env_rank
from mmgrpo.runstate.checkpoint import (
    check_checkpoint,
    checkpoint_step,
    list_checkpoints,
    repair_interrupted,
    repairable,
)
from mmgrpo.runstate.run_lock import LOCK_FILE, RunLock
from mmgrpo.runstate.state import TrainState
from mmgrpo.training.resume import STEP_LOG_FILE, read_training_state
from mmgrpo.training.resume_flags import allowed_lines, check_changes, flag_changes

RUN_FILES = ("config.yaml", "metrics.jsonl", "completions.jsonl", "report.html")  # what a run writes at the top
RUN_GLOBS = ("events.out.tfevents.*", "checkpoint-*")
RUN_FOLDERS = ("eval", "report")
WRITE_TEST = ".mmgrpo-write-test-"
STEP_LOGS = ("metrics.jsonl", "completions.jsonl")  # one JSON object per line, each with "step"


@dataclass
class OutputPlan:
    """What `preflight` decided for the output folder; `apply()` carries it out."""

    output_dir: Path
    mode: str  # "new" | "resume" | "overwrite"
    resume_from: Path | None = None
    state: TrainState | None = None  # the checkpoint's training state (mode "resume"; rank 0)
    remove: list[Path] = field(default_factory=list)  # mode "overwrite": the earlier run's files
    lock: RunLock | None = None  # rank 0: this run's hold on the folder (mmgrpo/runstate/run_lock.py)

    def release(self) -> None:
        """Let go of the folder when the run ends (rank 0; the other ranks hold nothing)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def resume_step(self) -> int:
        """The last step the checkpoint finished (0 for a new run): the loop starts at this + 1."""
        return self.state.step if self.state is not None else 0

    def apply(self) -> None:
        """Delete the earlier run's files (overwrite) or trim its step logs to the checkpoint (resume)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for path in self.remove:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        if self.mode == "resume":
            for name in STEP_LOGS:
                trim_step_log(self.output_dir / name, self.resume_step)
            restore_step_log(self.output_dir, self.resume_from, self.resume_step)


def preflight(cfg) -> OutputPlan:
    """Check --output_dir, --resume_from_checkpoint and --overwrite_output_dir together (after
    `check_train_flags(cfg)`, mmgrpo/training/startup_checks.py, which checks every other flag).

    Rank 0 takes the folder's lock first (a live run there is refused; mmgrpo/runstate/run_lock.py)
    and is the only rank that repairs what a killed save left; the other ranks only read, and
    write nothing before the barrier after `build_run`. Nothing is written yet except the output
    folder itself when it did not exist, and the lock.
    """
    out = Path(cfg.output_dir).expanduser()
    resume, overwrite = cfg.resume_from_checkpoint, cfg.overwrite_output_dir
    check_writable(out)
    if resume and overwrite:
        raise ConfigError("--resume_from_checkpoint continues the run in --output_dir and --overwrite_output_dir deletes it: pass one of them.")
    main = env_rank() == 0
    lock = RunLock.acquire(out) if main else None  # before anything is read, deleted or repaired there
    try:
        plan = _plan(cfg, out, resume, overwrite, main)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    plan.lock = lock
    return plan


def _plan(cfg, out: Path, resume: str | None, overwrite: bool, main: bool) -> OutputPlan:
    # another rank's write test, and this run's own lock, are not an earlier run's files
    entries = sorted(p.name for p in out.iterdir() if not p.name.startswith(WRITE_TEST) and p.name != LOCK_FILE)
    if resume:
        return _resume_plan(out, resume, cfg) if main else _resume_path(out, resume)
    if not entries:
        return OutputPlan(out, "new")
    if overwrite:
        return OutputPlan(out, "overwrite", remove=run_files(out))
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    raise ConfigError(
        f"--output_dir {out} is not empty ({shown}): a second run there would mix with the first. Pass "
        "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, or another --output_dir."
    )


def _resume_plan(out: Path, resume: str, cfg) -> OutputPlan:
    repair_interrupted(out)  # a killed save may have left a finished checkpoint just short of its rename
    if resume == "latest":
        complete = list_checkpoints(out)  # incomplete ones: a one-line warning each
        if not complete:
            raise ConfigError(
                f"--resume_from_checkpoint latest: no complete checkpoint in {out}; check --output_dir, or drop "
                "the flag to start afresh (with --overwrite_output_dir if the folder is not empty)."
            )
        path = complete[-1]
    else:
        path = Path(resume).expanduser()
    check_checkpoint(path, checksums=True)  # a file corrupted since its save (same size) is never trained on
    state = read_training_state(path)
    newer = [p.name for p in list_checkpoints(out, warn=False) if (checkpoint_step(p) or 0) > state.step]
    if newer:
        raise ConfigError(
            f"--resume_from_checkpoint {path}: {out} holds {', '.join(newer)}, saved later by the run being resumed; "
            "the resumed run would overwrite them. Resume from latest, or move them away first."
        )
    if state.flags:  # the flags the run may not change, and one line for each it may (mmgrpo/training/resume_flags.py)
        changes = flag_changes(state.flags, cfg.to_dict())
        staleness = cfg.rollout.staleness_bound
        check_changes(changes, path, state.step, in_flight=int(state.rollout_in_flight or 0), staleness=staleness)
        for line in allowed_lines(changes, state.step, staleness):
            print(f"mmgrpo: {line}", file=sys.stderr, flush=True)
    else:
        print(f"mmgrpo: resume: {path} records no flags (saved by an earlier mmgrpo): this run's are taken unchecked",
              file=sys.stderr, flush=True)
    return OutputPlan(out, "resume", resume_from=path, state=state)


def _resume_path(out: Path, resume: str) -> OutputPlan:
    """A rank other than 0: the checkpoint rank 0 picks, read only. Rank 0 repairs an interrupted
    save before it reaches the process group, which no rank passes alone, so by the time this rank
    loads the checkpoint a repairable one is in place; rank 0 makes every check."""
    if resume != "latest":
        return OutputPlan(out, "resume", resume_from=Path(resume).expanduser())
    steps = {checkpoint_step(p): p for p in [*list_checkpoints(out, warn=False), *repairable(out)]}
    return OutputPlan(out, "resume", resume_from=steps[max(steps)] if steps else None)


def check_writable(out: Path) -> None:
    """ConfigError unless `out` is (or can be created as) a folder this process can write in."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir {out} is a file, not a folder: give a folder path.")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--output_dir {out}: {parent} is a file, so no folder can be made under it.")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=WRITE_TEST):
            pass
    except OSError as err:
        raise ConfigError(f"--output_dir {out} is not writable ({err.strerror or err}): pick a folder you can write to.") from None


def run_files(out: Path) -> list[Path]:
    """The files and folders an earlier mmgrpo run left in `out` (what --overwrite_output_dir deletes)."""
    found = {out / name for name in (*RUN_FILES, *RUN_FOLDERS) if (out / name).exists()}
    for pattern in RUN_GLOBS:
        found.update(out.glob(pattern))
    return sorted(found)


def restore_step_log(out: Path, checkpoint: Path, step: int) -> bool:
    """Append the checkpoint's own step lines (STEP_LOG_FILE) to the step logs when
    metrics.jsonl stops short of `step`: the run was killed after the save and before the loop
    logged the step. Those lines lack only the save's timings. True when something was restored."""
    saved = Path(checkpoint) / STEP_LOG_FILE
    if not saved.is_file() or _last_step(out / STEP_LOGS[0]) >= step:
        return False
    lines = json.loads(saved.read_text())
    for name in STEP_LOGS:
        trim_step_log(out / name, step - 1)  # completions of the step written before its metrics line
        with open(out / name, "a") as f:
            f.write(lines.get(name, ""))
            f.flush()
            os.fsync(f.fileno())
    return True


def _last_step(path: Path) -> int:
    """The highest "step" in a JSON-lines step log (0 when there is none)."""
    if not path.is_file():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return max(steps)


def trim_step_log(path: Path, last_step: int) -> None:
    """Keep the lines of a JSON-lines step log with "step" <= last_step (a torn last line is dropped);
    rewritten through a temporary file and a rename, so a kill leaves the old or the new file."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the crash
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line + "\n")
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)

