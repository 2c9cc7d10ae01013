"""Routing replay (--routing_replay rollout) on tiny:qwen3-vl-moe: the experts each token was routed
to while sampling are recorded by the HF rollout and forced in the trainer's forwards.

The sampler and the trainer here differ as they do in practice when the sampler holds its own copy
of the weights (vLLM, asynchronous rollouts): its router is not exactly the trainer's (a small
perturbation of the router weights, nothing else), so near-tied tokens go to other experts. With
top-1 routing a token's gate weight is 1 whatever the router's logits, so under replay routing is
the only thing that could make the trainer's log-probs differ from the sampler's: they are equal.
With the family's top-2 the replayed gate weights still come from the trainer's router, so replay
closes most of the gap, not all of it.
"""

import copy

import pytest
import torch

from mmgrpo.cli import main as cli_main
from mmgrpo.config import TrainConfig
from mmgrpo.data.sample import LoadedSample
from mmgrpo.errors import ConfigError
from mmgrpo.forward.policy import Policy
from mmgrpo.forward.routing_replay import Routing, RoutingRecorder, moe_routers
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout.base import Rollout, SamplingParams, completion_mask_from_ids
from mmgrpo.rollout.hf import HFRollout
from mmgrpo.templates import get_template
from mmgrpo.training.startup_checks import check_train_flags

TEXTS = ["Hi.", "Tell me a long story about a red square and a blue circle.", "What?",
         "Count to ten slowly please, and then back."]


@pytest.fixture(scope="module")
def path():
    return str(build_tiny("qwen3-vl-moe"))


@pytest.fixture(scope="module")
def template(path):
    return get_template("qwen3-vl-moe", load_processor(path))


def _prompts(template):
    return [template.encode_prompt(LoadedSample(id=f"rr/{i}", messages=[{"role": "user", "content": text}]))
            for i, text in enumerate(TEXTS)]


def _model(path, top_k=None):
    """The tiny checkpoint, optionally with another top-k (the weights do not depend on it)."""
    model = load_model(path)
    if top_k is not None:
        model.config.text_config.num_experts_per_tok = top_k
        for router in moe_routers(model):
            router.top_k = top_k
    return model


def _perturbed_router_copy(model, scale=0.05):
    """A sampler's copy whose routers differ from the trainer's by `scale` x their std, nothing else."""
    sampler = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(sampler):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale * router.weight.std())
    return sampler


def _sample(sampler, template, prompts):
    """Completions, the sampler's own log-probs of them and the routes it took."""
    batch = template.collate(prompts)
    torch.manual_seed(0)
    with torch.no_grad(), RoutingRecorder(sampler) as recorder:
        out = sampler.generate(**batch, max_new_tokens=32, do_sample=True, suppress_tokens=template.suppress_token_ids,
                               output_logits=True, return_dict_in_generate=True, eos_token_id=template.eos_token_ids,
                               pad_token_id=template.completion_pad_id)
    ids = out.sequences[:, batch["input_ids"].shape[1]:]  # [R, T]
    mask, _ = completion_mask_from_ids(ids, template.eos_token_ids)
    logps = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, ids[..., None])[..., 0] * mask
    return ids, mask, logps, recorder.per_row(batch["attention_mask"], mask.sum(1))


def _trainer_logps(model, template, prompts, ids, mask, routed, replay):
    policy = Policy(model, template, per_row_routing=True)
    assert not policy.shared_prefix  # routes are per row: the naive path
    routing = Routing(routed, replay=replay)
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1] * len(prompts)), ids, mask,
                                              routing=routing)
    return logps, routing


def test_replay_makes_the_trainers_logps_the_samplers(path, template):
    model = _model(path, top_k=1)
    prompts = _prompts(template)
    ids, mask, sampler_logps, routed = _sample(_perturbed_router_copy(model), template, prompts)
    own, own_routing = _trainer_logps(model, template, prompts, ids, mask, routed, replay=False)
    replayed, replay_routing = _trainer_logps(model, template, prompts, ids, mask, routed, replay=True)
    assert own_routing.mismatched > 0  # the trainer's own router sends some tokens elsewhere ...
    assert (own - sampler_logps).abs().max() > 1e-2  # ... and their log-probs move
    torch.testing.assert_close(replayed, sampler_logps, atol=1e-5, rtol=0)  # replayed: the sampler's log-probs
    layers = len(moe_routers(model))
    assert replay_routing.total == own_routing.total == sum(r.shape[0] for r in routed) * layers


def test_replay_closes_most_of_the_gap_with_top_2(path, template):
    model = _model(path)
    prompts = _prompts(template)
    ids, mask, sampler_logps, routed = _sample(_perturbed_router_copy(model), template, prompts)
    own, routing = _trainer_logps(model, template, prompts, ids, mask, routed, replay=False)
    replayed, _ = _trainer_logps(model, template, prompts, ids, mask, routed, replay=True)
    assert routing.mismatched / routing.total > 0.01
    assert (replayed - sampler_logps).abs().max() < (own - sampler_logps).abs().max() / 10


def test_router_trains_through_the_replayed_gate_weights(path, template):
    model = _model(path)
    prompts = _prompts(template)[:2]
    ids, mask, _, routed = _sample(_perturbed_router_copy(model), template, prompts)
    policy = Policy(model, template, per_row_routing=True)
    routing = Routing(routed, replay=True, aux=True)
    logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1, 1]), ids, mask, routing=routing)
    assert routing.aux_loss is not None and routing.aux_loss > 1.0  # k = 2 experts per token: 2 when balanced
    (logps.sum() + routing.aux_loss).backward()
    routing.detach()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert not any(router._forward_hooks for router in moe_routers(model))  # nothing left on the routers


def test_hf_rollout_records_each_rows_routes(path, template):
    model = _model(path)
    prompts = _prompts(template)[:2]
    engine = HFRollout(model, template)
    rollout = engine.generate(prompts, SamplingParams(num_generations=3, max_new_tokens=6, seed=0))
    assert len(rollout.routed_experts) == 6
    layers = len(moe_routers(model))
    for row, routes in enumerate(rollout.routed_experts):
        prompt_len = prompts[row // 3].prompt_ids.shape[0]
        assert routes.dtype == torch.int16 and routes.shape[1:] == (layers, 2)
        assert prompt_len < routes.shape[0] <= prompt_len + int(rollout.completion_mask[row].sum())
        assert torch.equal(routes[:prompt_len], rollout.routed_experts[row // 3 * 3][:prompt_len])  # a group shares its prompt
    # on the sampler's own weights (fp32, one process) the trainer routes every token as the sampler did
    policy = Policy(model, template, per_row_routing=True)
    routing = Routing(rollout.routed_experts, replay=False)
    with torch.no_grad():
        policy.completion_logprobs(policy.forward_batch(prompts, [3, 3]), rollout.completion_ids,
                                   rollout.completion_mask, routing=routing)
    assert routing.total > 0 and routing.mismatched == 0
    picked = rollout.select([5, 0])  # the routes follow their rows through select / concat
    assert picked.routed_experts[0] is rollout.routed_experts[5]
    both = Rollout.concat([picked, rollout.select([1])], pad_token_id=0)
    assert [r is s for r, s in zip(both.routed_experts, [rollout.routed_experts[i] for i in (5, 0, 1)])] == [True] * 3


FAST = ["--dataset", "shapes-color", "--reward_funcs", "vqa_accuracy", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--dataloader_num_workers", "0",
        "--max_steps", "1", "--report_to", "none"]


def test_train_with_routing_replay_and_the_aux_loss(tmp_path, path):
    import json

    from safetensors.torch import load_file

    out = tmp_path / "run"
    cli_main(["train", "--model", "tiny:qwen3-vl-moe", *FAST, "--routing_replay", "rollout",
              "--router_aux_loss_coef", "0.01", "--num_iterations", "2", "--output_dir", str(out)])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["routing/mismatch_fraction"] == 0.0  # one process, fp32: the old forward routes as sampled
    assert metrics[-1]["routing/aux_loss"] > 1.0
    before = load_file(f"{path}/model.safetensors")
    after = load_file(out / "checkpoint-1" / "model.safetensors")
    unchanged = [name for name, weight in before.items() if torch.equal(weight, after[name].to(weight.dtype))]
    assert unchanged == []  # every weight trained: towers, attention, each router, each expert bank
    for name, weight in before.items():
        if ".mlp.experts." in name:
            for expert in range(weight.shape[0]):
                assert not torch.equal(weight[expert], after[name][expert].to(weight.dtype)), f"{name}[{expert}]"


def test_routing_flags_need_a_mixture_of_experts():
    for flags in (["--routing_replay", "rollout"], ["--router_aux_loss_coef", "0.001"]):
        cfg = TrainConfig.from_args(["--model", "tiny:qwen2-vl", *flags])
        with pytest.raises(ConfigError, match=f"{flags[0]}.*dense model"):
            check_train_flags(cfg)
    cfg = TrainConfig.from_args(["--model", "random:qwen3-vl-8b", "--routing_replay", "rollout"])
    with pytest.raises(ConfigError, match="--routing_replay rollout: random:qwen3-vl-8b is a dense model"):
        check_train_flags(cfg)
    check_train_flags(TrainConfig.from_args(["--model", "random:qwen3-vl-30b-a3b", "--routing_replay", "rollout"]))
    cfg = TrainConfig.from_args(["--model", "tiny:qwen3-vl-moe", "--routing_replay", "rollout", "--max_turns", "2",
                                 "--tools", "image_zoom_in_tool"])
    with pytest.raises(ConfigError, match="--routing_replay rollout records routes in the HF rollout engine"):
        check_train_flags(cfg)


def test_checkpointed_layers_recompute_with_the_replayed_routes(path, template):
    """Gradient checkpointing runs each layer again in the backward: the hooks stay until `detach`, so
    the recompute routes as the forward did and the gradients are those without checkpointing."""
    model = _model(path)
    prompts = _prompts(template)[:2]
    ids, mask, _, routed = _sample(_perturbed_router_copy(model, scale=0.2), template, prompts)
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        policy = Policy(model, template, per_row_routing=True)
        routing = Routing(routed, replay=True)
        model.zero_grad(set_to_none=True)
        logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1, 1]), ids, mask, routing=routing)
        logps.sum().backward()
        routing.detach()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    model.gradient_checkpointing_disable()
    model.eval()
    assert routing.mismatched > 0  # the replay changed some routes ...
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():  # ... and the recompute kept them
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)
