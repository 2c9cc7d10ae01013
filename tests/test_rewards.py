"""Rewards: reference cases with hand-computed values (VQAv2, format, IoU, math), the registry,
plugins, and `compute_rewards` (weights, None, errors)."""

import logging
import math
import threading

import pytest

from mmgrpo import registry as plugins
from mmgrpo.errors import ConfigError, RewardError
from mmgrpo.rewards import (
    box_iou,
    compute_rewards,
    exact_match,
    format_reward,
    get_reward,
    iou_reward,
    make_format_reward,
    math_accuracy,
    normalize_vqa_answer,
    parse_box,
    register_reward,
    reward_funcs,
    reward_names,
    vqa_accuracy,
    vqa_soft_accuracy,
)
from mmgrpo.rewards.format import answer_format_reward
from mmgrpo.rewards.iou import iou_at_50_reward


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    # Tests register throwaway rewards and check warn-once: give each a private registry state.
    reward_funcs.REWARDS.names()  # the built-ins loaded before the copy
    monkeypatch.setattr(reward_funcs.REWARDS, "_entries", dict(reward_funcs.REWARDS._entries))
    monkeypatch.setattr(reward_funcs, "_WARNED", set())
    monkeypatch.setattr(plugins, "_LOADED", {})


# ---------------------------------------------------------------- VQAv2 normalisation


@pytest.mark.parametrize(
    "raw, expected",
    [
        # contractions restored from the official table
        ("dont", "don't"),
        ("Whats that", "what's that"),
        ("isnt it", "isn't it"),
        ("oclock", "o'clock"),
        ("don't", "don't"),  # already fine
        # articles dropped, only as whole words
        ("The cat", "cat"),
        ("a dog", "dog"),
        ("an apple", "apple"),
        ("theater", "theater"),
        # number words zero..ten (and the official "none") to digits; others untouched
        ("Two", "2"),
        ("ten", "10"),
        ("zero", "0"),
        ("none", "0"),
        ("eleven", "eleven"),
        ("one dog", "1 dog"),
        # decimals keep their period; other periods go
        ("3.5", "3.5"),
        ("3.5.", "3.5"),
        (".5", ".5"),
        ("yes.", "yes"),
        ("e.g.", "eg"),
        # a mark touching a space is deleted everywhere, otherwise it becomes a space
        ("Yes!", "yes"),
        ("hello, world", "hello world"),
        ("t-shirt", "t shirt"),
        ("left - right-side", "left rightside"),
        # a digit,digit comma deletes all marks (thousands separators)
        ("1,000", "1000"),
        ("1,000 red-blue", "1000 redblue"),
        # kept: colons, apostrophes
        ("12:30", "12:30"),
        # whitespace: newlines and tabs are spaces
        ("red\nand\tblue ", "red and blue"),
        ("", ""),
    ],
)
def test_vqa_normalisation(raw, expected):
    assert normalize_vqa_answer(raw) == expected


def test_vqa_normalisation_is_idempotent_on_its_output():
    for raw in ["Two dogs.", "dont know", "1,000", "black-and-white", "3.5", "The answer is 3."]:
        once = normalize_vqa_answer(raw)
        assert normalize_vqa_answer(once) == once


# ---------------------------------------------------------------- VQAv2 soft accuracy


@pytest.mark.parametrize(
    "matches, expected",
    [
        # k of 10 human answers match. Leaving out one of the k matching answers leaves k - 1
        # matches among the other 9; leaving out one of the 10 - k others leaves k.
        # score = [k * min(1, (k-1)/3) + (10-k) * min(1, k/3)] / 10
        (0, 0.0),  # [0 + 10 * 0] / 10
        (1, 0.3),  # [1 * 0 + 9 * 1/3] / 10 = 3/10
        (2, 0.6),  # [2 * 1/3 + 8 * 2/3] / 10 = (2/3 + 16/3) / 10 = 6/10
        (3, 0.9),  # [3 * 2/3 + 7 * 1] / 10 = (2 + 7) / 10
        (4, 1.0),  # [4 * 1 + 6 * 1] / 10
        (10, 1.0),
    ],
)
def test_vqa_soft_accuracy_ten_answers(matches, expected):
    answers = ["2"] * matches + ["3"] * (10 - matches)
    assert vqa_soft_accuracy("2", answers) == pytest.approx(expected, abs=1e-12)


def test_vqa_soft_accuracy_normalises_both_sides():
    answers = ["Two"] * 2 + ["three"] * 8
    assert vqa_soft_accuracy("2.", answers) == pytest.approx(0.6)
    assert vqa_soft_accuracy("The three", answers) == 1.0


def test_vqa_single_answer_is_exact_match():
    assert vqa_soft_accuracy("Yes", "yes") == 1.0
    assert vqa_soft_accuracy("yes", ["yes"]) == 1.0
    assert vqa_soft_accuracy("yes sir", "yes") == 0.0  # no substring credit


def test_vqa_accuracy_reward_reads_answer_part_and_dict_answers():
    answers = [{"answer": "two", "answer_id": i} for i in range(2)] + [{"answer": "3"}] * 8
    completions = [
        "<think>I count 2</think><answer>2</answer>",  # 0.6
        "<think>2</think><answer>three</answer>",  # 1.0
        "3",  # no tags: the whole completion, 1.0
        "<think>3</think><answer></answer>",  # empty answer never scores
        "<answer> </answer>",
    ]
    scores = vqa_accuracy(completions, solution=[answers] * 5, sample_id=list("abcde"))
    assert scores == pytest.approx([0.6, 1.0, 1.0, 0.0, 0.0])


def test_vqa_empty_answer_against_empty_reference_scores_zero():
    # The known hack: an empty answer matching everything (or matching an empty reference).
    assert vqa_accuracy(["<answer></answer>"], solution=[[""] * 10]) == [0.0]
    assert vqa_accuracy(["</answer>"], solution=[""]) == [0.0]


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("<think>\nline 1\nline 2\n</think>\n\n<answer>\nb\n</answer>", 1.0),  # multiline
        ("\n  <think>a</think> <answer>b</answer>  \n", 1.0),  # surrounding whitespace stripped
        ("<think></think><answer>b</answer>", 1.0),  # empty think is allowed (thinking off)
        ("<answer>b</answer>", 0.0),  # missing think
        ("<think>a</think>", 0.0),  # missing answer
        ("<think>a</think><answer> </answer>", 0.0),  # empty answer
        ("<think>a</think><answer></answer>", 0.0),
        ("Let me see. <think>a</think><answer>b</answer>", 0.0),  # text before
        ("<think>a</think><answer>b</answer> Hope this helps", 0.0),  # text after
        ("<think>a</think> between <answer>b</answer>", 0.0),  # text between
        ("<think>a<think>b</think></think><answer>c</answer>", 0.0),  # nested think
        ("<think>a</think><answer>b<answer>c</answer></answer>", 0.0),  # nested answer
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),  # two answers
        ("<think>a <answer>x</answer></think><answer>b</answer>", 0.0),  # answer hidden in think
        ("<answer>b</answer><think>a</think>", 0.0),  # wrong order
        ("<THINK>a</THINK><ANSWER>b</ANSWER>", 0.0),  # tags are case-sensitive
    ],
)
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


def test_answer_format_and_custom_tags():
    assert answer_format_reward(
        ["<answer>b</answer>", " <answer>\nb\n</answer>\n", "b", "<answer></answer>"]
    ) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert answer_format_reward(["<think>a</think><answer>b</answer>"]) == [0.0]
    custom = make_format_reward(think="reason", answer="final")
    assert custom(["<reason>r</reason><final>f</final>", "<think>r</think><answer>f</answer>"]) == [1.0, 0.0]
    assert make_format_reward(think=None, answer="final")(["<final>f</final>"]) == [1.0]
    with pytest.raises(ValueError):
        make_format_reward(answer="")


# ---------------------------------------------------------------- IoU


def test_parse_box_forms():
    assert parse_box("[10, 20, 30, 40]") == [10.0, 20.0, 30.0, 40.0]
    assert parse_box("[10.5,20.25,30,40.0]") == [10.5, 20.25, 30.0, 40.0]  # floats count
    assert parse_box("(10, 20, 30, 40)") == [10.0, 20.0, 30.0, 40.0]
    assert parse_box('```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "dog"}]\n```') == [1.0, 2.0, 3.0, 4.0]
    assert parse_box("<|box_start|>(1,2),(3,4)<|box_end|>") == [1.0, 2.0, 3.0, 4.0]
    assert parse_box("first [1, 2, 3, 4] then [5, 6, 7, 8]") == [1.0, 2.0, 3.0, 4.0]
    assert parse_box("[[9, 9, 19, 19], [1, 2, 3, 4]]") == [9.0, 9.0, 19.0, 19.0]
    assert parse_box("[1, 2, 3]") is None
    assert parse_box("top left corner") is None
    assert parse_box("") is None


def test_box_iou_values():
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)  # overlap 5x5, union 100+100-25
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0  # disjoint
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges
    assert box_iou([10, 10, 0, 0], [0, 0, 10, 10]) == 0.0  # degenerate (corners swapped)
    assert box_iou([0, 0, 0, 10], [0, 0, 10, 10]) == 0.0  # zero width
    assert box_iou([0, 0, math.nan, 10], [0, 0, 10, 10]) == 0.0


# Original image 1000 x 500 (W x H) in both conventions below.
IMAGE_W, IMAGE_H = 1000, 500


def qwen2_vl_to_image(box):
    # Qwen2-VL / Qwen3-VL: coordinates normalised to 0-1000 on both axes.
    x1, y1, x2, y2 = box
    return [x1 / 1000 * IMAGE_W, y1 / 1000 * IMAGE_H, x2 / 1000 * IMAGE_W, y2 / 1000 * IMAGE_H]


def qwen2_5_vl_to_image(box):
    # Qwen2.5-VL: absolute pixels of the resized input, here 560 x 280 (multiples of 28).
    sx, sy = IMAGE_W / 560, IMAGE_H / 280
    x1, y1, x2, y2 = box
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]


def test_iou_with_qwen2_vl_relative_boxes():
    gold = [100, 50, 500, 250]  # original pixels
    completions = [
        "<think>dog on the left</think><answer>[100, 100, 500, 500]</answer>",  # -> [100, 50, 500, 250]: exact
        "<answer>[100, 100, 300, 500]</answer>",  # -> [100, 50, 300, 250]: half the gold area, inside it
        "<answer>[100, 100, 500, 500]</answer>",  # identity mapping below: a wrong, larger box
    ]
    mappers = [qwen2_vl_to_image, qwen2_vl_to_image, None]
    scores = iou_reward(completions, solution=[gold] * 3, to_image_box=mappers)
    # third: [100,100,500,500] vs [100,50,500,250]: overlap 400x150=60000, union 160000+80000-60000=180000
    assert scores == pytest.approx([1.0, 0.5, 60000 / 180000])


def test_iou_with_qwen2_5_vl_absolute_resized_boxes():
    gold = [100, 50, 500, 250]
    completions = [
        "<answer>[56, 28, 280, 140]</answer>",  # x * 1000/560, y * 500/280 -> [100, 50, 500, 250]
        "<answer>[56.0, 28.0, 168.0, 140.0]</answer>",  # floats -> [100, 50, 300, 250]: IoU 0.5
        '<answer>{"bbox_2d": [56, 28, 280, 140], "label": "dog"}</answer>',  # JSON
    ]
    scores = iou_reward(completions, solution=[gold] * 3, to_image_box=[qwen2_5_vl_to_image] * 3)
    assert scores == pytest.approx([1.0, 0.5, 1.0])


def test_iou_missing_first_and_empty_boxes():
    gold = [0, 0, 10, 10]
    completions = [
        "<answer>no object</answer>",  # missing box
        "<answer>[0, 0, 10, 10] or maybe [20, 20, 30, 30]</answer>",  # first box taken: 1.0
        "<answer>[20, 20, 30, 30] or maybe [0, 0, 10, 10]</answer>",  # first box taken: 0.0
        "<think>[0, 0, 10, 10]</think><answer></answer>",  # empty answer: the think box never counts
        "<answer>[10, 10, 0, 0]</answer>",  # degenerate
        "(0, 0, 10, 10)",  # no tags: whole completion, parentheses
    ]
    assert iou_reward(completions, solution=[gold] * 6) == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_iou_several_gold_boxes_takes_best_and_threshold():
    solution = [[[0, 0, 10, 10], [20, 0, 30, 10]]] * 3 + ["<answer>[0, 0, 10, 10]</answer>"]
    completions = ["[20, 0, 30, 10]", "[0, 0, 10, 5]", "[0, 0, 10, 4]", "[0, 0, 10, 10]"]
    assert iou_reward(completions, solution=solution) == pytest.approx([1.0, 0.5, 0.4, 1.0])
    assert iou_at_50_reward(completions, solution=solution) == [1.0, 1.0, 0.0, 1.0]  # 0.5 counts


def test_iou_solution_without_box_is_a_reward_error():
    with pytest.raises(RewardError, match=r"iou.*sample 0 \(id 'ds/train/7'\).*holds no"):
        compute_rewards(["iou"], None, ["[0, 0, 1, 1]"], {"solution": ["cat"], "sample_id": ["ds/train/7"]})


# ---------------------------------------------------------------- math


def test_math_fractions_and_decimals():
    completions = [
        "<answer>0.5</answer>",
        "<answer>1/2</answer>",
        "<answer>\\frac{1}{2}</answer>",
        "<answer>$\\frac12$</answer>",
        "<answer>\\boxed{0.50}</answer>",
        "<answer>0.25</answer>",  # wrong
        "<answer></answer>",  # empty
        "<answer>\\frac{</answer>",  # math_verify cannot parse it: 0.0, no exception
        "<think>0.5</think>",  # nothing after the think part
    ]
    assert math_accuracy(completions, solution=["$\\frac{1}{2}$"] * len(completions)) == [1.0] * 5 + [0.0] * 4


def test_math_gold_forms():
    assert math_accuracy(["<answer>$\\frac{3}{4}$</answer>"], solution=["0.75"]) == [1.0]
    assert math_accuracy(["<answer>1 + x^2</answer>"], solution=["$x^2+1$"]) == [1.0]
    assert math_accuracy(["The answer is \\boxed{12}."], solution=["12"]) == [1.0]  # no tags
    assert math_accuracy(["<answer>7</answer>"], solution=[["6", "7"]]) == [1.0]  # any of several


def test_math_unparseable_gold_is_skipped(caplog):
    with caplog.at_level(logging.WARNING, logger="mmgrpo.rewards"):
        assert math_accuracy(["<answer>1</answer>", "<answer>2</answer>"], solution=["$$", "$$"]) == [
            None,
            None,
        ]
    assert sum("cannot parse the solution" in r.message for r in caplog.records) == 1  # once


def test_math_works_off_the_main_thread():
    # math_verify's signal-based timeout only works in the main thread.
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(v=math_accuracy(["<answer>0.5</answer>"], solution=["1/2"]))
    )
    thread.start()
    thread.join()
    assert result["v"] == [1.0]


def test_exact_match():
    completions = ["<answer>(A)</answer>", "<answer> Paris. </answer>", "<answer></answer>", "London"]
    assert exact_match(completions, solution=["a", ["paris", "Lyon"], "", "paris"]) == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- registry and plugins


def test_builtins_are_registered():
    names = set(reward_names())
    assert {
        "format",
        "answer_format",
        "vqa_accuracy",
        "iou",
        "iou@0.5",
        "math_accuracy",
        "exact_match",
    } <= names
    assert get_reward("vqa_accuracy") is vqa_accuracy


def test_duplicate_and_unknown_names():
    @register_reward("test_unique_reward")
    def one(completions, **columns):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match="already registered"):
        register_reward("test_unique_reward")(lambda completions, **columns: [])
    with pytest.raises(ConfigError, match=r"unknown reward 'acuracy'.*vqa_accuracy.*file\.py:function"):
        get_reward("acuracy")


def test_plugin_loading(tmp_path, monkeypatch):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(
        "from mmgrpo.rewards import register_reward\n"
        "CALLS = []\n"
        "@register_reward('plugin_registered')\n"
        "def has_cat(completions, solution=None, **kwargs):\n"
        "    CALLS.append(1)\n"
        "    return [float('cat' in c) for c in completions]\n"
    )
    func = get_reward(f"{plugin}:has_cat")
    assert func(["a cat", "a dog"], solution=[None, None], extra_column=[1, 2]) == [1.0, 0.0]
    assert get_reward(f"{plugin}:has_cat") is func  # the file runs once (its registration too)
    assert get_reward("plugin_registered") is func
    monkeypatch.chdir(tmp_path)
    assert get_reward("my_reward.py:has_cat") is func  # relative to the working directory
    per_func, total = compute_rewards([f"{plugin}:has_cat"], None, ["cat"], {})
    assert total.tolist() == [1.0]


def test_plugin_errors_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        get_reward(f"{tmp_path}/missing.py:fn")
    plugin = tmp_path / "rewards_a.py"
    plugin.write_text("def good(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ConfigError, match=r"no function 'bad'.*good"):
        get_reward(f"{plugin}:bad")
    with pytest.raises(ConfigError, match="path/to/file.py:function_name"):
        get_reward(f"{plugin}:")
    with pytest.raises(ConfigError, match=r"not a \.py file"):
        get_reward(f"{tmp_path}/rewards_a.txt:good")
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(ConfigError, match="broken.py.* failed to load: SyntaxError"):
        get_reward(f"{broken}:oops")


# ---------------------------------------------------------------- compute_rewards


def const(value):
    def reward(completions, **columns):
        return [value] * len(completions)

    reward.__name__ = f"const_{value}"
    return reward


def test_compute_rewards_weights_and_none():
    def skip_second(completions, **columns):
        return [1.0, None, 0.5]

    def skip_all(completions, **columns):
        return [None] * len(completions)

    per_func, total = compute_rewards(
        [skip_second, const(2.0), skip_all], [0.5, 2.0, 10.0], ["a", "b", "c"], {}
    )
    assert per_func.shape == (3, 3)
    assert per_func[0, 1].isnan() and per_func[2].isnan().all()
    # sample 0: 0.5*1 + 2*2 = 4.5; sample 1: (None) + 4 = 4.0; sample 2: 0.5*0.5 + 4 = 4.25
    assert total.tolist() == pytest.approx([4.5, 4.0, 4.25])
    per_func, total = compute_rewards([const(1.0), const(3.0)], None, ["a"], {})  # weights default to 1
    assert total.tolist() == [4.0]


def test_compute_rewards_unscored_sample_warns_once(caplog):
    def none_for_first(completions, **columns):
        return [None] + [1.0] * (len(completions) - 1)

    with caplog.at_level(logging.WARNING, logger="mmgrpo.rewards"):
        _, total = compute_rewards([none_for_first], None, ["a", "b"], {})
        compute_rewards([none_for_first], None, ["a", "b"], {})
    assert total.tolist() == [0.0, 1.0]
    assert sum("no reward returned a value" in r.message for r in caplog.records) == 1


def test_compute_rewards_passes_columns_and_builtin_names():
    seen = {}

    def spy(completions, solution, **columns):
        seen.update(columns, solution=solution)
        return [0.0] * len(completions)

    columns = {"solution": ["x", "y"], "sample_id": ["s0", "s1"], "unknown_extra": [1, 2]}
    per_func, _ = compute_rewards(["format", spy], None, ["<think>t</think><answer>x</answer>", "y"], columns)
    assert per_func[0].tolist() == [1.0, 0.0]
    assert seen == columns
    with pytest.raises(ValueError, match="'solution' must be a list of 2"):
        compute_rewards([spy], None, ["a", "b"], {"solution": ["x"]})


def test_reward_that_raises_names_reward_sample_and_exception(caplog):
    def picky(completions, solution, **columns):
        return [1.0 / len(s) for s in solution]  # ZeroDivisionError on an empty solution

    columns = {"solution": ["ab", "", "a"], "sample_id": ["vqav2/val/0", "vqav2/val/1", "vqav2/val/2"]}
    with pytest.raises(
        RewardError, match=r"'picky' raised on sample 1 \(id 'vqav2/val/1'\): ZeroDivisionError"
    ):
        compute_rewards([picky], None, ["x", "y", "z"], columns)
    with caplog.at_level(logging.WARNING, logger="mmgrpo.rewards"):
        per_func, total = compute_rewards(
            [picky, const(1.0)], None, ["x", "y", "z"], columns, on_error="none"
        )
        compute_rewards([picky], None, ["x", "y", "z"], columns, on_error="none")
    assert per_func[0, 0].item() == 0.5 and per_func[0, 1].isnan() and per_func[0, 2].item() == 1.0
    assert total.tolist() == [1.5, 1.0, 2.0]
    assert sum("'picky' raised" in r.message for r in caplog.records) == 1  # warned once


def test_reward_missing_column_is_named():
    with pytest.raises(RewardError, match=r"vqa_accuracy.*solution.*columns given: sample_id"):
        compute_rewards(["vqa_accuracy"], None, ["a"], {"sample_id": ["s0"]})


def test_reward_returning_garbage_is_an_error():
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        compute_rewards([lambda completions, **c: [1.0]], None, ["a", "b"], {})
    with pytest.raises(RewardError, match="returned 'high'"):
        compute_rewards([lambda completions, **c: ["high"]], None, ["a"], {})
    with pytest.raises(RewardError, match="wrong length|values for 2 completions"):
        compute_rewards([lambda completions, **c: [1.0]], None, ["a", "b"], {}, on_error="none")


def test_batch_only_failure_and_config_errors():
    def needs_two(completions, **columns):
        if len(completions) < 2:
            return [0.0] * len(completions)
        raise RuntimeError("batch too big")

    with pytest.raises(RewardError, match="not on any sample alone: RuntimeError: batch too big"):
        compute_rewards([needs_two], None, ["a", "b"], {})
    with pytest.raises(ConfigError, match="2 reward weights for 1 reward functions"):
        compute_rewards(["format"], [1.0, 2.0], ["a"], {})
    with pytest.raises(ConfigError, match="on_error"):
        compute_rewards(["format"], None, ["a"], {}, on_error="ignore")


def test_pathological_completions_stay_linear():
    # A lazy `<answer>(.*?)</answer>` search took 84 s on 30,000 unclosed tags (quadratic).
    import time

    completions = [
        "<answer>" * 30000,
        "<think>" + "<" * 100000,
        "[1, " * 30000,
        "<think>x</think>" + " " * 100000,
    ]
    start = time.perf_counter()
    for name in ["format", "answer_format", "vqa_accuracy", "exact_match", "iou"]:
        solution = [[0, 0, 1, 1]] * 4 if name == "iou" else ["a"] * 4
        compute_rewards([name], None, completions, {"solution": solution})
    assert time.perf_counter() - start < 5.0
