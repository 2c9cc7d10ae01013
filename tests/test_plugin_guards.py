"""Plugins cannot hang, exit or corrupt a run (issue 49, kind 5): a plugin import is bounded in time and
named; a reward that exits is an error naming it; absurd reward values are refused; each reward scores its
own copy of the completions; a template's box convention is checked at load; a fusion module's output is
checked for shape and finiteness."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.config import ModelConfig
from mmgrpo.errors import ConfigError, RewardError
from mmgrpo.fusion.attach import check_fusion_flags
from mmgrpo.rewards import compute_rewards
from mmgrpo.rewards.reward_funcs import get_reward
from mmgrpo.templates import load_template_plugin
from mmgrpo.tools.tool_funcs import get_tool

ROOT = Path(__file__).resolve().parents[1]

# the loader of each kind of plugin, as the flags call it
LOADERS = {
    "reward": lambda path: get_reward(f"{path}:f"),
    "tool": lambda path: get_tool(f"{path}:f"),
    "template": lambda path: load_template_plugin(str(path)),
    "fusion": lambda path: check_fusion_flags(ModelConfig(fusion_plugin=[str(path)])),
}
HANGS = {
    "a busy loop": "while True:\n    pass\n",
    "a sleep": "import time\ntime.sleep(3600)\n",
    "a read from a pipe nobody writes": "import os\nr, w = os.pipe()\nos.read(r, 1)\n",
}


@pytest.mark.parametrize("hang", sorted(HANGS))
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_plugin_import_that_never_ends_is_a_line_naming_the_file(kind, hang, tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_PLUGIN_TIMEOUT", "0.3")
    path = tmp_path / f"stuck_{kind}.py"
    path.write_text(HANGS[hang] + "def f(completions, **columns):\n    return [0.0] * len(completions)\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=f"{kind} plugin '.*stuck_{kind}.py' did not finish importing within 0.3 s"):
        LOADERS[kind](path)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)\n", "raise SystemExit(3)\n", "exit()\n"])
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_plugin_that_exits_while_importing_is_an_error_naming_the_file(kind, exit_call, tmp_path):
    path = tmp_path / f"quits_{kind}.py"
    path.write_text(exit_call)
    with pytest.raises(ConfigError, match=f"{kind} plugin '.*quits_{kind}.py' called sys.exit"):
        LOADERS[kind](path)


def test_a_plugin_that_swallows_the_interruption_ends_the_process_with_one_line(tmp_path):
    path = tmp_path / "stubborn.py"
    path.write_text("import time\nwhile True:\n    try:\n        time.sleep(0.05)\n    except BaseException:\n        pass\n")
    code = f"from mmgrpo.rewards.reward_funcs import get_reward\nget_reward({str(path) + ':f'!r})\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMGRPO_PLUGIN_TIMEOUT": "0.5"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "reward plugin" in lines[0] and "stubborn.py" in lines[0] and "cannot be interrupted" in lines[0]
    assert time.monotonic() - started < 30


# ---- rewards ------------------------------------------------------------------------------------------

def exits(completions, **columns):
    import sys

    sys.exit(1)


def raises_system_exit(completions, **columns):
    raise SystemExit("done")


def exits_on_the_second(completions, **columns):
    if any("b" in c for c in completions):
        raise SystemExit(0)
    return [1.0] * len(completions)


@pytest.mark.parametrize("on_error", ["raise", "none"])
@pytest.mark.parametrize("func", [exits, raises_system_exit, exits_on_the_second])
def test_a_reward_that_exits_is_an_error_naming_it(func, on_error):
    with pytest.raises(RewardError, match=f"reward '{func.__name__}' called sys.exit"):
        compute_rewards([func], None, ["a", "b"], {}, on_error=on_error)
    with pytest.raises(RewardError, match=f"reward '{func.__name__}' called sys.exit"):  # under a time limit too
        compute_rewards([func], None, ["a", "b"], {}, on_error=on_error, timeout=30)


@pytest.mark.parametrize("value", [1e300, -1e300, 1e7, -3.5e38])
def test_absurd_reward_values_are_refused_naming_the_reward(value):
    def huge(completions, **columns):
        return [1.0, value]

    with pytest.raises(RewardError, match=re.escape(f"reward 'huge' returned {value} for sample 1")):
        compute_rewards([huge], None, ["a", "b"], {})
    per_func, total = compute_rewards([huge], None, ["a", "b"], {}, on_error="none")  # skipped, never trained on
    assert per_func[0, 1].isnan() and total.tolist() == [1.0, 0.0]


def rewrites_completions(completions, **columns):
    completions[:] = ["<think>x</think><answer>1</answer>"] * len(completions)
    columns["solution"][:] = ["1"] * len(completions)
    return [0.0] * len(completions)


def appends_to_completions(completions, **columns):
    completions.append("extra")
    return [0.0] * (len(completions) - 1)


@pytest.mark.parametrize("first", [rewrites_completions, appends_to_completions])
def test_each_reward_scores_its_own_copy_of_the_completions(first):
    completions, columns = ["no tags at all", "2"], {"solution": ["7", "2"]}
    alone, _ = compute_rewards(["format", "math_accuracy"], None, completions, columns)
    after, _ = compute_rewards([first, "format", "math_accuracy"], None, completions, columns)
    assert after[1:].tolist() == alone.tolist()
    assert completions == ["no tags at all", "2"] and columns["solution"] == ["7", "2"]


# ---- templates ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("convention", ["rel_1000", "xyxy", "REL1000", None, 1000])
def test_a_template_plugins_box_convention_is_checked_at_load(convention, tmp_path):
    path = tmp_path / f"boxes_{abs(hash(str(convention)))}.py"
    path.write_text(
        "from mmgrpo.templates import register_template\n"
        "from mmgrpo.templates.qwen2_vl import Qwen2VLTemplate\n\n"
        f"@register_template('boxes-{abs(hash(str(convention)))}')\n"
        "class Boxes(Qwen2VLTemplate):\n"
        f"    box_convention = {convention!r}\n"
    )
    with pytest.raises(ConfigError, match=rf"template plugin '.*{path.name}': template .* declares box_convention {convention!r}"
                       .replace("(", r"\(").replace(")", r"\)")):
        load_template_plugin(str(path))


# ---- fusion modules -----------------------------------------------------------------------------------

BAD_MODULES = {
    "drops_tokens": ("hidden[:, :1]", "returned \\[.*\\] for hidden states of shape"),
    "returns_a_tuple": ("(hidden, memory)", "returned tuple for hidden states"),
    "makes_nan": ("hidden / torch.zeros_like(hidden) * 0", "returned NaN or infinite values"),
    "makes_inf": ("hidden + float('inf') * torch.tanh(self.gate + 1)", "returned NaN or infinite values"),
}


@pytest.fixture(scope="module")
def qwen2_vl(tiny_qwen2_vl_path):
    from mmgrpo.models.loading import load_template

    return tiny_qwen2_vl_path, load_template(tiny_qwen2_vl_path, "qwen2-vl")[2]


@pytest.mark.parametrize("name", sorted(BAD_MODULES))
def test_a_fusion_module_with_a_bad_output_is_one_line_naming_it(name, qwen2_vl, tmp_path):
    from mmgrpo.data.sample import LoadedSample
    from mmgrpo.forward.policy import Policy
    from mmgrpo.fusion import FusionSpec, attach_fusion
    from mmgrpo.models.loading import load_model

    path, template = qwen2_vl
    expression, message = BAD_MODULES[name]
    plugin = tmp_path / f"bad_{name}.py"
    plugin.write_text(
        "import torch\nfrom mmgrpo.fusion import FusionModule, register_fusion\n\n"
        f"@register_fusion('bad_{name}')\n"
        "class Bad(FusionModule):\n"
        "    def __init__(self, hidden_size, num_heads, layer):\n"
        "        super().__init__()\n        self.gate = torch.nn.Parameter(torch.zeros(1))\n"
        f"    def forward(self, hidden, memory, memory_mask):\n        return {expression}\n"
    )
    model = load_model(path, template=template)
    attach_fusion(model, template, FusionSpec(f"bad_{name}", [1], plugins=[str(plugin)]))
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (56, 56, 3), dtype=np.uint8))
    encoded = [template.encode_prompt(LoadedSample(id="i", messages=[{"role": "user", "content": "<image>Colour?"}], images=[image]))]
    ids, mask = torch.randint(10, 500, (2, 4)), torch.ones(2, 4, dtype=torch.long)
    policy = Policy(model, template)
    with pytest.raises(ConfigError, match=f"^fusion module 'bad_{name}' after decoder layer 1 {message}"):
        policy.completion_logprobs(policy.forward_batch(encoded, [2]), ids, mask)
