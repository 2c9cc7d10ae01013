"""The strategy interface the training step calls, and what all strategies share.

    torchrun --nproc_per_node 2 -m mmgrpo train --parallel fsdp2 ...     (docs/distributed.md)

The step reads the same for every strategy (`none`, `fsdp2`, `zero3`):

    prepared = strategy.prepare(model, ref_model, make_optimizer, teacher)  # shard, then the optimizer on the shards
    batch = strategy.align_media(batch, template)            # every rank runs the vision tower equally often
    strategy.backward(loss)
    grad_norm = strategy.optimizer_step(optimizer, max_grad_norm)   # clip, step, zero the grads
    metrics = strategy.all_reduce_metrics(metrics)           # means over ranks
    state_dict = strategy.full_state_dict(model)             # full weights on rank 0, for checkpoints

`prepare` returns the optimizer and how forwards and rollouts run (`Prepared`): the policy and
the rollout engine are built with these once (mmgrpo/training/build.py) and never patched afterwards.
Forwards run through `call(fn, ...)`: sharding strategies make that a call of a wrapper module
(`Wrapper`) around the model, so FSDP2 / ZeRO-3 gather every weight the function touches (the
chunked LM head reads `lm_head.weight` outside `lm_head.forward`).

Data-parallel GRPO: each rank rolls out its own prompts (the G completions of a prompt stay on
one rank, so advantages are computed per rank), gradients are averaged over ranks, and every
loss normaliser is the global count divided by the world size (`mean_across_ranks`), so a step
on N ranks gives the gradients of one process on the global batch.
"""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mmgrpo.config import DistConfig
from mmgrpo.forward.policy import plain_call
from mmgrpo.parallel.guards import step_unless_nonfinite
from mmgrpo.parallel.media import add_dummy_medium


@dataclass(frozen=True)
class Prepared:
    """What `Strategy.prepare` returns: the optimizer over the weights that train, and how the
    policy's forwards, the reference's and the teacher's forwards and rollouts run (plain calls in one process)."""

    optimizer: torch.optim.Optimizer
    call: Callable = plain_call
    ref_call: Callable = plain_call
    teacher_call: Callable = plain_call  # --teacher_model (on-policy distillation), sharded as the reference is
    rollout_call: Callable = plain_call
    # a context a whole rollout runs in: the weights gathered once for all its decoding steps
    rollout_scope: Callable[[], AbstractContextManager] = nullcontext


class Wrapper(nn.Module):
    """`wrapper(fn, *args)` runs `fn(*args)` as this module's forward.

    Sharding wrappers gather a module's weights around its forward; passing the log-prob
    function or the rollout through this forward makes them gather every weight those touch,
    the LM head included. The model is the child `model`, so state dict keys are `model.<hf name>`.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def hf_state_dict(wrapper_state: dict) -> dict:
    """`model.<name>` keys of a Wrapper's state dict -> the HF model's `<name>`."""
    return {key.removeprefix("model."): value for key, value in wrapper_state.items()}


class Strategy:
    """What the engine calls; `SingleProcess`, `FSDP2` and `ZeRO3` implement the model-specific part.

    The collectives here (`all_reduce_metrics`, `mean_across_ranks`, `any_rank`, `align_media`)
    are shared by all and free in one process.
    """

    name = ""

    def __init__(
        self, dist_cfg: DistConfig, *, rank: int, world_size: int, local_rank: int, device: torch.device,
        owns_group: bool, precision: str = "fp32"
    ):
        self.dist_cfg = dist_cfg  # --offload_param, --gather_for_generation ... (what a sharding strategy reads)
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device
        self.owns_group = owns_group
        self.precision = precision  # "bf16" | "fp16" | "fp32": what the flags asked and the device allows (launch.configure_precision)
        # fp16's dynamic loss scale (torch.amp's GradScaler): made by `prepare`, which knows the optimizer's parameters
        self.scaler: torch.amp.GradScaler | None = None
        self.overflowed = False  # the last optimizer_step was an fp16 overflow the scaler skipped
        # --sequence_parallel_size: groups of `sequence_size` consecutive ranks share their data and split
        # each row's tokens (mmgrpo/forward/sequence_parallel.py); the data-parallel world is their number.
        self.sequence_group, self.sequence_size = None, 1
        self.data_rank, self.data_world = rank, world_size

    def split_sequences(self, group, size: int) -> None:
        """Ranks [k * size, (k + 1) * size) form sequence group k: they read the same prompts (data rank
        k of world_size / size), train on their leader's rollout (each rank generates, the leader's is
        kept: `share_rollout`), and split each row."""
        self.sequence_group, self.sequence_size = group, size
        self.data_rank, self.data_world = self.rank // size, self.world_size // size

    def share_rollout(self, rollout):
        """The sequence group leader's rollout on every rank of the group (itself where there is no group):
        the group must train on the same completions, token for token."""
        if self.sequence_group is None:
            return rollout
        box = [rollout]
        dist.broadcast_object_list(box, group=self.sequence_group, group_src=0)
        return box[0]

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype of forwards and rollouts; None: float32."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def load_device(self) -> torch.device:
        """Where the model is loaded before `wrap` (sharding strategies load on CPU and move shards)."""
        return self.device

    # -- model, backward, step: per strategy --------------------------------------------------

    @property
    def sharded(self) -> bool:
        """Weights are gathered inside forwards (FSDP2, ZeRO-3): ranks must make the same calls."""
        return self.name != "none"

    @property
    def saves_optimizer_itself(self) -> bool:
        """The optimizer state is written by `save_sharded_optimizer` (every rank its part), not as one
        optimizer.pt: under several ranks, and under ZeRO-3 always (DeepSpeed's optimizer holds the
        fp32 partitions, and the torch optimizer it wraps no longer matches its own state)."""
        return self.world_size > 1 or self.name == "zero3"

    def prepare(self, model: nn.Module, ref_model: nn.Module | None, make_optimizer,
                teacher: nn.Module | None = None) -> Prepared:
        """Prepare the model (and the frozen reference and teacher models) for training;
        `make_optimizer(params)` builds the optimizer on the parameters that train (after sharding: on the shards)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        """Clip the gradients to max_grad_norm (0: no clipping), step, zero them; return the norm before clipping."""
        raise NotImplementedError

    def zero_grad(self, optimizer) -> None:
        """Drop accumulated gradients without stepping (a skipped update)."""
        optimizer.zero_grad(set_to_none=True)

    # -- fp16 loss scaling (SingleProcess, FSDP2; DeepSpeed scales its own) ----------------------

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: times the loss scale under --fp16, so small float16 gradients
        do not flush to zero."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def clip_and_step(self, optimizer, max_grad_norm: float, norm_of=lambda norm: norm) -> float:
        """Unscale (fp16), clip to max_grad_norm (0: no clipping), step, zero the gradients; the norm
        before clipping. `norm_of` turns clip_grad_norm_'s result into the global norm (FSDP2: a DTensor).

        Under --fp16 an overflow (an inf/NaN gradient) is the loss scale's business: the scaler skips
        the step and halves the scale (`overflowed`). Once the scale is at 1 or below, scaling cannot be
        the cause, and the step counts as non-finite like any other (mmgrpo/parallel/guards.py).
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # FSDP2's ShardedGradScaler agrees on overflow across ranks
        norm = norm_of(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf")))
        if self.scaler is None:
            step_unless_nonfinite(optimizer, norm)  # a NaN/inf norm: no step; the norm tells the loop
            return float(norm)
        scale = self.scaler.get_scale()
        # The step is taken here, not by scaler.step: the global norm decides it alike on every rank, and
        # a fused AdamW over FSDP2's DTensors does not take the scaler's found_inf tensor.
        stepped = step_unless_nonfinite(optimizer, norm)
        self.scaler.update()  # halves the scale after an overflow unscale_ found, doubles it after 2000 clean steps
        self.overflowed = not stepped and scale > 1
        return float(norm)

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale now (None without --fp16)."""
        return self.scaler.get_scale() if self.scaler is not None else None

    def loss_scale_state(self) -> dict:
        """The fp16 loss scale and its growth counter, for a checkpoint ({} without --fp16)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_loss_scale_state(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def full_tensors(self, model: nn.Module, names: list[str]):
        """(HF name, full tensor) of each named parameter, one at a time, on every rank: what a
        rollout engine with its own copy of the weights is sent. A collective where the weights are
        sharded: every rank iterates to the end. Never more than one gathered tensor at a time."""
        params = dict(model.named_parameters())
        for name in names:
            yield name, params[name].detach()

    def full_state_dict(self, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights of the HF model on CPU keyed by HF names, on rank 0 ({} elsewhere).

        trainable_only: just the weights that train (a LoRA checkpoint: the adapters).
        A collective: every rank calls it.
        """
        raise NotImplementedError

    def save_sharded_optimizer(self, optimizer, folder) -> None:
        """Write this rank's share of the optimizer state into checkpoint `folder` (a collective).
        Sharding strategies only: one process saves `optimizer.state_dict()` (mmgrpo/runstate/state.py)."""
        raise NotImplementedError(f"{self.name} does not save a sharded optimizer state")

    def load_sharded_optimizer(self, optimizer, folder) -> None:
        """Load what `save_sharded_optimizer` wrote, on the same number of ranks (a collective)."""
        raise NotImplementedError(f"{self.name} does not load a sharded optimizer state")

    # -- collectives ---------------------------------------------------------------------------

    def _reduce(self, values: torch.Tensor, op) -> torch.Tensor:
        if self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op)
        return values.cpu()

    def mean_across_ranks(self, value) -> torch.Tensor:
        """The mean of a scalar over ranks: a global count / world size, for loss normalisers."""
        if self.world_size == 1:
            return value
        value = torch.as_tensor(value, dtype=torch.float32).reshape(1)
        return self._reduce(value, dist.ReduceOp.SUM)[0] / self.world_size  # float32: a loss stays float32

    def std_across_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The unbiased std of every rank's `values` together (one all-reduce of count, sum and
        sum of squares, in float64); on one process, `values.std()`."""
        if self.world_size == 1:
            return values.float().std()
        flat = values.detach().double().reshape(-1).cpu()
        count, total, squares = self._reduce(torch.stack([flat.new_tensor(flat.numel()), flat.sum(), (flat * flat).sum()]), dist.ReduceOp.SUM)
        # a sequence group's ranks hold the same rows: count them once
        count, total, squares = count / self.sequence_size, total / self.sequence_size, squares / self.sequence_size
        variance = (squares - total * total / count) / (count - 1)
        return variance.clamp_min(0).sqrt().float().to(values.device)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any (e.g. a non-finite loss: all skip the update)."""
        return bool(self._reduce(torch.tensor([float(flag)]), dist.ReduceOp.MAX)[0])

    def all_reduce_metrics(self, metrics: dict) -> dict:
        """Means over ranks; `*_max` and `memory/*` keys take the max, `*_per_s` keys the sum (over
        data-parallel ranks: a sequence group counts once).

        A key only some ranks have (e.g. `reward/video` where one rank drew a video) is averaged
        over the ranks that have it.
        """
        if self.world_size == 1:
            return metrics
        numeric = {k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        every_rank: list = [None] * self.world_size
        dist.all_gather_object(every_rank, sorted(numeric))
        keys = sorted(set().union(*every_rank))
        values = torch.tensor([float(metrics[k]) if k in numeric else float("nan") for k in keys], dtype=torch.float64)
        is_max = torch.tensor([k.endswith("_max") or k.startswith("memory/") for k in keys], dtype=torch.bool)
        finite = torch.nan_to_num(values, nan=0.0)
        sums = self._reduce(torch.where(is_max, 0.0, finite), dist.ReduceOp.SUM)
        counts = self._reduce(torch.where(is_max, 0.0, (~values.isnan()).double()), dist.ReduceOp.SUM)
        maxima = self._reduce(torch.where(is_max, torch.nan_to_num(values, nan=-torch.inf), -torch.inf), dist.ReduceOp.MAX)
        out = dict(metrics)
        for i, key in enumerate(keys):
            if is_max[i]:
                out[key] = float(maxima[i])
            elif key.endswith("_per_s"):  # a sequence group's ranks process the same samples: once
                out[key] = float(sums[i]) / self.sequence_size
            else:  # NaN on a rank (e.g. no sample of a modality there) does not poison the mean
                out[key] = float(sums[i] / counts[i]) if counts[i] > 0 else float("nan")
            if isinstance(metrics.get(key), int) and float(out[key]).is_integer():
                out[key] = int(out[key])  # counters stay integers
        return out

    def align_media(self, batch, template):
        """Add a blank medium to a batch lacking a kind of media that another rank's batch has.

        Sharded weights are gathered by collectives inside each tower call: every rank must call
        the vision (audio) tower as often as the others, or the collectives mismatch and hang.
        `batch` is a collated dict or anything holding one in `.prompts` (a ForwardBatch).
        """
        if self.world_size == 1 or not template.placeholder_ids:
            return batch
        inner = batch.prompts if hasattr(batch, "prompts") else batch
        modalities = list(template.placeholder_ids)
        mine = torch.tensor([float((inner["input_ids"] == template.placeholder_ids[m]).any()) for m in modalities])
        anyone = self._reduce(mine.clone(), dist.ReduceOp.MAX)
        for modality, have, needed in zip(modalities, mine.tolist(), anyone.tolist()):
            if needed and not have:
                inner = add_dummy_medium(inner, template, modality)
        return dataclasses.replace(batch, prompts=inner) if hasattr(batch, "prompts") else inner

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def peak_memory_gb(self) -> float:
        """Peak memory of this rank: the GPU's max allocated, else the process's peak RSS."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
