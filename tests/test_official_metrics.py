"""The official VQAv2 accuracy (every quirk, hand-worked) and COCO-style detection mAP, multi-image boxes included."""

import json

import pytest
from PIL import Image

from mmgrpo.data.sample import LoadedSample
from mmgrpo.errors import ConfigError
from mmgrpo.eval import get_metric, run_eval
from mmgrpo.eval.detection import coco_map, map_metric
from mmgrpo.eval.vqa_official import official_vqa_accuracy, process_digit_article, process_punctuation
from mmgrpo.models import load_processor
from mmgrpo.rewards import get_reward
from mmgrpo.rewards.detections import Detection, parse_detections
from mmgrpo.templates import get_template

# ---- VQAv2 -----------------------------------------------------------------------------------


def test_leave_one_out_average_of_min_one_matches_over_three():
    others = ["cat"] * 10
    for matches, expected in [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)]:
        answers = ["dog"] * matches + others[matches:]
        # leaving out one of the m matches leaves m - 1; leaving out another leaves m
        assert official_vqa_accuracy("dog", answers) == pytest.approx(expected), matches


def test_the_prediction_is_always_processed_the_humans_only_when_they_disagree():
    # the prediction: punctuation, lower case, number words, articles, contractions, every time
    assert official_vqa_accuracy("2.", ["2"] * 10) == 1.0
    assert official_vqa_accuracy("Two", ["2"] * 10) == 1.0
    assert official_vqa_accuracy("The cat", ["cat"] * 10) == 1.0
    assert official_vqa_accuracy("YES", ["yes"] * 10) == 1.0
    assert official_vqa_accuracy("  yes\n", ["yes"] * 10) == 1.0  # newlines, tabs and ends cleaned
    # ten identical human answers are compared as written: case, number words and punctuation kept
    assert official_vqa_accuracy("two", ["two"] * 10) == 0.0
    assert official_vqa_accuracy("yes", ["Yes"] * 10) == 0.0
    assert official_vqa_accuracy("3", ["3."] * 10) == 0.0
    # once they disagree, the human answers get punctuation processing and nothing else
    assert official_vqa_accuracy("3", ["3."] * 9 + ["three"]) == 1.0  # "3." -> "3"; "three" stays
    assert official_vqa_accuracy("three", ["three"] * 9 + ["3"]) == pytest.approx(0.3)  # only "3" matches "3"
    assert official_vqa_accuracy("yes", ["Yes"] * 9 + ["yes"]) == pytest.approx(0.3)  # no lower case for them
    assert official_vqa_accuracy("dog", ["a dog"] * 5 + ["dog"] * 5) == pytest.approx(1.0)  # articles stay theirs


def test_punctuation_rules():
    assert process_punctuation("black-and-white") == "black and white"  # touches no space: spaced
    assert process_punctuation("black - white") == "black  white"  # touches a space: deleted
    assert process_punctuation("a-b (c)") == "a b c "  # each mark on its own: "(" follows a space (deleted), "-" and ")" touch none
    assert process_punctuation("a-b 1,000") == "ab 1000"  # a digit,digit comma: every mark deleted
    assert process_punctuation("10:30 o'clock") == "10:30 o'clock"  # colon and apostrophe are not marks
    assert process_punctuation("3.") == "3" and process_punctuation("2.5") == "2.5" and process_punctuation(".5") == ".5"
    assert process_punctuation("a.m.") == "am"  # the period rule never looks behind
    assert process_punctuation("." * 33 + "x") == ".x"  # re.UNICODE passed as count: 32 periods at most


def test_word_rules():
    assert process_digit_article("The Two dogs") == "2 dogs"
    assert process_digit_article("none") == "0" and process_digit_article("an a the") == ""
    assert process_digit_article("dont") == "don't" and process_digit_article("whats up") == "what's up"
    assert process_digit_article("Im") == "im"  # the table's "Im" key never matches after lower-casing
    assert process_digit_article("somebody'd") == "somebodyd"  # the table maps this one backwards
    assert process_digit_article("eleven") == "eleven"  # only zero..ten


def test_the_official_metric_has_its_own_name_and_vqa_accuracy_is_the_reward_everywhere():
    completions = [["<answer>Yes.</answer>"], ["<think>hm</think>two"]]
    solution = [["Yes"] * 10, [{"answer": "two"}] * 9 + [{"answer": "2"}]]
    # official: "yes" against ten unprocessed "Yes"; "2" against one "2" of ten
    assert get_metric("vqav2_accuracy").fn(completions, solution=solution).scores == {"vqav2_accuracy": [0.0, 0.3]}
    # `vqa_accuracy` scores as the reward of that name does, in training and in evaluation
    lenient = get_metric("vqa_accuracy").fn(completions, solution=solution).scores
    assert lenient == {"vqa_accuracy": [1.0, 1.0]}
    answers = [["Yes"] * 10, ["two"] * 9 + ["2"]]
    assert get_reward("vqa_accuracy")([c[0] for c in completions], solution=answers) == [1.0, 1.0]
    # one reference string counts as ten humans who gave it
    scores = get_metric("vqav2_accuracy").fn([["red"], ["Red."], ["blue"]], solution=["red"] * 3).scores
    assert scores["vqav2_accuracy"] == [1.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="vqa_accuracy_lenient"):  # the old name of the lenient metric
        get_metric("vqa_accuracy_lenient")


# ---- detection mAP ---------------------------------------------------------------------------


def _d(box, label="object", image=0, score=1.0):
    return Detection([float(v) for v in box], label, image, score)


def test_coco_map_by_hand():
    gold = [[_d([0, 0, 10, 10])]]
    assert coco_map([[_d([0, 0, 10, 10])]], gold) == (1.0, 1.0)
    # IoU 0.62 passes the thresholds 0.50, 0.55, 0.60 of ten
    assert coco_map([[_d([0, 0, 10, 6.2])]], gold) == pytest.approx((0.3, 1.0))
    assert coco_map([[]], gold) == (0.0, 0.0) and coco_map([[_d([0, 0, 1, 1])]], [[]]) == (None, None)
    # a wrong label is a miss; a second, right box ranked after it still finds the cat
    two = [[_d([0, 0, 10, 10], "dog", score=0.9), _d([0, 0, 10, 10], "cat", score=0.8)]]
    assert coco_map(two, [[_d([0, 0, 10, 10], "cat")]]) == (1.0, 1.0)  # AP is per class, then averaged over classes with references
    # two references, one found by the top-scored box, a false positive first: precision 1/2 at recall 1/2
    ranked = [[_d([50, 50, 60, 60], score=0.9), _d([0, 0, 10, 10], score=0.8)]]
    _, ap50 = coco_map(ranked, [[_d([0, 0, 10, 10]), _d([20, 20, 30, 30])]])
    assert ap50 == pytest.approx(0.5 * 51 / 101)  # 101 recall points, 0..0.5 at precision 0.5


def test_answers_with_several_boxes_parse_as_json_or_lists():
    text = '```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "cat", "score": 0.3}, {"bbox": [5, 6, 7, 8], "image_index": 1}]\n```'
    assert parse_detections(text) == [_d([1, 2, 3, 4], "cat", 0, 0.3), _d([5, 6, 7, 8], "object", 1)]
    assert parse_detections("[1, 2, 3, 4], [5, 6, 7, 8]") == [_d([1, 2, 3, 4]), _d([5, 6, 7, 8])]
    assert parse_detections("no boxes") == []


@pytest.fixture(scope="module")
def qwen2_vl(tiny_qwen2_vl_path):
    return get_template("qwen2-vl", load_processor(str(tiny_qwen2_vl_path)))


def test_a_box_on_the_second_image_is_mapped_with_that_images_size(qwen2_vl, tmp_path):
    """Qwen2-VL writes 0-1000 coordinates: the same numbers are different pixels on images of different sizes."""
    sample = LoadedSample(id="two/0", messages=[{"role": "user", "content": "<image><image>Find the dots."}],
                          images=[Image.new("RGB", (200, 100)), Image.new("RGB", (100, 400))], columns={})
    prompt = qwen2_vl.encode_prompt(sample)
    gold = [{"bbox_2d": [20, 10, 40, 20], "image_index": 0}, {"bbox_2d": [10, 40, 20, 80], "image_index": 1}]
    # image 0 is 200 x 100: [100, 100, 200, 200] -> [20, 10, 40, 20]; image 1 is 100 x 400: -> [10, 40, 20, 80]
    answer = '<answer>[{"bbox_2d": [100, 100, 200, 200], "image_index": 0}, {"bbox_2d": [100, 100, 200, 200], "image_index": 1}]</answer>'
    values = map_metric([[answer]], solution=[gold], to_image_box=[qwen2_vl.box_mapper(prompt)])
    assert values.corpus == {"map": 1.0, "map50": 1.0}
    # without the image index both boxes would map with image 0's size: only one is found
    unindexed = '<answer>[{"bbox_2d": [100, 100, 200, 200]}, {"bbox_2d": [100, 100, 200, 200]}]</answer>'
    assert map_metric([[unindexed]], solution=[gold], to_image_box=[qwen2_vl.box_mapper(prompt)]).corpus["map"] < 0.6


def test_an_eval_run_keeps_mapped_boxes_for_the_corpus_map(qwen2_vl, tmp_path):
    """run_eval stores the boxes mapped with the template (the callables cannot be stored) and scores
    mAP over the whole set at the end."""
    images = [Image.new("RGB", (200, 100)), Image.new("RGB", (100, 400))]
    samples = [LoadedSample(id=f"d/{i}", messages=[{"role": "user", "content": "<image>Find it."}], images=[images[i]],
                            columns={"solution": [[20, 10, 40, 20], [10, 40, 20, 80]][i]}) for i in range(2)]

    def generate(batch, num_samples):
        prompts = [qwen2_vl.encode_prompt(s) for s in batch]
        return [["[100, 100, 200, 200]"] * num_samples for _ in batch], {"to_image_box": [qwen2_vl.box_mapper(p) for p in prompts]}

    result = run_eval(samples, generate, tmp_path / "eval", model="tiny", dataset="d", split="test", metrics=["map"])
    assert result["metrics"]["map"] == 1.0 and result["metrics"]["sample_map50"] == 1.0
    record = json.loads((tmp_path / "eval" / "samples.jsonl").read_text().splitlines()[1])
    assert record["kept"]["detections"][0][0]["box"] == [10.0, 40.0, 20.0, 80.0]


def test_the_iou_reward_maps_a_box_with_the_size_of_the_image_it_names(qwen2_vl):
    from mmgrpo.rewards import iou_reward

    sample = LoadedSample(id="two/1", messages=[{"role": "user", "content": "<image><image>Where is the dot?"}],
                          images=[Image.new("RGB", (200, 100)), Image.new("RGB", (100, 400))], columns={})
    mapper = qwen2_vl.box_mapper(qwen2_vl.encode_prompt(sample))
    on_second = '<answer>{"bbox_2d": [100, 100, 200, 200], "image_index": 1}</answer>'
    on_first = "<answer>[100, 100, 200, 200]</answer>"
    on_missing = '<answer>{"bbox_2d": [100, 100, 200, 200], "image_index": 5}</answer>'
    gold = [10, 40, 20, 80]  # image 1 is 100 x 400: 0-1000 coordinates [100, 100, 200, 200] -> [10, 40, 20, 80]
    scores = iou_reward([on_second, on_first, on_missing], solution=[gold] * 3, to_image_box=[mapper] * 3)
    assert scores[0] == pytest.approx(1.0) and scores[1] < 0.2 and scores[2] == 0.0
