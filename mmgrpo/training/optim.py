"""The optimizer and its learning-rate schedule, from the `optim` flags (GRPO and SFT alike).

    optimizer = make_optimizer(cfg.optim, model, template.components)(params)   # a factory: sharding
    scheduler = make_scheduler(cfg.optim, optimizer, total_steps)                # strategies build it on the shards

Schedules are transformers' own, by their HF names (`--lr_scheduler_type`), with their options as
`--lr_scheduler_kwargs` JSON; the warm-up is --warmup_steps, else ceil(warmup_ratio x steps), as the HF Trainer counts it.

Per-component rates (`--vit_lr`, `--aligner_lr`, ms-swift's names, and `--fusion_lr`): the
weights that train are split into parameter groups by the template's components (mmgrpo/models/train_type.py's
parts; LoRA adapters go with the layer they adapt): `llm` (the language model and anything outside
the other parts) at --learning_rate, `vit`, `aligner` and `fusion` at their own. transformers'
schedules scale every group's peak by the same factor each step, so each follows the same shape
from its own peak; the groups' rates are logged as learning_rate/<group> and saved with the
optimizer's state. Without those flags there is one group, as before.
"""

from __future__ import annotations

import inspect
import json
import math
from functools import partial

import torch

from mmgrpo.config import OptimConfig
from mmgrpo.errors import ConfigError

# The HF schedule names mmgrpo accepts (transformers.SchedulerType values).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup", "warmup_stable_decay")
# cosine_with_min_lr without options decays to 10% of the peak (mmgrpo's `cosine` before HF's names).
DEFAULT_SCHEDULER_KWARGS = {"cosine_with_min_lr": {"min_lr_rate": 0.1}}


# group name, the lora.py part it takes, its flag; the first group is --learning_rate's
GROUP_FLAGS = {"vit": "vit_lr", "aligner": "aligner_lr", "fusion": "fusion_lr"}
GROUP_OF_PART = {"vision": "vit", "aligner": "aligner"}
FUSION_PREFIX = "fusion_modules."  # mmgrpo/fusion/attach.py's FUSION_ATTR


def component_rates(optim_cfg: OptimConfig) -> dict[str, float]:
    """{group: peak rate} of the per-component flags given, e.g. {"vit": 2e-6}; {} if none is."""
    rates = {group: getattr(optim_cfg, flag, None) for group, flag in GROUP_FLAGS.items()}
    return {group: rate for group, rate in rates.items() if rate is not None}


def group_of(name: str, components: dict[str, str]) -> str:
    """The parameter group of a parameter name.

    >>> components = {"vision": "model.visual", "aligner": "model.visual.merger", "llm": "model.language_model"}
    >>> [group_of(n, components) for n in ("model.visual.blocks.0.attn.qkv.lora_A.default.weight",
    ...  "model.visual.merger.mlp.0.weight", "lm_head.weight", "fusion_modules.blocks.4.gate")]
    ['vit', 'aligner', 'llm', 'fusion']
    """
    from mmgrpo.models.train_type import part_of

    if name.startswith(FUSION_PREFIX):
        return "fusion"
    return GROUP_OF_PART.get(part_of(name, components), "llm")


def make_optimizer(optim_cfg: OptimConfig, model=None, components: dict[str, str] | None = None):
    """`params -> AdamW` as the optim flags say. Fused (default): one kernel updates every tensor
    in place, on CPU and CUDA; the update is the same as the for-loop's to float rounding.

    With --vit_lr / --aligner_lr / --fusion_lr the factory splits the parameters it gets into
    named groups by their names in `model` (looked up when it is called: after sharding, the
    shards are the model's parameters), each with its own peak rate.
    """
    adamw = partial(
        torch.optim.AdamW, lr=optim_cfg.learning_rate, weight_decay=optim_cfg.weight_decay,
        betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2), fused=optim_cfg.optim == "adamw_torch_fused" or None,
    )
    rates = component_rates(optim_cfg)
    if not rates:
        return adamw
    if model is None or components is None:
        raise ValueError("per-component learning rates need the model and the template's components")

    def build(params):
        return adamw(parameter_groups(params, model, components, optim_cfg.learning_rate, rates))

    return build


def parameter_groups(params, model, components, learning_rate: float, rates: dict[str, float]) -> list[dict]:
    """`params` as AdamW parameter groups {"name", "params", "lr"}: `llm` first (at learning_rate),
    then each group of `rates`. A flag whose group holds no weight that trains is a ConfigError."""
    names = {id(p): n for n, p in model.named_parameters()}
    members: dict[str, list] = {"llm": [], **{group: [] for group in rates}}
    for param in params:
        group = group_of(names[id(param)], components)
        members[group if group in rates else "llm"].append(param)
    for group, rate in rates.items():
        if not members[group]:
            flag = GROUP_FLAGS[group]
            where = "the fusion modules (give --fusion_module)" if group == "fusion" else (
                f"the {'vision tower' if group == 'vit' else 'aligner'} (frozen, or without LoRA adapters: see --target_modules)")
            raise ConfigError(f"--{flag} {rate}: no weight that trains is in {where}; drop --{flag} or let that part train.")
    return [{"name": group, "params": params, "lr": rates.get(group, learning_rate)}
            for group, params in members.items() if params]


def group_rates(optimizer, scheduler) -> dict[str, float]:
    """learning_rate/<group> of every named parameter group, the rates this step's update uses."""
    rates = scheduler.get_last_lr()
    return {f"learning_rate/{group['name']}": rate for group, rate in zip(optimizer.param_groups, rates) if "name" in group}


def scheduler_kwargs(optim_cfg: OptimConfig) -> dict:
    """--lr_scheduler_kwargs (a JSON string, or a mapping from YAML) checked against the schedule's options.

    >>> from mmgrpo.config import OptimConfig
    >>> scheduler_kwargs(OptimConfig(lr_scheduler_type="cosine_with_min_lr"))
    {'min_lr_rate': 0.1}
    >>> scheduler_kwargs(OptimConfig(lr_scheduler_type="cosine", lr_scheduler_kwargs='{"num_cycles": 1.0}'))
    {'num_cycles': 1.0}
    """
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    name, value = optim_cfg.lr_scheduler_type, optim_cfg.lr_scheduler_kwargs
    if name not in LR_SCHEDULERS:
        raise ConfigError(f"--lr_scheduler_type {name!r}: choose one of {', '.join(LR_SCHEDULERS)} (HF's names).")
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lr_scheduler_kwargs is not valid JSON ({exc.msg}); give e.g. '{{\"min_lr_rate\": 0.1}}'.") from None
    if name == "warmup_stable_decay" and not (isinstance(value, dict) and "num_decay_steps" in value):
        raise ConfigError(
            "--lr_scheduler_type warmup_stable_decay needs the length of its decay: "
            "--lr_scheduler_kwargs '{\"num_decay_steps\": 60, \"min_lr_ratio\": 0.1}'."
        )
    if value in (None, "", {}):
        return dict(DEFAULT_SCHEDULER_KWARGS.get(name, {}))
    if not isinstance(value, dict):
        raise ConfigError(f"--lr_scheduler_kwargs must be a JSON object, got {value!r}.")
    accepted = [
        p for p in inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters
        if p not in ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")
    ]
    unknown = sorted(set(value) - set(accepted))
    if unknown:
        raise ConfigError(
            f"--lr_scheduler_kwargs: {', '.join(unknown)} is not an option of {name!r}; it takes: {', '.join(accepted) or 'none'}."
        )
    return dict(value)


def warmup_steps(optim_cfg: OptimConfig, total_steps: int) -> int:
    """--warmup_steps when set, else ceil(warmup_ratio x total steps), as the HF Trainer counts them.

    >>> warmup_steps(OptimConfig(warmup_ratio=0.1), 25), warmup_steps(OptimConfig(warmup_ratio=0.1, warmup_steps=4), 25)
    (3, 4)
    """
    if optim_cfg.warmup_steps > 0:
        return optim_cfg.warmup_steps
    return math.ceil(optim_cfg.warmup_ratio * total_steps)


def make_scheduler(optim_cfg: OptimConfig, optimizer, total_steps: int):
    """transformers' schedule named by --lr_scheduler_type, stepped once per optimizer step.

    >>> from mmgrpo.config import OptimConfig
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> sched = make_scheduler(OptimConfig(lr_scheduler_type="linear", warmup_ratio=0.25), opt, total_steps=8)
    >>> rates = []
    >>> for _ in range(8):
    ...     rates.append(round(sched.get_last_lr()[0], 3)); opt.step(); sched.step()
    >>> rates
    [0.0, 0.5, 1.0, 0.833, 0.667, 0.5, 0.333, 0.167]
    """
    from transformers import get_scheduler

    return get_scheduler(
        optim_cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(optim_cfg, total_steps),
        num_training_steps=total_steps, scheduler_specific_kwargs=scheduler_kwargs(optim_cfg),
    )
