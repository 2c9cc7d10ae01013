"""Templates: golden ids, parity with the HF processor, batching, log-prob parity, boxes, errors."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.models import load_processor
from mmgrpo.templates import Template, get_template, register_template, template_names
from mmgrpo.templates.qwen2_vl import video_metadata

FAMILIES = ["qwen2-vl", "qwen2.5-vl"]


@pytest.fixture(scope="module")
def processors(tiny_qwen2_vl_path, tiny_qwen2_5_vl_path):
    paths = {"qwen2-vl": tiny_qwen2_vl_path, "qwen2.5-vl": tiny_qwen2_5_vl_path}
    return {family: load_processor(path) for family, path in paths.items()}


@pytest.fixture(scope="module")
def models(tiny_qwen2_vl_path, tiny_qwen2_5_vl_path):
    paths = {"qwen2-vl": tiny_qwen2_vl_path, "qwen2.5-vl": tiny_qwen2_5_vl_path}
    return {
        family: AutoModelForImageTextToText.from_pretrained(path).eval() for family, path in paths.items()
    }


def _image(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def _video(num_frames=4, width=84, height=56, fps=2.0):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {
        "fps": fps,
        "total_num_frames": 2 * num_frames,
        "frames_indices": list(range(0, 2 * num_frames, 2)),
        "duration": 2 * num_frames / fps,
        "width": width,
        "height": height,
    }
    return Video(frames=frames, metadata=metadata)


# ---------------------------------------------------------------------------------------------
# Golden ids: the tiny tokenizer is trained deterministically, so these change only with its corpus
# (mmgrpo/models/tiny_tokenizer.py).
# ---------------------------------------------------------------------------------------------

GOLDEN_IDS = [
    1501, 368, 198, 374, 281, 309, 266, 29, 278, 266, 29, 13, 1502, 198,  # system turn
    1501, 354, 198, 1509, 1512, 1512, 1512, 1512, 1512, 1512, 1510,  # user, 84x56 image -> 6 pads
    342, 336, 397, 460, 30, 220, 38, 72, 440, 268, 315, 13, 1502, 198,  # "How many ... box."
    1501, 367, 198,  # generation prompt
]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_ids(family, processors):
    template = get_template(family, processors[family])
    sample = LoadedSample(
        id="golden/0",
        messages=[
            {"role": "system", "content": "Answer in <answer></answer>."},
            {"role": "user", "content": "<image>How many red circles? Give the box."},
        ],
        images=[Image.new("RGB", (84, 56), (255, 0, 0))],
    )
    prompt = template.encode_prompt(sample)
    assert prompt.prompt_ids.tolist() == GOLDEN_IDS
    assert prompt.image_sizes == [(84, 56)] and prompt.input_sizes == [(84, 56)]
    assert prompt.mm["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert prompt.mm["mm_token_type_ids"].tolist() == [int(i == 1512) for i in GOLDEN_IDS]


# ---------------------------------------------------------------------------------------------
# Parity with the HF processor (training side) and through prompt_text (rollout side)
# ---------------------------------------------------------------------------------------------

CASES = {
    "one_image": ("<image>What colour is the shape?", [(84, 56)], 0),
    "two_images": ("Compare <image> with <image>: which is bigger?", [(90, 60), (50, 120)], 0),
    "video": ("<video>What moves?", [], 1),
    "text_only": ("What is seven plus five?", [], 0),
}


def _typed(content: str) -> list[dict]:
    return Template.content_parts(content)


def _hf_inputs(processor, text, images, videos):
    kwargs = {}
    if videos:
        kwargs = {
            "videos": [v.frames for v in videos],
            "video_metadata": [video_metadata(v) for v in videos],
            "do_sample_frames": False,
        }
    return processor(text=[text], images=images or None, return_tensors="pt", **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_hf_processor(family, case, processors):
    processor = processors[family]
    template = get_template(family, processor)
    content, image_sizes, num_videos = CASES[case]
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(image_sizes)]
    videos = [_video() for _ in range(num_videos)]
    sample = LoadedSample(
        id=f"parity/{case}", messages=[{"role": "user", "content": content}], images=images, videos=videos
    )
    prompt = template.encode_prompt(sample)

    # training side vs processor.apply_chat_template (typed parts) + processor(...)
    messages = [{"role": "user", "content": _typed(content)}]
    hf_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text
    expected = _hf_inputs(processor, hf_text, images, videos)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist()
    assert torch.equal(prompt.mm["mm_token_type_ids"], expected["mm_token_type_ids"][0])
    expected_keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == expected_keys
    for key in expected_keys - {"mm_token_type_ids"}:
        assert torch.equal(prompt.mm[key], torch.as_tensor(expected[key])), key

    # rollout side: the unexpanded prompt_text and raw media through the HF processor
    rollout = _hf_inputs(processor, prompt.prompt_text, prompt.images, prompt.videos)
    assert rollout["input_ids"][0].tolist() == prompt.prompt_ids.tolist()
    assert prompt.prompt_text.count("<|image_pad|>") == len(images)


def test_pixel_limits_match_hf_processor(processors):
    processor = processors["qwen2-vl"]
    template = get_template("qwen2-vl", processor, min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    image = _image(300, 200)
    prompt = template.encode_prompt(
        LoadedSample(id="px/0", messages=[{"role": "user", "content": "<image>Hi"}], images=[image])
    )
    expected = processor(
        text=[prompt.prompt_text],
        images=[image],
        return_tensors="pt",
        images_kwargs={"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 4}},
    )
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist()
    assert torch.equal(prompt.mm["pixel_values"], expected["pixel_values"])
    width, height = prompt.input_sizes[0]
    assert width * height <= 28 * 28 * 4 and width % 28 == 0 and height % 28 == 0


# ---------------------------------------------------------------------------------------------
# Batching and the training forward
# ---------------------------------------------------------------------------------------------


def _sequence_logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logprobs_match_generate(family, processors, models):
    """A left-padded batch of 2 prompts with different image sizes: forward == generate scores."""
    template, model = get_template(family, processors[family]), models[family]
    samples = [
        LoadedSample(
            id="lp/0", messages=[{"role": "user", "content": "<image>Describe it."}], images=[_image(84, 56)]
        ),
        LoadedSample(
            id="lp/1",
            messages=[{"role": "user", "content": "Which is red, <image> or <image>? Think."}],
            images=[_image(140, 112, seed=1), _image(56, 56, seed=2)],
        ),
    ]
    batch = template.collate([template.encode_prompt(s) for s in samples])
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding
    torch.manual_seed(0)
    out = model.generate(
        **batch,
        max_new_tokens=6,
        do_sample=True,
        suppress_tokens=template.suppress_token_ids,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_len = batch["input_ids"].shape[1]
    completion_ids = out.sequences[:, prompt_len:]  # [2, T]
    assert not torch.isin(completion_ids, torch.tensor(template.suppress_token_ids)).any()
    expected = _sequence_logps(torch.stack(out.logits, dim=1), completion_ids)  # [2, T]
    completion_mask = torch.ones_like(completion_ids)
    inputs = template.forward_inputs(batch, completion_ids, completion_mask, model=model)
    with torch.no_grad():
        logits = model(**inputs).logits[:, prompt_len - 1 : -1]
    torch.testing.assert_close(_sequence_logps(logits, completion_ids), expected, atol=1e-5, rtol=0)

    # a group of G=3 completions per prompt: rows and media repeated, copies contiguous
    group_ids = completion_ids.repeat_interleave(3, dim=0)  # [6, T]
    grouped = template.forward_inputs(batch, group_ids, torch.ones_like(group_ids), model=model)
    assert grouped["image_grid_thw"].shape[0] == 3 * batch["image_grid_thw"].shape[0]
    with torch.no_grad():
        group_logits = model(**grouped).logits[:, prompt_len - 1 : -1]
    torch.testing.assert_close(
        _sequence_logps(group_logits, group_ids), expected.repeat_interleave(3, dim=0), atol=1e-5, rtol=0
    )


def test_text_only_padded_batch(processors, models):
    template, model = get_template("qwen2-vl", processors["qwen2-vl"]), models["qwen2-vl"]
    samples = [
        LoadedSample(id=f"t/{i}", messages=[{"role": "user", "content": text}])
        for i, text in enumerate(["Hi.", "What is seven plus five? Think step by step."])
    ]
    batch = template.collate([template.encode_prompt(s) for s in samples])
    out = model.generate(
        **batch, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    prompt_len = batch["input_ids"].shape[1]
    completion_ids = out.sequences[:, prompt_len:]
    assert batch["attention_mask"][0, 0] == 0
    expected = _sequence_logps(torch.stack(out.logits, 1), completion_ids)
    for with_positions in (model, None):
        inputs = template.forward_inputs(
            batch, completion_ids, torch.ones_like(completion_ids), model=with_positions
        )
        with torch.no_grad():
            logits = model(**inputs).logits[:, prompt_len - 1 : -1]
        torch.testing.assert_close(_sequence_logps(logits, completion_ids), expected, atol=1e-5, rtol=0)


def test_collate_mixed_batch(processors):
    template = get_template("qwen2-vl", processors["qwen2-vl"])
    prompts = [
        template.encode_prompt(LoadedSample(id="m/0", messages=[{"role": "user", "content": "Hi"}])),
        template.encode_prompt(
            LoadedSample(id="m/1", messages=[{"role": "user", "content": "<video>?"}], videos=[_video()])
        ),
        template.encode_prompt(
            LoadedSample(
                id="m/2", messages=[{"role": "user", "content": "<image>?"}], images=[_image(56, 56)]
            )
        ),
    ]
    batch = template.collate(prompts)
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
    }
    rows = template.media_per_row(batch)
    assert rows[0] == {} and set(rows[1]) == {"pixel_values_videos", "video_grid_thw"}
    assert torch.equal(rows[2]["pixel_values"], prompts[2].mm["pixel_values"])
    completion = torch.tensor([[5, 6], [7, 8], [9, 10]])
    inputs = template.forward_inputs(batch, completion, torch.tensor([[1, 1], [1, 0], [1, 1]]))
    assert (
        inputs["input_ids"].shape == inputs["mm_token_type_ids"].shape == (3, batch["input_ids"].shape[1] + 2)
    )
    assert inputs["mm_token_type_ids"][:, -2:].eq(0).all() and inputs["attention_mask"][1, -1] == 0


# ---------------------------------------------------------------------------------------------
# Boxes, components, registry and errors
# ---------------------------------------------------------------------------------------------


def test_box_conventions(processors):
    qwen2 = get_template("qwen2-vl", processors["qwen2-vl"])
    qwen25 = get_template("qwen2.5-vl", processors["qwen2.5-vl"])
    image_size, input_size = (1000, 500), (448, 224)
    # rel1000: 0-1000 of the original image
    assert qwen2.box_to_image([100, 200, 500, 1000], image_size, input_size) == [100.0, 100.0, 500.0, 500.0]
    assert qwen2.box_from_image([100, 100, 500, 500], image_size, input_size) == [100.0, 200.0, 500.0, 1000.0]
    # abs_input: pixels of the resized model input
    assert qwen25.box_to_image([224, 112, 448, 224], image_size, input_size) == [500.0, 250.0, 1000.0, 500.0]
    for template in (qwen2, qwen25):
        box = [12.5, 40.0, 300.0, 477.0]
        back = template.box_to_image(
            template.box_from_image(box, image_size, input_size), image_size, input_size
        )
        assert back == pytest.approx(box)
    prompt = qwen25.encode_prompt(
        LoadedSample(
            id="b/0", messages=[{"role": "user", "content": "<image>Where?"}], images=[_image(168, 112)]
        )
    )
    to_image_box = qwen25.box_mapper(prompt)
    assert prompt.input_sizes == [(168, 112)] and to_image_box([0, 0, 84, 56]) == [0.0, 0.0, 84.0, 56.0]


@pytest.mark.parametrize("family", FAMILIES)
def test_components_and_suppressed_tokens(family, processors, models):
    template, model = get_template(family, processors[family]), models[family]
    for path in template.components.values():
        model.get_submodule(path)
    assert type(model.get_submodule(template.components["aligner"])).__name__.endswith("PatchMerger")
    tokenizer = processors[family].tokenizer
    suppressed = tokenizer.convert_ids_to_tokens(template.suppress_token_ids)
    assert {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"} <= set(suppressed)
    assert "<|im_end|>" not in suppressed
    assert tokenizer.convert_ids_to_tokens(template.stop_token_ids) == ["<|endoftext|>", "<|im_end|>"]


def test_get_template_names(processors):
    assert {"qwen2-vl", "qwen2.5-vl"} <= set(template_names())
    for name in ["qwen2_vl", "Qwen2-VL"]:
        assert get_template(name, processors["qwen2-vl"]).name == "qwen2-vl"
    for name in ["qwen2_5_vl", "qwen2.5-vl"]:
        assert get_template(name, processors["qwen2.5-vl"]).box_convention == "abs_input"
    with pytest.raises(ConfigError, match="unknown model_type .*choose one of: .*qwen2-vl"):
        get_template("llama-vision", processors["qwen2-vl"])
    with pytest.raises(ConfigError, match="unknown option"):
        get_template("qwen2-vl", processors["qwen2-vl"], max_pixel=1)
    with pytest.raises(ConfigError, match="already registered"):
        register_template("qwen2_vl")(type("Again", (Template,), {}))


def test_media_errors_name_the_sample(processors):
    template = get_template("qwen2-vl", processors["qwen2-vl"])
    more_tags = LoadedSample(
        id="ds/train/3", messages=[{"role": "user", "content": "<image><image>?"}], images=[_image(56, 56)]
    )
    with pytest.raises(DataError, match=r"ds/train/3.*2 <image> tag\(s\).*1 image"):
        template.encode_prompt(more_tags)
    fewer_tags = LoadedSample(
        id="ds/train/4", messages=[{"role": "user", "content": "What?"}], images=[_image(56, 56)]
    )
    with pytest.raises(DataError, match="ds/train/4"):
        template.encode_prompt(fewer_tags)
    audio = LoadedSample(
        id="ds/train/5",
        messages=[{"role": "user", "content": "<audio>Who speaks?"}],
        audios=[np.zeros(1600, dtype=np.float32)],
    )
    with pytest.raises(DataError, match="ds/train/5.*audio"):
        template.encode_prompt(audio)
