"""A model family added in one file outside the package, as docs/custom_template.md walks through.

The plugin is the example file of the docs page itself (extracted from its code block), so the
page's code is what is tested.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.templates import get_template, load_template_plugin, template_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_template.md"


def _doc_plugin_source() -> str:
    """The code block right after "Save this as `my_template.py`" in the docs page."""
    text = DOC.read_text()
    after = text[text.index("Save this as `my_template.py`") :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def _image(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "my_template.py"
    path.write_text(_doc_plugin_source())
    assert load_template_plugin(str(path)) == ["qwen2-vl-nosys"]
    return path


def test_plugin_registers_and_loads_once(plugin):
    assert "qwen2-vl-nosys" in template_names()
    assert load_template_plugin(str(plugin)) == ["qwen2-vl-nosys"]  # a second load is a no-op


def test_plugin_template_works_end_to_end(plugin, tiny_qwen2_vl_path):
    processor, model = load_processor(tiny_qwen2_vl_path), load_model(tiny_qwen2_vl_path)
    template = get_template("qwen2_vl_nosys", processor)  # names are normalised
    samples = [
        LoadedSample(
            id="c/0", messages=[{"role": "user", "content": "<image>Where?"}], images=[_image(84, 56)]
        ),
        LoadedSample(
            id="c/1",
            messages=[{"role": "user", "content": "Is <image> red? Think step by step."}],
            images=[_image(140, 112, seed=1)],
        ),
    ]
    prompts = [template.encode_prompt(s) for s in samples]
    assert prompts[0].prompt_text.startswith("<|im_start|>user\n")  # no default system turn
    for prompt, sample in zip(prompts, samples):
        expected = processor(text=[prompt.prompt_text], images=sample.images, return_tensors="pt")
        assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist()
        assert torch.equal(prompt.mm["pixel_values"], expected["pixel_values"])

    batch = template.collate(prompts)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=5,
            do_sample=True,
            suppress_tokens=template.suppress_token_ids,
            output_logits=True,
            return_dict_in_generate=True,
        )
    completion_ids = out.sequences[:, batch["input_ids"].shape[1] :]
    expected = torch.log_softmax(torch.stack(out.logits, 1), -1).gather(-1, completion_ids[..., None])[..., 0]
    policy = Policy(model, template)
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(
            policy.forward_batch(prompts, [1, 1]), completion_ids, torch.ones_like(completion_ids)
        )
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)

    # its own box convention: 0-1 fractions of the original image
    assert template.box_mapper(prompts[0])([0.5, 0.5, 1.0, 1.0]) == [42.0, 28.0, 84.0, 56.0]
    audio = LoadedSample(
        id="c/2", messages=[{"role": "user", "content": "<audio>?"}], audios=[np.zeros(800, np.float32)]
    )
    with pytest.raises(DataError, match="c/2.*audio.*qwen2-vl-nosys"):
        template.encode_prompt(audio)


def test_plugin_template_takes_the_fast_paths(plugin, tiny_qwen2_vl_path):
    """The docs' plugin is Qwen2-VL's architecture under a new name, declaring the fast paths: it
    gets the group-shared prefix in log-prob forwards and rollouts and the lean decode step, and
    both equal the naive paths."""
    from mmgrpo.forward.shared_prefix import shared_prefix_hidden
    from mmgrpo.rollout import HFRollout, SamplingParams, SharedPrefixRollout, build_rollout_engine

    processor, model = load_processor(tiny_qwen2_vl_path), load_model(tiny_qwen2_vl_path)
    template = get_template("qwen2-vl-nosys", processor)
    assert type(template).__module__.startswith("mmgrpo_plugin_")  # really the plugin's class
    policy = Policy(model, template)
    assert policy.shared_prefix, policy.naive_reason
    engine = build_rollout_engine(policy)
    assert isinstance(engine, SharedPrefixRollout) and engine.lean is not None

    samples = [
        LoadedSample(id="f/0", messages=[{"role": "user", "content": "<image>Where?"}], images=[_image(84, 56)]),
        LoadedSample(id="f/1", messages=[{"role": "user", "content": "Colour of <image>, step by step?"}],
                     images=[_image(140, 112, seed=1)]),
    ]  # fmt: skip
    prompts = [template.encode_prompt(s) for s in samples]
    params = SamplingParams(num_generations=2, max_new_tokens=8, greedy=True)
    rollout = engine.generate(prompts, params)
    assert torch.equal(rollout.completion_ids, HFRollout(model, template).generate(prompts, params).completion_ids)
    ids, mask = rollout.completion_ids, rollout.completion_mask
    batch = template.collate(prompts)
    with torch.no_grad():
        naive = template.forward_inputs(batch, ids, mask)
        prompt_len = batch["input_ids"].shape[1]
        expected = model.model(**naive, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
        shared = shared_prefix_hidden(model, template, batch, ids, mask, 2)
    torch.testing.assert_close(shared * mask[..., None], expected * mask[..., None], atol=1e-5, rtol=0)


def test_plugin_as_module(tmp_path, monkeypatch):
    (tmp_path / "my_plugin_pkg_x1.py").write_text(
        "from mmgrpo.templates import register_template\n"
        "from mmgrpo.templates.qwen2 import Qwen2Template\n"
        "@register_template('qwen2-terse')\n"
        "class Terse(Qwen2Template):\n"
        "    def render(self, messages, add_generation_prompt=True):\n"
        "        return ''.join(m['content'] for m in messages)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_template_plugin("my_plugin_pkg_x1") == ["qwen2-terse"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "file not found"),
        ("x = 1\n", "registered no template"),
        ("raise RuntimeError('boom')\n", "failed to load: RuntimeError: boom"),
        (
            "from mmgrpo.templates import Template, register_template\n"
            "register_template('qwen2-vl')(type('Again', (Template,), {}))\n",
            "already registered",
        ),
    ],
)
def test_plugin_errors(source, message, tmp_path):
    path = tmp_path / "bad_template.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ConfigError, match=message):
        load_template_plugin(str(path))


def test_plugin_from_the_command_line(tmp_path):
    """`mmgrpo train --template_plugin my_template.py` and `mmgrpo eval --template_plugin ...`, as the docs show."""
    from mmgrpo.cli import main

    path = tmp_path / "my_cli_template.py"  # the docs' plugin under a name no other test loads
    path.write_text(_doc_plugin_source().replace("qwen2-vl-nosys", "qwen2-vl-nosys-cli"))
    assert "qwen2-vl-nosys-cli" not in template_names()
    out = tmp_path / "run"
    main(["train", "--template_plugin", str(path), "--model_type", "qwen2-vl-nosys-cli", "--model", "tiny:qwen2-vl",
          "--dataset", "shapes-color", "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "4",
          "--max_completion_length", "8", "--beta", "0", "--dataloader_num_workers", "0", "--logging_steps", "100",
          "--output_dir", str(out)])  # fmt: skip
    assert (out / "metrics.jsonl").read_text().count("\n") == 1
    assert "qwen2-vl-nosys-cli" in template_names()
    main(["eval", "--template_plugin", str(path), "--model_type", "qwen2-vl-nosys-cli", "--model",
          str(out / "checkpoint-1"), "--dataset", "shapes-color:test", "--limit", "2",
          "--max_completion_length", "4", "--output_dir", str(tmp_path / "eval")])  # fmt: skip
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["counts"]["all"] == 2
    # the checkpoint remembers its plugin: a fresh process evaluates it with neither flag
    info = json.loads((out / "checkpoint-1" / "mmgrpo.json").read_text())
    assert info == {"model_type": "qwen2-vl-nosys-cli", "template_plugin": str(path.resolve())}
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mmgrpo", "eval", "--model", str(out / "checkpoint-1"), "--dataset",
                           "shapes-color:test", "--limit", "2", "--max_completion_length", "4", "--output_dir",
                           str(tmp_path / "eval-fresh")], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(DOC.parents[1])))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(qwen2-vl-nosys-cli)" in done.stderr + done.stdout
    path.rename(tmp_path / "moved.py")
    done = subprocess.run([sys.executable, "-m", "mmgrpo", "eval", "--model", str(out / "checkpoint-1"), "--dataset",
                           "shapes-color:test", "--limit", "2", "--output_dir", str(tmp_path / "eval-moved")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(DOC.parents[1])))
    assert done.returncode == 2 and f"template plugin {path.resolve()}, which is not there" in done.stderr
