"""Training beyond one process: the strategy interface the GRPO engine calls, and what all share.

    torchrun --nproc_per_node 2 -m mmgrpo train --parallel fsdp2 ...     (docs/distributed.md)

The engine's step reads the same for every strategy (`none`, `fsdp2`, `zero3`):

    optimizer = strategy.wrap(policy, make_optimizer)        # shard the model, then the optimizer on the shards
    batch = strategy.align_media(batch, template)            # every rank runs the vision tower equally often
    strategy.backward(loss)
    grad_norm = strategy.optimizer_step(optimizer, max_grad_norm)   # clip, step, zero the grads
    metrics = strategy.all_reduce_metrics(metrics)           # means over ranks
    state_dict = strategy.full_state_dict(policy)            # full weights on rank 0, for checkpoints

Data-parallel GRPO: each rank rolls out its own prompts (the G completions of a prompt stay on
one rank, so advantages are computed per rank), gradients are averaged over ranks, and every
loss normaliser is the global count divided by the world size (`mean_across_ranks`), so a step
on N ranks gives the gradients of one process on the global batch.

Forwards run through `policy.call(fn, ...)` (rollouts through `policy.rollout_call`): the strategy
makes that a call of a wrapper module (`Wrapper`) around the model, so FSDP2 / ZeRO-3 gather every
weight the function touches (the chunked LM head reads `lm_head.weight` outside `lm_head.forward`).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from mmgrpo.errors import ConfigError, MMGRPOError

PARALLEL_CHOICES = ("none", "fsdp2", "zero3")
TRAIN_TYPES = ("full", "lora")


def env_world_size() -> int:
    """Processes in this run as the launcher (torchrun, the deepspeed launcher) says; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def notice(text: str) -> None:
    """A one-line notice on stderr, from rank 0 only."""
    if env_rank() == 0:
        print(f"mmgrpo: {text}", file=sys.stderr, flush=True)


# ---- checks before any model loads ----------------------------------------------------------


def validate_parallel(cfg) -> None:
    """Flag combinations of --parallel / --deepspeed / LoRA that cannot work, as ConfigErrors."""
    from mmgrpo.config import SFTConfig

    dist_cfg, model_cfg = cfg.dist, cfg.model
    dist_cfg.parallel = dist_cfg.parallel or "none"  # the flag parser reads `--parallel none` as None
    if dist_cfg.deepspeed:
        if dist_cfg.parallel not in ("none", "zero3"):
            raise ConfigError(f"--deepspeed {dist_cfg.deepspeed} contradicts --parallel {dist_cfg.parallel}: DeepSpeed is --parallel zero3.")
        dist_cfg.parallel = "zero3"
    if dist_cfg.parallel not in PARALLEL_CHOICES:
        raise ConfigError(f"--parallel {dist_cfg.parallel!r}: choose one of {', '.join(PARALLEL_CHOICES)}.")
    world_size = env_world_size()
    if isinstance(cfg, SFTConfig) and dist_cfg.parallel != "none":
        raise ConfigError(f"mmgrpo sft runs in one process: drop --parallel {dist_cfg.parallel} (and torchrun).")
    if world_size > 1 and dist_cfg.parallel == "none":
        raise ConfigError(
            f"{world_size} processes were launched but --parallel is none (each would train its own copy): "
            "pass --parallel fsdp2 or --parallel zero3."
        )
    if dist_cfg.ddp_timeout <= 0:
        raise ConfigError(f"--ddp_timeout {dist_cfg.ddp_timeout}: give a positive number of seconds.")
    if (dist_cfg.offload_optimizer or dist_cfg.offload_param) and dist_cfg.parallel == "none":
        raise ConfigError("--offload_optimizer / --offload_param need --parallel zero3 (or fsdp2 for --offload_param).")
    if dist_cfg.offload_optimizer and dist_cfg.parallel == "fsdp2":
        raise ConfigError("FSDP2 offloads parameters, gradients and optimizer state together: use --offload_param.")
    per_rank = cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps
    G = cfg.rollout.num_generations
    if world_size > 1 and not isinstance(cfg, SFTConfig) and per_rank % G:
        raise ConfigError(
            f"{world_size} ranks: each rank rolls out whole groups, but per_device_train_batch_size "
            f"{cfg.optim.per_device_train_batch_size} x gradient_accumulation_steps {cfg.optim.gradient_accumulation_steps} "
            f"= {per_rank} completions per rank is not a multiple of --num_generations {G}. The global batch is "
            f"{per_rank} x {world_size} ranks; raise --gradient_accumulation_steps or the batch size to a multiple of {G}."
        )
    if model_cfg.train_type not in TRAIN_TYPES:
        raise ConfigError(f"--train_type {model_cfg.train_type!r}: choose one of {', '.join(TRAIN_TYPES)}.")
    if model_cfg.train_type == "lora":
        if model_cfg.lora_rank < 1 or model_cfg.lora_alpha <= 0:
            raise ConfigError(f"--lora_rank {model_cfg.lora_rank} / --lora_alpha {model_cfg.lora_alpha}: both must be positive.")
        if not 0 <= model_cfg.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout {model_cfg.lora_dropout}: must be in [0, 1).")
        if not model_cfg.target_modules:
            raise ConfigError("--train_type lora needs --target_modules (e.g. all-linear, llm, vision, aligner, q_proj).")
    if dist_cfg.parallel == "zero3":
        from mmgrpo.parallel.zero3 import deepspeed_config

        deepspeed_config(cfg, world_size)  # a contradicting JSON is an error now


# ---- process group and device ---------------------------------------------------------------


def init_process_group(timeout_s: float, sharded: bool) -> tuple[int, int, int, bool]:
    """(rank, world_size, local_rank, created): NCCL on GPUs, gloo on CPU, with a timeout.

    A rank that dies or hangs makes the others' next collective fail after `timeout_s` seconds
    instead of waiting forever. FSDP2 and ZeRO-3 need a group even in one process (a local one).
    """
    world_size = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1 and not sharded:
        return 0, 1, local_rank, False
    if world_size == 1:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank, False
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), local_rank, True


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def configure_precision(device: torch.device, bf16: bool) -> bool:
    """TF32 matmuls on Ampere+; bf16 only where the device supports it (a notice otherwise).

    Returns whether bf16 stays on.
    """
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] >= 8:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if bf16 and not torch.cuda.is_bf16_supported():
            notice(f"{torch.cuda.get_device_name(device)} has no bfloat16: --bf16 ignored, training in float32.")
            return False
    elif device.type == "cpu" and env_world_size() > 1:
        notice("no GPU: training on CPU, ranks talk over gloo.")
    return bf16


# ---- the wrapper module ---------------------------------------------------------------------


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


def sync_rollouts(policy, world_size: int, gathered: bool) -> None:
    """Sharded models gather weights in every forward: all ranks must run as many decoding steps
    as the slowest (generate's synced_gpus keeps the finished ones stepping). The shared-prefix
    rollout's lean decode steps call no module: with the weights gathered for the whole rollout
    (`gathered`) its ranks need no syncing."""
    backend = policy.rollout_backend
    if not hasattr(backend, "generate_kwargs"):
        if gathered and getattr(backend, "lean", None) is not None:
            return
        raise ConfigError(
            f"the {type(backend).__name__} rollout cannot run on a sharded model without --gather_for_generation "
            "and lean decode steps: use the HF generate rollout (--shared_prefix false)."
        )
    if world_size > 1:
        backend.generate_kwargs["synced_gpus"] = True


def gather_for_rollouts(policy, gathered) -> None:
    """Run each rollout inside `gathered()` (weights gathered once for all its decoding steps)
    instead of gathering every block in every step."""
    generate = policy.rollout_backend.generate

    def generate_gathered(prompt_batch, params):
        with gathered():
            return generate(prompt_batch, params)

    policy.rollout_backend.generate = generate_gathered


def hf_state_dict(wrapper_state: dict) -> dict:
    """`model.<name>` keys of a Wrapper's state dict -> the HF model's `<name>`."""
    return {key.removeprefix("model."): value for key, value in wrapper_state.items()}


# ---- dummy media: equal vision-tower calls on every rank ------------------------------------


def dummy_medium(template, modality: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The processed tensors and token ids of one tiny blank image / video / audio clip."""
    import numpy as np
    import PIL.Image

    if modality == "image":
        item = PIL.Image.new("RGB", (56, 56))
    elif modality == "video":
        from mmgrpo.data.schema import Video

        metadata = {"fps": 2.0, "total_num_frames": 2, "frames_indices": [0, 1], "duration": 1.0}
        item = Video(frames=np.zeros((2, 56, 56, 3), dtype=np.uint8), metadata=metadata)
    else:
        item = np.zeros(template.sampling_rate or 16000, dtype=np.float32)
    tensors, expansions = template.media[modality].process([item])
    ids = expansions[0]
    if isinstance(ids, str):  # families that expand placeholders in text (Gemma3)
        ids = template.tokenizer(ids, add_special_tokens=False)["input_ids"]
    return tensors, list(ids)


def add_dummy_medium(batch: dict, template, modality: str) -> dict:
    """`batch` with one blank medium of `modality` that no token can see.

    Its placeholder tokens go into new left-padding columns of row 0 with attention_mask 0: the
    model runs its vision (audio) tower on it, and masked keys get zero attention weight, so no
    log-prob changes. Only for a batch holding no medium of that kind.
    """
    hook = template.media[modality]
    if hook.row_keys:
        raise ConfigError(f"template {template.name}: a blank {modality} for equal tower calls across ranks is not supported.")
    tensors, ids = dummy_medium(template, modality)
    device = batch["input_ids"].device
    ids = torch.tensor(ids, dtype=torch.long, device=device)  # [k]
    rows, width = batch["input_ids"].shape[0], len(ids)
    out = dict(batch)
    pad = torch.full((rows, width), template.pad_token_id, dtype=torch.long, device=device)  # [B, k]
    pad[0] = ids
    out["input_ids"] = torch.cat([pad, batch["input_ids"]], dim=1)  # [B, k + L]
    out["attention_mask"] = torch.cat([torch.zeros_like(pad), batch["attention_mask"]], dim=1)
    for key, types in template.token_type_inputs(ids).items():  # e.g. mm_token_type_ids
        extra = torch.zeros((rows, width), dtype=torch.long, device=device)
        extra[0] = types
        old = batch.get(key, torch.zeros_like(batch["input_ids"]))
        out[key] = torch.cat([extra, old.to(torch.long)], dim=1)
    for key in (*hook.item_keys, *hook.patch_keys):
        if key in tensors:
            out[key] = tensors[key].to(device)
    return out


# ---- the interface ---------------------------------------------------------------------------


class Strategy:
    """What the engine calls; `SingleProcess`, `FSDP2` and `ZeRO3` implement the model-specific part.

    The collectives here (`all_reduce_metrics`, `mean_across_ranks`, `any_rank`, `align_media`)
    are shared by all and free in one process.
    """

    name = ""

    def __init__(self, cfg, *, rank: int, world_size: int, local_rank: int, device: torch.device, owns_group: bool):
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device
        self.owns_group = owns_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def load_device(self) -> torch.device:
        """Where the model is loaded before `wrap` (sharding strategies load on CPU and move shards)."""
        return self.device

    # -- model, backward, step: per strategy --------------------------------------------------

    def wrap(self, policy, make_optimizer):
        """Prepare the policy's model (and reference model) for training; return the optimizer
        `make_optimizer(params)` builds on the parameters that train."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        """Clip the gradients to max_grad_norm (0: no clipping), step, zero them; return the norm before clipping."""
        raise NotImplementedError

    def zero_grad(self, optimizer) -> None:
        """Drop accumulated gradients without stepping (a skipped update)."""
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, policy, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights of the policy's HF model on CPU keyed by HF names, on rank 0 ({} elsewhere).

        trainable_only: just the weights that train (a LoRA checkpoint: the adapters).
        A collective: every rank calls it.
        """
        raise NotImplementedError

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
        variance = (squares - total * total / count) / (count - 1)
        return variance.clamp_min(0).sqrt().float().to(values.device)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any (e.g. a non-finite loss: all skip the update)."""
        return bool(self._reduce(torch.tensor([float(flag)]), dist.ReduceOp.MAX)[0])

    def all_reduce_metrics(self, metrics: dict) -> dict:
        """Means over ranks; `*_max` and `memory/*` keys take the max, `*_per_s` keys the sum.

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
        is_max = torch.tensor([k.endswith("_max") or k.startswith("memory/") for k in keys])
        finite = torch.nan_to_num(values, nan=0.0)
        sums = self._reduce(torch.where(is_max, 0.0, finite), dist.ReduceOp.SUM)
        counts = self._reduce(torch.where(is_max, 0.0, (~values.isnan()).double()), dist.ReduceOp.SUM)
        maxima = self._reduce(torch.where(is_max, torch.nan_to_num(values, nan=-torch.inf), -torch.inf), dist.ReduceOp.MAX)
        out = dict(metrics)
        for i, key in enumerate(keys):
            if is_max[i]:
                out[key] = float(maxima[i])
            elif key.endswith("_per_s"):
                out[key] = float(sums[i])
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


class NullLogger:
    """The run logger of ranks other than 0: metrics are reduced over ranks and rank 0 writes them."""

    def log_step(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


# ---- building one ---------------------------------------------------------------------------


def build_strategy(cfg) -> Strategy:
    """The strategy --parallel names, with the process group up and the device chosen."""
    validate_parallel(cfg)
    rank, world_size, local_rank, created = init_process_group(cfg.dist.ddp_timeout, sharded=cfg.dist.parallel != "none")
    device = pick_device(local_rank)
    cfg.bf16 = configure_precision(device, cfg.bf16)
    kwargs = dict(rank=rank, world_size=world_size, local_rank=local_rank, device=device, owns_group=created)
    if cfg.dist.parallel == "fsdp2":
        from mmgrpo.parallel.fsdp2 import FSDP2

        return FSDP2(cfg, **kwargs)
    if cfg.dist.parallel == "zero3":
        from mmgrpo.parallel.zero3 import ZeRO3

        return ZeRO3(cfg, **kwargs)
    from mmgrpo.parallel.single import SingleProcess

    return SingleProcess(cfg, **kwargs)


@contextmanager
def rank_errors():
    """Under a launcher, errors name their rank; a collective that timed out says what to look for.

    Wrap a command's body: `with rank_errors(): train(cfg)`.
    """
    world_size = env_world_size()
    if world_size == 1:
        yield
        return
    where = f"rank {env_rank()} of {world_size}"
    try:
        yield
    except MMGRPOError as err:
        raise type(err)(f"{where}: {err}") from None
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        hint = ""
        if "timed out" in text.lower() or "timeout" in text.lower() or "connection" in text.lower():
            hint = (" Another rank probably died (its error is above) or hung; collectives wait "
                    "--ddp_timeout seconds for the others.")
        print(f"mmgrpo: {where} failed: {type(err).__name__}: {text}.{hint}", file=sys.stderr, flush=True)
        raise
