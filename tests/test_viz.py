"""`mmgrpo viz attention`: token -> grid mapping, placement of the heatmap on the image, the
attention rows read from a real forward, and the command end to end on the tiny models."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from mmgrpo.data.sample import LoadedSample
from mmgrpo.viz.attention import answer_attention, attention_to_image_grid, media_panels, overlay, upsample


def test_grid_shape_and_token_order():
    grid_thw, merge = (2, 6, 8), 2
    values = np.arange(2 * 3 * 4, dtype=np.float32)  # token k carries the value k
    grid = attention_to_image_grid(torch.tensor(values), grid_thw, merge)
    assert grid.shape == (2, 3, 4)
    # merged tokens are row-major within each temporal slot
    assert grid[1, 2, 3] == 1 * 12 + 2 * 4 + 3
    assert grid[0, 1, 0] == 4
    with pytest.raises(ValueError, match="has 24 tokens"):
        attention_to_image_grid(values[:-1], grid_thw, merge)


@pytest.mark.parametrize("cell", [(0, 0), (1, 4), (3, 5), (2, 1)])
def test_one_hot_attention_lights_up_its_cell(cell):
    rows, cols = 4, 6  # merged grid of a (1, 8, 12) patch grid, merge 2
    width, height = 130, 90  # cells of 21.7 x 22.5 pixels: not a whole number on purpose
    r, c = cell
    attention = np.zeros(rows * cols)
    attention[r * cols + c] = 1.0
    heat = attention_to_image_grid(attention, (1, 2 * rows, 2 * cols), 2)[0]  # [4, 6]
    up = upsample(heat, (width, height))  # [90, 130]
    assert up.shape == (height, width)
    y, x = np.unravel_index(up.argmax(), up.shape)
    assert r * height / rows <= y + 0.5 < (r + 1) * height / rows
    assert c * width / cols <= x + 0.5 < (c + 1) * width / cols

    drawn = np.asarray(overlay(Image.new("RGB", (width, height), (128, 128, 128)), heat), dtype=int)
    assert drawn.shape == (height, width, 3)
    red, blue = drawn[y, x], drawn[0 if r >= 2 else -1, 0 if c >= 3 else -1]  # the hot cell vs a far corner
    assert red[0] > red[2] + 50 and blue[2] > blue[0] + 50


def _square_sample(width=200, height=120, box=(130, 20, 170, 60)):
    image = Image.new("RGB", (width, height), (255, 255, 255))
    ImageDraw.Draw(image).rectangle(box, fill=(255, 0, 0))
    messages = [{"role": "user", "content": "<image>Where is the red square?"}]
    return LoadedSample(id="synthetic/test/0", messages=messages, images=[image]), box


def test_forced_attention_on_the_square_lands_on_the_square(tiny_qwen2_vl_path):
    """Through the template's grid: attention forced onto the image token over the red square
    (on a non-square image) must come out on the square in the original picture."""
    from mmgrpo.models.loading import load_processor
    from mmgrpo.templates import get_template

    template = get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path))
    sample, (x1, y1, x2, y2) = _square_sample()
    prompt = template.encode_prompt(sample)
    _, h, w = prompt.mm["image_grid_thw"][0].tolist()
    merge = template.media["image"].merge_size
    rows, cols = h // merge, w // merge
    width, height = sample.images[0].size
    r, c = int((y1 + y2) / 2 / height * rows), int((x1 + x2) / 2 / width * cols)  # the square's centre cell

    image_positions = torch.nonzero(prompt.prompt_ids == template.placeholder_ids["image"]).flatten()
    assert len(image_positions) == rows * cols
    attention = torch.zeros(len(prompt.prompt_ids) + 3)  # prompt + a 3-token answer
    attention[image_positions[r * cols + c]] = 0.25
    attention[0] = 0.75  # the rest on text: not part of the image's share
    (panel,) = media_panels(
        template, prompt, torch.cat([prompt.prompt_ids, torch.zeros(3, dtype=torch.long)]), attention
    )
    assert panel["share"] == pytest.approx(0.25)
    assert panel["grid"].shape == (1, rows, cols)
    y, x = np.unravel_index(upsample(panel["grid"][0], (width, height)).argmax(), (height, width))
    assert x1 - width / cols <= x <= x2 + width / cols and y1 - height / rows <= y <= y2 + height / rows


def test_answer_attention_rows_are_distributions(tiny_qwen2_vl_path):
    from mmgrpo.viz.attention import load_for_attention

    model, template = load_for_attention(tiny_qwen2_vl_path, "qwen2-vl")
    sample, _ = _square_sample()
    batch = template.collate([template.encode_prompt(sample)])
    completion_ids = torch.tensor(
        [template.tokenizer("red square", add_special_tokens=False)["input_ids"]]
    )  # [1, T]
    completion_mask = torch.ones_like(completion_ids)
    for layers in ("all", "last", "0"):
        attention = answer_attention(model, template, batch, completion_ids, completion_mask, layers=layers)
        assert attention.shape == (batch["input_ids"].shape[1] + completion_ids.shape[1],)  # [P + T]
        assert float(attention.sum()) == pytest.approx(1.0, abs=1e-4)  # each row is a softmax
        assert float(attention[-1]) == 0.0  # the row predicting the last token cannot see it (causal)


def _tiny(family: str) -> str:
    from mmgrpo.models.tiny import build_tiny

    return str(build_tiny(family))


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_viz_attention_command_writes_a_png(family, tmp_path):
    from mmgrpo.cli import main

    out = tmp_path / "attention.png"
    main(
        f"viz attention --model {_tiny(family)} --model_type {family} --dataset shapes-color:test "
        f"--index 1 --output {out} --max_new_tokens 4".split()
    )
    pixels = np.asarray(Image.open(out).convert("RGB"), dtype=int)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    not_white = (pixels < 240).any(axis=2).mean()
    assert not_white > 0.2 and pixels.std() > 20  # the overlay is drawn, not an empty canvas


def test_viz_errors_exit_2(capsys, tiny_qwen2_vl_path):
    from mmgrpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["viz", "heatmaps"])
    assert exit_info.value.code == 2
    assert "unknown view 'heatmaps'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "viz",
                "attention",
                "--model",
                tiny_qwen2_vl_path,
                "--model_type",
                "qwen2-vl",
                "--dataset",
                "shapes-color:test",
                "--index",
                "100000",
            ]
        )
    assert exit_info.value.code == 2
    assert "--index 100000" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])  # Qwen3-VL: a timestamp before each frame pair
def test_video_gets_one_grid_slot_per_frame_pair(tmp_path, family):
    import json

    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.models.loading import load_processor
    from mmgrpo.templates import get_template

    for i in range(4):  # a red square moving right
        frame = Image.new("RGB", (96, 64), (255, 255, 255))
        ImageDraw.Draw(frame).rectangle((10 + 15 * i, 10, 30 + 15 * i, 30), fill=(255, 0, 0))
        frame.save(tmp_path / f"f{i}.png")
    row = {
        "messages": [{"role": "user", "content": "<video>Where does it go?"}],
        "videos": [[f"f{i}.png" for i in range(4)]],
        "solution": "right",
    }
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    template = get_template(family, load_processor(_tiny(family)))
    prompt = template.encode_prompt(resolve_dataset(str(tmp_path / "v.jsonl"), split="train")[0].load_media())
    t, h, w = prompt.mm["video_grid_thw"][0].tolist()
    merge = 2  # Qwen-VL's spatial merge
    assert t == 2  # frames are merged in pairs
    video_positions = torch.nonzero(prompt.prompt_ids == template.placeholder_ids["video"]).flatten()
    attention = torch.zeros(len(prompt.prompt_ids))
    last = (h // merge) * (w // merge) + (h // merge - 1) * (w // merge)  # slot 2, first cell of its last row
    attention[video_positions[last]] = 1.0
    (panel,) = media_panels(template, prompt, prompt.prompt_ids, attention)
    assert panel["kind"] == "video" and panel["grid"].shape == (2, h // merge, w // merge)
    assert panel["grid"][1, -1, 0] == 1.0 and panel["grid"][0].sum() == 0.0
    assert len(panel["pictures"]) == 2
    np.testing.assert_array_equal(
        np.asarray(panel["pictures"][1]), np.asarray(Image.open(tmp_path / "f2.png"))
    )


def test_panels_follow_the_expanded_token_not_the_placeholder():
    """Gemma3-like: the rendered placeholder (id 9) is expanded into other tokens (id 7)."""
    from types import SimpleNamespace

    hook = SimpleNamespace(token_id=7, tokens_per_item=lambda mm: [4])
    template = SimpleNamespace(media={"image": hook}, placeholder_ids={"image": 9})
    prompt = SimpleNamespace(
        mm={"image_grid_thw": torch.tensor([[1, 4, 4]])}, images=[Image.new("RGB", (28, 28))], videos=[]
    )
    input_ids = torch.tensor([1, 7, 7, 7, 7, 2, 3])
    attention = torch.tensor([0.1, 0.4, 0.1, 0.2, 0.1, 0.05, 0.05])
    (panel,) = media_panels(template, prompt, input_ids, attention)
    assert panel["grid"].shape == (1, 2, 2) and panel["share"] == pytest.approx(0.8)
