"""One rank of the sequence-parallel checks (tests/test_sequence_parallel.py), launched by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node N tests/sp_worker.py FAMILY OUT [checkpointing]

Every rank runs the naive forward of the whole batch in one process (the reference) and then the
same batch split across the ranks (Ulysses), each row whole and with each prompt once for its G rows
(the shared prefix), for a padded batch and an unpadded one; it writes the largest differences of
the log-probs and of the group-summed gradients to OUT/rank<r>.json, and the patches its vision
tower encoded in the split forwards. With `checkpointing`, under gradient checkpointing.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_shared_prefix import GROUP, _completions, _prompts, _video  # noqa: E402

from mmgrpo.data.sample import LoadedSample  # noqa: E402
from mmgrpo.forward.policy import final_logit_softcap  # noqa: E402
from mmgrpo.forward.sequence_parallel import (  # noqa: E402
    new_sequence_group,
    sequence_parallel_logprobs,
    split_shared_prefix_logprobs,
    sum_gradients,
    ulysses,
)
from mmgrpo.grpo.logprobs import completion_logprobs  # noqa: E402
from mmgrpo.models import load_model, load_processor  # noqa: E402
from mmgrpo.models.tiny import build_tiny  # noqa: E402
from mmgrpo.templates import get_template  # noqa: E402

KINDS = {"qwen3.5": ("video", "two_images"), "glm4v": ("clip", "video")}
# GLM's batches hold images or videos, not both (its `video` kind is an image): two clips of other lengths and sizes
CLIPS = {"clip": dict(num_frames=6, width=84)}
WINDOWED = {"gemma4": 16}  # sliding-window layers: the window, in tokens


def main(family: str, out: str, checkpointing: str = "") -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    path = str(build_tiny(family))
    model = load_model(path, dtype=torch.float32)
    if checkpointing:  # the backward recomputes each decoder layer, after the split forward has returned
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # the tiny models have no dropout: the same numbers as in eval mode
    if family in WINDOWED:  # a window shorter than the rows (the tiny config's 512 never binds)
        model.config.get_text_config().sliding_window = WINDOWED[family]
        for module in model.modules():
            if getattr(module, "sliding_window", None):
                module.sliding_window = WINDOWED[family]
    template = get_template(family, load_processor(path))
    group = new_sequence_group(dist.get_world_size())
    results = {
        # left-padded prompts of two kinds, right-padded completions: the whole row's mask
        "padded": compare(model, template, group, KINDS.get(family, ("video", "two_images")), full=False),
        # one prompt, completions of full length: nothing padded before a row's end, causal attention
        "unpadded": compare(model, template, group, ("video",), full=True),
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def compare(model, template, group, kinds, full: bool) -> dict:
    """One process's log-probs and gradients against the split forward's, on prompts of `kinds`."""
    backbone = model.get_submodule(template.components["backbone"])
    if any(kind in CLIPS for kind in kinds):
        batch = template.collate([template.encode_prompt(LoadedSample(
            id=f"c/{i}", messages=[{"role": "user", "content": "What happens? <video>"}], videos=[_video(**CLIPS.get(kind, {}))]))
            for i, kind in enumerate(kinds)])  # fmt: skip
    else:
        batch = template.collate(_prompts(template, kinds))
    ids, mask = _completions(len(kinds))
    if full:
        mask = torch.ones_like(mask)
    inputs = template.forward_inputs(template.repeat_rows(batch, GROUP), ids, mask, model=model)
    prompt_len = batch["input_ids"].shape[1]
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def grads():
        found = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None and p.grad.any()}
        model.zero_grad(set_to_none=True)
        return found

    hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
    head = dict(softcap=final_logit_softcap(model, template))  # Gemma caps its final logits
    expected, _ = completion_logprobs(hidden, model.lm_head.weight, ids, **head)
    ((expected * mask) * weights).sum().backward()
    expected_grads = grads()

    found = {}
    for shared in (False, True):  # each row's prompt in it, or each prompt once for its G rows
        encoded = []  # the patches (tiles) this rank's tower encodes in the split forward (a tower split by frames or tiles)
        split_tower = template.frame_local_tower or template.tile_local_tower
        if split_tower:
            tower = model.get_submodule(template.components["vision"])
            tower = getattr(tower, "vision_model", tower)  # SigLIP's transformer
            patches = tower.patch_embed if template.frame_local_tower else getattr(tower, "embeddings", None) or tower.patch_embedder
            hook = patches.register_forward_pre_hook(lambda module, args, seen=encoded: seen.append(args[0].shape[0]))
        if shared:
            got, _ = split_shared_prefix_logprobs(model, template, group, batch, ids, mask, [GROUP] * len(kinds),
                                                  model.lm_head.weight, **head)
        else:
            with ulysses(model, template, group) as split:
                local = backbone(**inputs, use_cache=False).last_hidden_state
                got, _ = sequence_parallel_logprobs(local, model.lm_head.weight, split, prompt_len, ids, **head)
            found.update({"row_length": split.length, "slice": [split.start, split.end], "masked": split.mask is not None})
        if split_tower:
            hook.remove()
        ((got * mask) * weights).sum().backward()
        sum_gradients(model, group)
        got_grads = grads()
        media = batch if shared else inputs  # the prompts once, or each row's
        found["shared" if shared else "naive"] = {
            "logps": float(((got - expected) * mask).abs().max()),
            "grads": {name: float((got_grads[name] - g).abs().max() / max(1.0, float(g.abs().max())))
                      for name, g in expected_grads.items()},
            "missing": sorted(set(expected_grads) - set(got_grads)),
            "tower_patches": sum(encoded), "all_patches": sum(int(media[key].shape[0]) for key in ("pixel_values", "pixel_values_videos")
                                                              if media.get(key) is not None),
        }  # fmt: skip
    return found


if __name__ == "__main__":
    main(*sys.argv[1:])
