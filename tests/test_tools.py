"""Tools of multi-turn rollouts: the call parser, the environment's error turns, the zoom tool,
tool plugins, the tool turn a family renders, and the flags' start-up checks."""

import time

import numpy as np
import PIL.Image
import pytest

from mmgrpo.config import TrainConfig
from mmgrpo.errors import ConfigError
from mmgrpo.models import load_processor
from mmgrpo.templates import get_template
from mmgrpo.tools import ToolContext, ToolEnvironment, get_tool, parse_tool_calls, tool_names, zoom
from mmgrpo.tools.environment import ERROR_KINDS
from mmgrpo.training.startup_checks import check_train_flags

ZOOM = "image_zoom_in_tool"


def call(name, arguments):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def template(tiny_qwen2_vl_path):
    return get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path), max_pixels=112 * 112)


def context(template, image):
    return ToolContext(sample_id="s/0", images=[image], image_sizes=[image.size], input_sizes=[(112, 112)],
                       template=template)  # fmt: skip


# ---- the parser --------------------------------------------------------------------------------


def test_parser_reads_every_call_and_says_what_is_wrong_with_bad_ones():
    text = ("I will look. " + call("a", {"x": 1}) + " then " + '<tool_call>{"name": "b"}</tool_call>'
            + '<tool_call>{"name": "c", "arguments": [1]}</tool_call><tool_call>["no"]</tool_call>'
            + '<tool_call>{"name": "d", "arguments": {"x": </tool_call><tool_call>{"name": "e"')  # fmt: skip
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("a", {"x": 1}), ("b", {})]
    assert calls[0].error is None and calls[1].error is None
    assert "must be an object" in calls[2].error
    assert "is an object" in calls[3].error
    assert "not valid JSON" in calls[4].error
    assert "no closing" in calls[5].error
    assert parse_tool_calls("<answer>red</answer>") == []


def test_arguments_as_a_json_string_are_read():
    calls = parse_tool_calls('<tool_call>{"name": "z", "arguments": "{\\"bbox_2d\\": [1, 2, 3, 4]}"}</tool_call>')
    assert calls[0].arguments == {"bbox_2d": [1, 2, 3, 4]} and calls[0].error is None


# ---- the environment's error turns -------------------------------------------------------------


def slow(arguments, context):
    time.sleep(2)
    return "late"


def boom(arguments, context):
    raise RuntimeError("disk on fire")


def wrong_type(arguments, context):
    return 42


def echo(arguments, context):
    return ["you said", str(arguments.get("text")), PIL.Image.new("RGB", (8, 8), "red")]


def test_every_failure_is_an_error_message_of_its_kind_never_a_crash(template):
    env = ToolEnvironment([slow, boom, wrong_type, echo], timeout=0.2)
    ctx = context(template, PIL.Image.new("RGB", (64, 64)))
    turn = ("<tool_call>{oops</tool_call>" + call("nope", {}) + call("boom", {}) + call("slow", {})
            + call("wrong_type", {}) + call("echo", {"text": "hi"}))  # fmt: skip
    started = time.perf_counter()
    results = env.answer(turn, ctx)
    assert time.perf_counter() - started < 1.5  # the slow tool was not waited for
    assert [r.error for r in results] == ["parse", "unknown", "raised", "timeout", "result", None]
    texts = [r.parts[0]["text"] for r in results]
    assert texts[0].startswith("Error:") and "<tool_call>" in texts[0]  # says how to write a call
    assert "unknown tool 'nope'" in texts[1] and "slow, boom, wrong_type, echo" in texts[1]
    assert "RuntimeError: disk on fire" in texts[2]
    assert "timed out after 0.2 s" in texts[3]
    assert "int" in texts[4]
    assert results[5].parts == [{"type": "text", "text": "you said"}, {"type": "text", "text": "hi"}, {"type": "image"}]
    assert len(results[5].images) == 1 and set(ERROR_KINDS) == {"parse", "unknown", "raised", "timeout", "result"}


def test_a_turn_without_calls_is_an_answer(template):
    env = ToolEnvironment([echo])
    assert env.answer("<answer>red</answer>", context(template, PIL.Image.new("RGB", (8, 8)))) == []


# ---- the zoom tool -----------------------------------------------------------------------------


def test_zoom_crops_the_box_in_the_models_convention_enlarged_to_the_budget(template):
    image = PIL.Image.new("RGB", (400, 200), "white")
    image.paste((255, 0, 0), (300, 100, 400, 200))  # red bottom-right quarter
    tool = get_tool(ZOOM)
    # Qwen2-VL boxes are 0-1000 of the image: [750, 500, 1000, 1000] is the red quarter
    crop = tool({"bbox_2d": [750, 500, 1000, 1000]}, context(template, image))
    assert crop.size == (112, 112)  # 100 x 100 enlarged to the 112 x 112 budget
    assert np.asarray(crop).reshape(-1, 3).mean(0).round().tolist() == [255, 0, 0]
    with pytest.raises(ValueError, match="bbox_2d"):
        tool({"bbox_2d": [1, 2]}, context(template, image))
    with pytest.raises(ValueError, match="img_idx"):
        tool({"bbox_2d": [0, 0, 10, 10], "img_idx": 3}, context(template, image))


def test_zoom_widens_a_tiny_box_and_refuses_one_outside_the_image():
    image = PIL.Image.new("RGB", (100, 100))
    assert zoom(image, [50, 50, 51, 51]).size == (28, 28)
    assert zoom(image, [95, 95, 99, 99]).size == (28, 28)  # shifted to stay inside
    with pytest.raises(ValueError, match="outside the image"):
        zoom(image, [200, 200, 300, 300])


# ---- plugins and flags -------------------------------------------------------------------------


def test_a_tool_plugin_loads_from_its_file_and_bad_specs_name_the_choices(tmp_path):
    plugin = tmp_path / "my_tools.py"
    plugin.write_text("def lookup(arguments, context):\n    return 'found ' + arguments['q']\n")
    func = get_tool(f"{plugin}:lookup")
    assert func({"q": "x"}, None) == "found x"
    assert ZOOM in tool_names()
    with pytest.raises(ConfigError, match=f"unknown tool .*choose one of: .*{ZOOM}"):
        get_tool("zoom_typo")
    with pytest.raises(ConfigError, match="defines no function 'nope'. Functions it defines: lookup"):
        get_tool(f"{plugin}:nope")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_turns", "3"], "--max_turns 3 needs --tools"),
        (["--tools", ZOOM], "--tools needs --max_turns 2 or more"),
        (["--max_turns", "0"], "--max_turns 0"),
        (["--max_turns", "2", "--tools", ZOOM, "--tool_timeout", "0"], "--tool_timeout 0"),
        (["--max_turns", "2", "--tools", "zoom_typo"], "unknown tool 'zoom_typo'"),
    ],
)
def test_tool_flags_are_checked_at_start_up(flags, message):
    cfg = TrainConfig.from_args(["--model", "tiny:qwen2-vl", "--dataset", "shapes-zoom", *flags])
    with pytest.raises(ConfigError, match=message):
        check_train_flags(cfg)


# ---- the family's tool turn --------------------------------------------------------------------


def test_a_tool_turn_renders_as_the_chat_template_renders_tool_messages(template):
    turn = template.render_tool_turn([[{"type": "text", "text": "ok"}], [{"type": "image"}]])
    assert turn == ("\n<|im_start|>user\n<tool_response>\nok\n</tool_response>\n<tool_response>\n"
                    "<|vision_start|><|image_pad|><|vision_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    # a conversation rendered whole has the same text as one built turn by turn
    messages = [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "CALL"},
                {"role": "tool", "content": "ok"}, {"role": "tool", "content": "<image>"}]  # fmt: skip
    whole = template.render(messages, add_generation_prompt=True)
    first = template.render(messages[:1], add_generation_prompt=True)
    assert whole == first + "CALL" + "<|im_end|>" + turn
