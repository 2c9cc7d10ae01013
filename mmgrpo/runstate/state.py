"""What changes while a run trains, in one object that every checkpoint saves.

    state = TrainState()                       # a new run; a resumed one loads it from the checkpoint
    state.step, state.nonfinite_steps          # the loop's counters
    state.best_metric, state.best_step         # the in-training evaluation's best so far (checkpoint-best)
    state.modality_weights                     # --dynamic_modality_weights' moving averages
    state.data                                 # the prompt stream's position
    state.flags, state.resumed                 # the run's flags, and what each resume changed

Everything else a run is built from (`Run`, mmgrpo/training/build.py) is decided once and never
replaced, so a checkpoint that holds the weights, optimizer, schedule, this object and every RNG
(`capture_rng`) continues the run bit for bit (mmgrpo/training/resume.py).

    >>> TrainState.from_dict({"step": 4, "best_metric": 0.5, "unknown": 1}).step
    4
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, fields

import numpy as np
import torch

STATE_FILE = "training_state.json"  # a checkpoint's TrainState (mmgrpo/training/resume.py writes it)


@dataclass
class TrainState:
    """The loop's state, saved as training_state.json beside the weights."""

    step: int = 0
    """Optimizer steps finished (a resumed run starts at step + 1)."""
    nonfinite_steps: int = 0
    """Steps skipped for a NaN/inf loss or gradient norm so far (--max_nonfinite_steps counts them)."""
    best_metric: float | None = None
    """The in-training evaluation's best --metric_for_best_model value so far."""
    best_step: int | None = None
    """The step of checkpoint-best."""
    modality_weights: dict[str, float] = field(default_factory=dict)
    """--dynamic_modality_weights: each modality's (or dataset's) moving average of |advantage|."""
    data: dict = field(default_factory=dict)
    """The prompt stream's position (`mmgrpo.data.prompt_batches.PromptStream.state_dict()`)."""
    model: str | None = None
    """The starting --model: the KL reference, which a resumed run must share."""
    rollout_in_flight: int = 0
    """Asynchronous training: how many rollouts for the next steps are saved beside the state (mmgrpo/training/resume.py)."""
    world_size: int = 1
    """Ranks that wrote the checkpoint; a resume needs as many."""
    flags: dict = field(default_factory=dict)
    """The resolved TrainConfig of the run that wrote the checkpoint: a resumed run's flags are compared with it
    (mmgrpo/training/resume_flags.py)."""
    resumed: list = field(default_factory=list)
    """Each resume so far: {"after_step": N, "changed": {flag: [old, new]}} (config.yaml shows them too)."""
    loss_scale: dict = field(default_factory=dict)
    """--fp16: the loss scaler's state (torch.amp.GradScaler's: scale, growth counter); {} otherwise."""

    @classmethod
    def from_dict(cls, values: dict) -> TrainState:
        """The state of a training_state.json (keys this version does not know are ignored; the
        `extra` section of earlier versions is read as top-level keys)."""
        values = {**values.get("extra", {}), **values}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


# ---- random number generators --------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def deterministic_kernels(on: bool) -> None:
    """--full_determinism: kernels that give the same result every time (before any CUDA work:
    cuBLAS reads its workspace setting when its first handle is made). An op with no such kernel
    warns once and stays as it is (warn_only), rather than stopping the run."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def capture_rng() -> dict:
    """Every global RNG this process draws from: python `random`, numpy's global state, torch CPU
    and (when present) every CUDA device. Only tensors and plain values, so it loads with
    `torch.load(weights_only=True)`.

    >>> state = capture_rng(); a = (random.random(), np.random.rand(), torch.rand(1).item())
    >>> restore_rng(state); a == (random.random(), np.random.rand(), torch.rand(1).item())
    True
    """
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back what `capture_rng` took."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
