"""Fusion modules (mmgrpo/fusion/): exact at step 0, the same through every forward and rollout path,
trained alone, saved and loaded back, plugins, and the errors of bad flags. On the tiny Qwen2-VL, fp32."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmgrpo.config import TrainConfig
from mmgrpo.data.sample import LoadedSample
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.forward.policy import Policy
from mmgrpo.fusion import FusionSpec, attach_fusion, bypassed, fusion_of
from mmgrpo.models.loading import load_model, load_template
from mmgrpo.models.tiny import resolve_model_path
from mmgrpo.rollout import HFRollout, SamplingParams, SharedPrefixRollout

MODULES = ["gated_xattn", "coattn"]
G = 3
FAST = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "6", "--dataloader_num_workers", "0",
        "--report_to", "none"]
# rewards that differ within a group: non-zero advantages from a random policy
REWARD = "def digits(completions, **columns):\n    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]\n"


@pytest.fixture(scope="module")
def template(tiny_qwen2_vl_path):
    return load_template(tiny_qwen2_vl_path, "qwen2-vl")[2]


def fresh_model(path, template):
    return load_model(path, template=template)


def prompts(template):
    """Two image prompts and a text-only one (whose rows have no memory)."""
    def image(seed):
        return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (56, 56, 3), dtype=np.uint8))

    samples = [LoadedSample(id=f"i{k}", messages=[{"role": "user", "content": "<image>What colour is it?"}], images=[image(k)])
               for k in range(2)]
    samples.append(LoadedSample(id="t", messages=[{"role": "user", "content": "Say something"}]))
    return [template.encode_prompt(sample) for sample in samples]


def completions(rows=3 * G, length=5):
    ids = torch.randint(10, 500, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # a shorter completion
    return ids, mask


def open_gates(fusion, value=0.7):
    """Trained-looking modules: every gate away from 0."""
    with torch.no_grad():
        for name, param in fusion.named_parameters():
            if name.endswith("gate"):
                param.fill_(value)


def logps(policy, encoded, ids, mask, counts=(G, G, G), reference=False):
    return policy.completion_logprobs(policy.forward_batch(encoded, list(counts)), ids, mask, reference=reference)[0]


@pytest.mark.parametrize("module", MODULES)
def test_fresh_modules_give_the_base_models_logprobs_exactly(tiny_qwen2_vl_path, template, module):
    model = fresh_model(tiny_qwen2_vl_path, template)
    encoded, (ids, mask) = prompts(template), completions()
    shared, naive = Policy(model, template), Policy(model, template, shared_prefix=False)
    base = [logps(shared, encoded, ids, mask), logps(naive, encoded, ids, mask)]
    attach_fusion(model, template, FusionSpec(module, [0, 1]))
    assert torch.equal(logps(shared, encoded, ids, mask), base[0])
    assert torch.equal(logps(naive, encoded, ids, mask), base[1])


@pytest.mark.parametrize("module", MODULES)
def test_shared_prefix_equals_the_naive_forward_with_modules(tiny_qwen2_vl_path, template, module):
    model = fresh_model(tiny_qwen2_vl_path, template)
    fusion = attach_fusion(model, template, FusionSpec(module, [0, 1]))
    open_gates(fusion)
    encoded, (ids, mask) = prompts(template), completions()
    shared, naive = Policy(model, template), Policy(model, template, shared_prefix=False)
    assert shared.shared_prefix
    results = []
    for policy in (shared, naive):
        values = logps(policy, encoded, ids, mask)
        (values.sum()).backward()
        grads = {name: p.grad.clone() for name, p in fusion.named_parameters()}
        model.zero_grad()
        results.append((values, grads))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4, msg=name)
    assert grads_a["blocks.1.gate"].abs().item() > 0
    # groups of unequal size (a micro-batch that splits groups): row i continues the prompt counts say
    torch.testing.assert_close(logps(shared, encoded, ids, mask, (2, 4, 3)), logps(naive, encoded, ids, mask, (2, 4, 3)),
                               atol=1e-5, rtol=0)
    # the modules do change the model once their gates open; bypassed, it is the base again
    base = Policy(fresh_model(tiny_qwen2_vl_path, template), template)
    assert (a - logps(base, encoded, ids, mask)).abs().max() > 1e-2
    with bypassed(model):
        assert torch.equal(logps(shared, encoded, ids, mask), logps(base, encoded, ids, mask))


@pytest.mark.parametrize("module", MODULES)
def test_rollout_engines_run_the_modules(tiny_qwen2_vl_path, template, module):
    model = fresh_model(tiny_qwen2_vl_path, template)
    open_gates(attach_fusion(model, template, FusionSpec(module, [0, 1])))
    encoded = prompts(template)
    greedy = SamplingParams(num_generations=G, max_new_tokens=10, greedy=True)
    lean = SharedPrefixRollout(model, template)
    assert lean.lean is not None  # the lean decode step runs the modules itself
    reference = HFRollout(model, template).generate(encoded, greedy).completion_ids
    assert torch.equal(lean.generate(encoded, greedy).completion_ids, reference)
    assert torch.equal(SharedPrefixRollout(model, template, lean=False).generate(encoded, greedy).completion_ids, reference)
    # sampled, with groups leaving the decode batch as they finish (an early EOS: a frequent token)
    policy = Policy(model, template)
    eos = [int(t) for t in torch.unique(reference)[:40]]
    sampled = SamplingParams(num_generations=G, max_new_tokens=10, seed=1)
    dropping = SharedPrefixRollout(model, template, check_every=1, eos_token_ids=eos).generate(encoded, sampled)
    kept = SharedPrefixRollout(model, template, check_every=1, eos_token_ids=eos, drop_finished=False).generate(encoded, sampled)
    assert torch.equal(dropping.completion_ids, kept.completion_ids)
    assert len(set(dropping.completion_mask.sum(1).tolist())) > 1  # rows did end at different steps
    recomputed = logps(policy, encoded, dropping.completion_ids, dropping.completion_mask)
    torch.testing.assert_close(recomputed, dropping.logps, atol=1e-5, rtol=0)


def test_train_type_fusion_trains_the_modules_and_nothing_else(tmp_path):
    reward = tmp_path / "digits.py"
    reward.write_text(REWARD)
    out = train(TrainConfig.from_args([
        *FAST, "--reward_funcs", f"{reward}:digits", "--max_steps", "2", "--learning_rate", "1e-2", "--fusion_lr", "2e-2",
        "--train_type", "fusion", "--fusion_module", "gated_xattn", "--fusion_layers", "0,1", "--output_dir", str(tmp_path / "run"),
    ]))
    checkpoint = out / "checkpoint-2"
    base = load_file(f"{resolve_model_path('tiny:qwen2-vl')}/model.safetensors")
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert base.keys() == saved.keys() and all(torch.equal(base[k], saved[k]) for k in base)  # nothing else moved
    modules = load_file(str(checkpoint / "fusion_modules.safetensors"))
    template = load_template("tiny:qwen2-vl", None)[2]
    start = attach_fusion(fresh_model(resolve_model_path("tiny:qwen2-vl"), template), template,
                          FusionSpec("gated_xattn", [0, 1]), seed=0).state_dict()  # the run's initialisation (--seed 0)
    moved = {name for name in start if not torch.equal(start[name], modules[name])}
    assert {f"blocks.{i}.gate" for i in (0, 1)} <= moved
    assert {f"blocks.{i}.{part}.weight" for i in (0, 1) for part in ("query", "key_value", "out")} <= moved
    config = json.loads((checkpoint / "fusion_config.json").read_text())
    assert config["module"] == "gated_xattn" and config["layers"] == [0, 1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["learning_rate/fusion"] > 0 and "learning_rate/vit" not in rows[0]

    # `train --model` the checkpoint: its trained modules go on training (their reference: a copy of the start)
    again = train(TrainConfig.from_args([
        *FAST, "--model", str(checkpoint), "--reward_funcs", f"{reward}:digits", "--max_steps", "1", "--learning_rate", "1e-2",
        "--train_type", "fusion", "--output_dir", str(tmp_path / "again"),
    ]))
    continued = load_file(str(again / "checkpoint-1" / "fusion_modules.safetensors"))
    assert continued.keys() == modules.keys() and not torch.equal(continued["blocks.0.gate"], modules["blocks.0.gate"])
    with pytest.raises(ConfigError, match="holds fusion modules gated_xattn after layers 0,1, not --fusion_module coattn"):
        train(TrainConfig.from_args([*FAST, "--model", str(checkpoint), "--max_steps", "1", "--fusion_module", "coattn",
                                     "--fusion_layers", "0,1", "--output_dir", str(tmp_path / "mismatch")]))


def test_modules_move_after_the_gates_open(tiny_qwen2_vl_path, template):
    """One optimizer step moves only the gates (every other gradient is multiplied by tanh(0)); the next moves the rest."""
    model = fresh_model(tiny_qwen2_vl_path, template)
    model.requires_grad_(False)
    fusion = attach_fusion(model, template, FusionSpec("gated_xattn", [1]))
    fusion.requires_grad_(True)
    policy, encoded, (ids, mask) = Policy(model, template), prompts(template), completions()
    optimizer = torch.optim.AdamW(fusion.parameters(), lr=1e-2, weight_decay=0.0)  # mmgrpo's default
    start = {n: p.detach().clone() for n, p in fusion.named_parameters()}
    moved = []
    for _ in range(2):
        (-logps(policy, encoded, ids, mask).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        moved.append({n for n, p in fusion.named_parameters() if not torch.equal(p, start[n])})
    assert moved[0] == {"blocks.1.gate"}
    assert moved[1] == set(start)


def test_checkpoint_loads_back_and_resumes_exactly(tmp_path, template):
    """Full training with modules and per-component rates: the checkpoint's model loads with its modules
    (same log-probs), and a run resumed from checkpoint-1 ends where the uninterrupted one ended."""
    reward = tmp_path / "digits.py"
    reward.write_text(REWARD)
    argv = [*FAST, "--reward_funcs", f"{reward}:digits", "--max_steps", "2", "--save_steps", "1", "--learning_rate", "1e-3",
            "--vit_lr", "1e-4", "--aligner_lr", "3e-4", "--lr_scheduler_type", "linear", "--beta", "0.04",
            "--fusion_module", "coattn", "--fusion_layers", "1"]
    whole = train(TrainConfig.from_args([*argv, "--output_dir", str(tmp_path / "whole")]))
    resumed_dir = tmp_path / "resumed"  # the run as if stopped after its first save
    shutil.copytree(whole / "checkpoint-1", resumed_dir / "checkpoint-1")
    train(TrainConfig.from_args([*argv, "--output_dir", str(resumed_dir), "--resume_from_checkpoint", "latest"]))
    for name in ("model.safetensors", "fusion_modules.safetensors"):
        a, b = load_file(str(whole / "checkpoint-2" / name)), load_file(str(resumed_dir / "checkpoint-2" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["learning_rate/vit"] == pytest.approx(1e-4) and rows[1]["learning_rate/vit"] == pytest.approx(0.5e-4)
    assert rows[1]["learning_rate/aligner"] == pytest.approx(1.5e-4) and rows[1]["learning_rate"] == pytest.approx(0.5e-3)
    # loaded back by load_model (train --model, eval, viz): the modules with their weights
    path, _, loaded_template = load_template(str(whole / "checkpoint-2"), None)
    loaded = load_model(path, template=loaded_template)
    assert fusion_of(loaded).trained and fusion_of(loaded).spec.module == "coattn"
    encoded, (ids, mask) = prompts(template), completions()
    weights = load_file(str(whole / "checkpoint-2" / "fusion_modules.safetensors"))
    assert torch.equal(fusion_of(loaded).state_dict()["blocks.1.gate"], weights["blocks.1.gate"])
    reference = fresh_model(resolve_model_path("tiny:qwen2-vl"), template)
    assert (logps(Policy(loaded, template), encoded, ids, mask) - logps(Policy(reference, template), encoded, ids, mask)).abs().max() > 0


def test_a_plugin_module_registered_from_a_file_trains(tmp_path):
    plugin = tmp_path / "my_fusion.py"
    plugin.write_text(
        "import torch\n"
        "from mmgrpo.fusion import FusionModule, register_fusion\n\n"
        "@register_fusion('mean_image')\n"
        "class MeanImage(FusionModule):\n"
        "    def __init__(self, hidden_size, num_heads, layer):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(hidden_size, hidden_size)\n"
        "        self.gate = torch.nn.Parameter(torch.zeros(1))\n"
        "    def prepare(self, features, feature_mask, text, text_mask):\n"
        "        weights = feature_mask.float()[..., None]\n"
        "        return {'mean': (features * weights).sum(1) / weights.sum(1).clamp(min=1)}\n"
        "    def forward(self, hidden, memory, memory_mask):\n"
        "        has_media = memory_mask.any(1).to(hidden.dtype)[:, None, None]\n"
        "        return hidden + torch.tanh(self.gate) * has_media * self.proj(memory['mean'])[:, None]\n"
    )
    reward = tmp_path / "digits.py"
    reward.write_text(REWARD)
    out = train(TrainConfig.from_args([
        *FAST, "--reward_funcs", f"{reward}:digits", "--max_steps", "1", "--learning_rate", "1e-2", "--train_type", "fusion",
        "--fusion_plugin", str(plugin), "--fusion_module", "mean_image", "--output_dir", str(tmp_path / "run"),
    ]))
    config = json.loads((out / "checkpoint-1" / "fusion_config.json").read_text())
    assert config["module"] == "mean_image" and config["layers"] == [1] and config["plugins"] == [str(plugin.resolve())]
    assert load_file(str(out / "checkpoint-1" / "fusion_modules.safetensors"))["blocks.1.gate"].abs().item() > 0


def test_the_reliance_probe(tiny_qwen2_vl_path, template):
    """Exactly 0 where the tower's output ignores the image; attention shares per band, in [0, 1]."""
    from mmgrpo.eval.reliance import measure_reliance

    model = fresh_model(tiny_qwen2_vl_path, template)
    encoded, (ids, mask) = prompts(template), completions(rows=3)
    before = measure_reliance(Policy(model, template), encoded, ids, mask)
    assert set(before) == {"fusion/reliance/image", "fusion/attention/image/shallow", "fusion/attention/image/deep"}
    assert before["fusion/reliance/image"] != 0 and 0 < before["fusion/attention/image/deep"] < 1
    merger = model.get_submodule(template.components["aligner"])
    last = [m for m in merger.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
    assert measure_reliance(Policy(model, template), encoded, ids, mask)["fusion/reliance/image"] == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--fusion_module", "gated_xattn", "--fusion_layers", "5"], "--fusion_layers 5: the model has 2 decoder layers; give indices from 0 to 1"),
    (["--fusion_module", "cross"], "unknown fusion module 'cross' \\(--fusion_module\\); choose one of: coattn, gated_xattn"),
    (["--fusion_layers", "1"], "--fusion_layers needs --fusion_module"),
    (["--train_type", "fusion"], "--train_type fusion trains fusion modules only: give --fusion_module"),
    (["--fusion_module", "gated_xattn", "--use_vllm"], "--fusion_module gated_xattn with --use_vllm: vLLM runs the model's stock"),
    (["--fusion_module", "coattn", "--max_turns", "2", "--tools", "image_zoom_in_tool"], "--fusion_module with --max_turns 2"),
    (["--vit_lr", "0"], "--vit_lr 0.0: give a finite number > 0"),
    (["--vit_lr", "1e-5", "--freeze_vit"], "--vit_lr with --freeze_vit"),
    (["--fusion_lr", "1e-3"], "--fusion_lr 0.001: no weight that trains is in the fusion modules"),
])
def test_bad_fusion_flags_fail_at_start_up_naming_the_flag(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message):
        train(TrainConfig.from_args([*FAST, "--max_steps", "1", *argv, "--output_dir", str(tmp_path / "run")]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag, message", [
    ("--vit_lr", "--vit_lr: template 'qwen2' declares no vision \\(or audio\\) tower"),
    ("--aligner_lr", "--aligner_lr: template 'qwen2' declares no aligner"),
])
def test_component_rates_of_a_family_without_that_part(tmp_path, flag, message):
    data = tmp_path / "sums.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}], "solution": "4"}) + "\n")
    argv = [*FAST, "--model", "tiny:qwen2", "--dataset", str(data), "--reward_funcs", "vqa_accuracy", flag, "1e-5"]
    with pytest.raises(ConfigError, match=message):
        train(TrainConfig.from_args([*argv, "--max_steps", "1", "--output_dir", str(tmp_path / "run")]))


@pytest.mark.slow
def test_reliance_is_positive_once_a_model_reads_the_image(tmp_path):
    """The demo's recipe in brief (the wider vision init, 16 visual tokens, colour alone, 80 SFT steps
    of 32): the answers' log-probs now fall when the image is blanked, several times more than the
    random start's do."""
    from mmgrpo.config import SFTConfig
    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.eval.reliance import measure_reliance
    from mmgrpo.sft import encode_targets, sft, sft_target

    start = "tiny:qwen2-vl?vision_init_gain=3"
    trained = sft(SFTConfig.from_args([
        "--model", start, "--dataset", "shapes-color", "--max_steps", "80", "--learning_rate", "2e-3",
        "--per_device_train_batch_size", "32", "--min_pixels", "12544", "--max_pixels", "12544",
        "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", str(tmp_path / "sft"),
    ]))
    reliance = {}
    for name, model_path in (("start", start), ("trained", str(trained))):
        path, _, template = load_template(model_path, None, min_pixels=12544, max_pixels=12544)
        dataset = resolve_dataset("shapes-color:test")
        samples = [dataset[i] for i in range(16)]
        encoded = [template.encode_prompt(sample.load_media()) for sample in samples]
        answers = [sft_target(sample, enc, template) for sample, enc in zip(samples, encoded)]  # teacher-forced answers
        ids, mask = encode_targets(answers, template.tokenizer, template.eos_token_ids[0])
        policy = Policy(load_model(path, template=template), template)
        reliance[name] = measure_reliance(policy, encoded, ids, mask)["fusion/reliance/image"]
    assert reliance["trained"] > 0.2 and reliance["trained"] > 3 * abs(reliance["start"]), reliance


def test_eval_fusion_probe_writes_its_means(tmp_path, tiny_qwen2_vl_path):
    from mmgrpo.eval.evaluate import main as eval_main

    result = eval_main(["--model", tiny_qwen2_vl_path, "--dataset", "shapes-color:test", "--limit", "4", "--batch_size", "2",
                        "--max_completion_length", "4", "--output_dir", str(tmp_path / "eval"), "--fusion_probe"])
    saved = json.loads((tmp_path / "eval" / "fusion_probe.json").read_text())
    assert saved == result["fusion_probe"]
    assert set(saved) == {"fusion/reliance/image", "fusion/attention/image/shallow", "fusion/attention/image/deep"}


def test_gradient_checkpointing_keeps_the_shared_prefix_exact(tiny_qwen2_vl_path, template):
    """Checkpointed layers replay the modules' hooks in backward: the gradients stay those of the naive forward."""
    model = fresh_model(tiny_qwen2_vl_path, template)
    fusion = attach_fusion(model, template, FusionSpec("coattn", [0, 1]))
    open_gates(fusion)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    encoded, (ids, mask) = prompts(template), completions()
    grads = []
    for policy in (Policy(model, template), Policy(model, template, shared_prefix=False)):
        logps(policy, encoded, ids, mask).sum().backward()
        grads.append({name: p.grad.clone() for name, p in fusion.named_parameters()})
        model.zero_grad()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)
