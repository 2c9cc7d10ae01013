"""PyTorch FSDP2 (`--parallel fsdp2`): parameters, gradients and optimizer state sharded over ranks.

    torchrun --nproc_per_node 2 -m mmgrpo train --parallel fsdp2 --bf16 ...

Each transformer block (the model's `_no_split_modules`: decoder layers, vision blocks) is its
own FSDP unit, all-gathered just before its forward and freed after; the `Wrapper` root holds
the rest (embeddings, final norm, LM head, patch embedding, merger). With --bf16 the gathered
weights are bfloat16 (--fp16: float16, the loss scaled by torch's ShardedGradScaler) and gradients
are reduced in float32 (MixedPrecisionPolicy); the sharded master weights and AdamW states stay
float32. Gradients are averaged over ranks.

Log-prob forwards and rollouts run inside the root's forward (`Prepared.call`), so the root's
weights are gathered for the whole call. During a rollout the blocks stay gathered from their
first decoding step to the end (--gather_for_generation; off: every step gathers every block,
and synced_gpus keeps the ranks stepping together).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from mmgrpo.forward.policy import plain_call
from mmgrpo.parallel.base import Prepared, Strategy, Wrapper, hf_state_dict

OPTIMIZER_SHARDS = "optimizer"  # a torch.distributed.checkpoint folder inside checkpoint-N


def shard(model: torch.nn.Module, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy) -> Wrapper:
    """fully_shard every transformer block of `model`, then a Wrapper root around it."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in block_classes:
            fully_shard(module, mp_policy=mp_policy, offload_policy=offload_policy)
    wrapper = Wrapper(model)
    fully_shard(wrapper, mp_policy=mp_policy, offload_policy=offload_policy)
    return wrapper


class FSDP2(Strategy):
    name = "fsdp2"

    @property
    def load_device(self) -> torch.device:
        return torch.device("cpu")  # fully_shard moves each rank's shards to its device

    def prepare(self, model, ref_model, make_optimizer, teacher=None) -> Prepared:
        if self.compute_dtype is not None:  # bf16 / fp16 gathered weights, float32 gradient reduction
            mp_policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        else:
            mp_policy = MixedPrecisionPolicy()
        if self.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device.type)  # all-reduces "found an overflow" over ranks
        offload = CPUOffloadPolicy() if self.dist_cfg.offload_param else OffloadPolicy()
        self.wrapper = shard(model, mp_policy, offload)
        ref_call = shard(ref_model, mp_policy, OffloadPolicy()) if ref_model is not None else plain_call
        teacher_call = shard(teacher, mp_policy, OffloadPolicy()) if teacher is not None else plain_call
        return Prepared(
            optimizer=make_optimizer([p for p in model.parameters() if p.requires_grad]),  # on the shards (DTensors)
            call=self.wrapper,
            ref_call=ref_call,
            teacher_call=teacher_call,
            rollout_call=self.wrapper,
            rollout_scope=self.blocks_gathered if self.dist_cfg.gather_for_generation else nullcontext,
        )

    @contextmanager
    def blocks_gathered(self):
        """Blocks stay gathered after their first forward until the context ends (a whole rollout)."""
        blocks = [m for m in self.wrapper.modules() if isinstance(m, FSDPModule) and m is not self.wrapper]
        for block in blocks:
            block.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for block in blocks:
                block.set_reshard_after_forward(True, recurse=False)
                block.reshard()

    def backward(self, loss: torch.Tensor) -> None:
        # each unit's gradients are reduce-scattered (averaged over the world) as its backward ends; a sequence
        # group's ranks each hold their slices' share of one row's gradient, which the average must sum
        self.scaled(loss * self.sequence_size if self.sequence_size > 1 else loss).backward()

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        # the global norm over all shards
        return self.clip_and_step(optimizer, max_grad_norm, norm_of=lambda n: n.full_tensor() if isinstance(n, DTensor) else n)

    def full_tensors(self, model, names: list[str]):
        # The root keeps its weights gathered after a forward with no backward (a log-prob pass):
        # reshard first, so every parameter is a DTensor shard again.
        self.wrapper.reshard()
        params = dict(self.wrapper.named_parameters())  # `model.<hf name>`: DTensor shards
        for name in names:
            yield name, params[f"model.{name}"].full_tensor().detach()  # an all-gather on every rank

    def save_sharded_optimizer(self, optimizer, folder) -> None:
        # torch.distributed.checkpoint: each rank writes its shards, rank 0 the metadata
        state = {"optimizer": get_optimizer_state_dict(self.wrapper, optimizer)}
        dcp.save(state, checkpoint_id=str(Path(folder) / OPTIMIZER_SHARDS))

    def load_sharded_optimizer(self, optimizer, folder) -> None:
        state = {"optimizer": get_optimizer_state_dict(self.wrapper, optimizer)}  # the layout to fill (state initialised)
        dcp.load(state, checkpoint_id=str(Path(folder) / OPTIMIZER_SHARDS))
        set_optimizer_state_dict(self.wrapper, optimizer, state["optimizer"])

    def full_state_dict(self, model, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(self.wrapper, options=options)  # rank 0 gets it all, the others {}
        return hf_state_dict(state) if self.is_main else {}
