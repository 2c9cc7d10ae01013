"""DeepSpeed ZeRO-3 (`--parallel zero3`, or `--deepspeed zero3 | ds_config.json` as in ms-swift).

    torchrun --nproc_per_node 2 -m mmgrpo train --deepspeed zero3 --bf16 [--offload_optimizer] [--offload_param] ...

`deepspeed.initialize` partitions parameters, gradients and optimizer states over ranks; each
module's weights are gathered around its forward and backward. With --bf16 the module weights
are bfloat16 and DeepSpeed keeps float32 masters in the optimizer. Our AdamW (from the flags)
is the optimizer; the engine's one optimizer step per accumulation group matches DeepSpeed's
unmanaged gradient accumulation (`managed_gradient_accumulation: false`): backward accumulates,
`engine.step()` clips (`gradient_clipping` = --max_grad_norm), steps and zeroes. Rollouts run on
the module itself with every weight gathered once (--gather_for_generation), as TRL does.

A DeepSpeed JSON may leave values as "auto" (filled from the flags); a value that contradicts
a flag is a ConfigError, before any model loads.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from mmgrpo.config import DistConfig, OptimConfig
from mmgrpo.errors import ConfigError
from mmgrpo.forward.policy import plain_call
from mmgrpo.parallel.base import Prepared, Strategy, Wrapper, hf_state_dict

# zero_optimization values HF's integration derives from the hidden size when a JSON says "auto"
AUTO_FROM_HIDDEN = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _load_json(spec: str) -> dict:
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--deepspeed {spec}: no such file; give `zero3` or the path of a DeepSpeed JSON config.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--deepspeed {spec}: not valid JSON ({err}).") from None


def _is_set(value) -> bool:
    return value is not None and value != "auto"


def deepspeed_config(dist_cfg: DistConfig, optim_cfg: OptimConfig, world_size: int, hidden_size: int | None = None,
                     *, precision: str) -> dict:
    """The DeepSpeed config for this run: --deepspeed's JSON (if a path) with the flags filled in
    (the batch sizes and clipping of `optim_cfg`, the offloads of `dist_cfg`).

    precision: `bf16`, `fp16` or `fp32` (--bf16 / --fp16; the strategy passes what the device allows).
    Under fp16 DeepSpeed scales the loss itself (dynamic: `loss_scale` 0), starting at 2**16 as torch's
    GradScaler does; a JSON's own fp16 section keeps its values.

    >>> from mmgrpo.config import TrainConfig
    >>> cfg = TrainConfig.from_args(["--per_device_train_batch_size", "4", "--num_generations", "4", "--bf16"])
    >>> ds = deepspeed_config(cfg.dist, cfg.optim, world_size=2, precision="bf16")
    >>> ds["train_batch_size"], ds["bf16"], ds["zero_optimization"]["stage"], "fp16" in ds
    (8, {'enabled': True}, 3, False)
    >>> deepspeed_config(cfg.dist, cfg.optim, world_size=2, precision="fp16")["fp16"]["loss_scale"]
    0
    """
    bf16, fp16 = precision == "bf16", precision == "fp16"
    spec = dist_cfg.deepspeed
    user = {} if spec in (None, "zero3") else _load_json(spec)
    source = f"--deepspeed {spec}"
    micro, accumulation = optim_cfg.per_device_train_batch_size, optim_cfg.gradient_accumulation_steps
    ours = {
        "train_micro_batch_size_per_gpu": (micro, "--per_device_train_batch_size"),
        "gradient_accumulation_steps": (accumulation, "--gradient_accumulation_steps"),
        "train_batch_size": (micro * accumulation * world_size, f"--per_device_train_batch_size x --gradient_accumulation_steps x {world_size} ranks"),
        "gradient_clipping": (float(optim_cfg.max_grad_norm), "--max_grad_norm"),
    }
    for key, (value, flag) in ours.items():
        if _is_set(user.get(key)) and float(user[key]) != float(value):
            raise ConfigError(f"{source} sets {key} {user[key]} but {flag} gives {value}: set it to \"auto\" or change the flag.")
    if _is_set(user.get("bf16", {}).get("enabled")) and bool(user["bf16"]["enabled"]) != bf16:
        raise ConfigError(f"{source} sets bf16.enabled {user['bf16']['enabled']} but --bf16 is {bf16}: make them agree (or \"auto\").")
    if _is_set(user.get("fp16", {}).get("enabled")) and bool(user["fp16"]["enabled"]) != fp16:
        raise ConfigError(f"{source} sets fp16.enabled {user['fp16']['enabled']} but --fp16 is {fp16}: make them agree (or \"auto\").")
    zero = user.get("zero_optimization", {})
    if _is_set(zero.get("stage")) and int(zero["stage"]) != 3:
        raise ConfigError(f"{source} is ZeRO stage {zero['stage']}: --parallel zero3 needs stage 3 (or use --parallel fsdp2).")
    for section in ("optimizer", "scheduler"):
        if section in user:
            raise ConfigError(f"{source} has a `{section}` section: mmgrpo builds AdamW and its schedule from the flags; remove it.")

    config = copy.deepcopy(user)
    config.update({key: value for key, (value, _) in ours.items()})
    config["bf16"] = {**config.get("bf16", {}), "enabled": bf16}
    if fp16:
        config["fp16"] = {"loss_scale": 0, "initial_scale_power": 16, "min_loss_scale": 1, **config.get("fp16", {}), "enabled": True}
    else:
        config.pop("fp16", None)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = 3
    for key, derive in AUTO_FROM_HIDDEN.items():
        if zero.get(key) == "auto":
            if hidden_size:
                zero[key] = derive(hidden_size)
            else:
                del zero[key]
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]
    for flag, key in ((dist_cfg.offload_optimizer, "offload_optimizer"), (dist_cfg.offload_param, "offload_param")):
        device = zero.get(key, {}).get("device", "none")
        if flag and device == "none":
            zero[key] = {**zero.get(key, {}), "device": "cpu"}
    # One optimizer step per accumulation group, called by the engine: DeepSpeed must not count micro-steps.
    config["managed_gradient_accumulation"] = False
    config["zero_force_ds_cpu_optimizer"] = False  # our torch AdamW also runs on offloaded states
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return {key: value for key, value in config.items() if value != "auto"}


DEEPSPEED_TAG = "deepspeed"  # DeepSpeed's checkpoint folder inside checkpoint-N


class ZeRO3(Strategy):
    name = "zero3"

    def __init__(self, dist_cfg: DistConfig, optim_cfg: OptimConfig, **kwargs):
        super().__init__(dist_cfg, **kwargs)
        import deepspeed

        self.optim_cfg = optim_cfg  # the batch sizes and clipping DeepSpeed's config repeats
        if self.precision == "fp16" and self.device.type == "cpu":
            raise ConfigError("--fp16 with --deepspeed: DeepSpeed has no float16 on the CPU; use --parallel fsdp2 here, or a GPU.")
        # Takes over the process group mmgrpo opened (gloo on CPU, NCCL on GPUs).
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   timeout=_timedelta(dist_cfg.ddp_timeout))
        self.engine = None

    @property
    def load_device(self) -> torch.device:
        return torch.device("cpu")  # deepspeed.initialize moves each rank's partition to its device

    def prepare(self, model, ref_model, make_optimizer, teacher=None) -> Prepared:
        import deepspeed

        hidden_size = getattr(model.config.get_text_config(), "hidden_size", None)
        config = deepspeed_config(self.dist_cfg, self.optim_cfg, self.world_size, hidden_size, precision=self.precision)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.engine, optimizer, _, _ = deepspeed.initialize(
            model=Wrapper(model), model_parameters=trainable, optimizer=make_optimizer, config=config
        )
        # frozen models (the reference, the teacher): partitioned alike, without an optimizer
        frozen_config = {k: v for k, v in config.items() if k not in ("gradient_clipping", "zero_force_ds_cpu_optimizer")}
        frozen_config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"}
        ref_call, teacher_call = plain_call, plain_call
        if ref_model is not None:
            ref_call, *_ = deepspeed.initialize(model=Wrapper(ref_model), config=frozen_config)
            ref_call.eval()
        if teacher is not None:
            teacher_call, *_ = deepspeed.initialize(model=Wrapper(teacher), config=frozen_config)
            teacher_call.eval()
        return Prepared(
            optimizer=optimizer.optimizer,  # the torch AdamW inside (LR schedulers want a torch Optimizer)
            call=self.engine,  # the engine's forward also gathers weights read outside their module (the LM head)
            ref_call=ref_call,
            teacher_call=teacher_call,
            # Rollouts call the module itself: each submodule gathers its weights (or all are gathered at once).
            rollout_scope=self.all_gathered if self.dist_cfg.gather_for_generation else nullcontext,
        )

    @contextmanager
    def all_gathered(self):
        """Every weight gathered on every rank for a whole rollout: one gather instead of one per
        decoding step. ZeRO-3's module hooks are off meanwhile (DeepSpeed's own
        `unwrap_model_for_generation`), or the first forward's post-hooks would release the
        weights that later steps, the lean ones included, read."""
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(self.engine):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # our losses are normalised for the whole update already

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        scale = self.engine.optimizer.loss_scale if self.precision == "fp16" else None
        self.engine.step()  # clips to gradient_clipping (= --max_grad_norm), steps, zeroes; fp16: skips an overflow
        # An fp16 overflow DeepSpeed skipped while the scale could still drop is the loss scale's business (base.clip_and_step)
        self.overflowed = scale is not None and not self.engine.was_step_applied() and scale > 1
        if self.overflowed:
            return float("inf")
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def loss_scale_state(self) -> dict:
        return {}  # DeepSpeed keeps its loss scaler in its own checkpoint (save_sharded_optimizer)

    @property
    def loss_scale(self) -> float | None:
        return float(self.engine.optimizer.loss_scale) if self.precision == "fp16" else None

    def zero_grad(self, optimizer) -> None:
        self.engine.optimizer.zero_grad(set_to_none=True)

    def save_sharded_optimizer(self, optimizer, folder) -> None:
        # DeepSpeed's own format: each rank writes its partition of the fp32 masters and Adam moments
        self.engine.save_checkpoint(str(folder), tag=DEEPSPEED_TAG, save_latest=False)

    def load_sharded_optimizer(self, optimizer, folder) -> None:
        self.engine.load_checkpoint(str(folder), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                    load_lr_scheduler_states=False)  # the schedule is mmgrpo's (scheduler.pt)

    def full_tensors(self, model, names: list[str]):
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        params = dict(self.engine.module.named_parameters())  # `model.<hf name>`
        for name in names:
            param = params[f"model.{name}"]
            if param.requires_grad:
                yield name, safe_get_full_fp32_param(param).detach()  # the fp32 master, gathered
            else:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.data.detach().clone()

    def full_state_dict(self, model, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.engine.module
        state: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():  # one parameter at a time: rank 0 never holds two copies
            if param.requires_grad:
                full = safe_get_full_fp32_param(param)  # the fp32 master, not the bf16 module weight
            elif trainable_only:
                continue
            else:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    full = param.data.float()
            if self.is_main:
                state[name] = full.detach().cpu().clone()
        if not self.is_main or trainable_only:
            return hf_state_dict(state) if self.is_main else {}
        for name, buffer in module.state_dict().items():  # persistent buffers: never partitioned
            if name not in state:
                state[name] = buffer.detach().cpu()
        return hf_state_dict(state)


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
