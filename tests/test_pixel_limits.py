"""--min_pixels / --max_pixels travel with a checkpoint: the saved processor resizes images as
training did, so evaluation and a later GRPO stage see the same visual tokens (real processor,
real files; transformers 5 holds the image size as a SizeDict, which once made the limits vanish)."""

import PIL.Image

from mmgrpo.models.loading import keep_pixel_limits, load_processor
from mmgrpo.templates import get_template


def _image_tokens(processor_path) -> int:
    template = get_template("qwen2-vl", load_processor(str(processor_path)))  # no pixel flags: the saved ones
    tensors, _ = template.media["image"].process([PIL.Image.new("RGB", (64, 64), (200, 30, 30))])
    return template.media["image"].tokens_per_item(tensors)[0]


def test_pixel_limits_are_saved_with_the_processor(tiny_qwen2_vl_path, tmp_path):
    assert _image_tokens(tiny_qwen2_vl_path) == 4  # the default: 64 x 64 becomes 56 x 56, 2 x 2 merged tokens
    processor = load_processor(tiny_qwen2_vl_path)
    keep_pixel_limits(processor, 112 * 112, 112 * 112)
    processor.save_pretrained(tmp_path)
    assert _image_tokens(tmp_path) == 16  # 112 x 112: 4 x 4 merged tokens, as in training


def test_one_limit_keeps_the_other(tiny_qwen2_vl_path, tmp_path):
    processor = load_processor(tiny_qwen2_vl_path)
    default_longest = processor.image_processor.size["longest_edge"]
    keep_pixel_limits(processor, 224 * 224, None)
    processor.save_pretrained(tmp_path)
    size = load_processor(str(tmp_path)).image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (224 * 224, default_longest)


def test_a_real_processors_pixel_budget_is_bounded_by_the_familys_default(tmp_path, capsys):
    """A Qwen2.5-VL checkpoint's processor allows 12.8M pixels (16k visual tokens for one photo): without
    --max_pixels the family's bound (1280 tokens) applies, said in one line; --max_pixels wins; a processor
    already below the bound keeps its own."""
    import json
    import shutil

    from mmgrpo.models.loading import load_template
    from mmgrpo.models.tiny import build_tiny

    folder = tmp_path / "qwen25"
    shutil.copytree(build_tiny("qwen2.5-vl"), folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"]["size"]["longest_edge"] = 12845056  # Qwen/Qwen2.5-VL-*'s preprocessor value
    (folder / "processor_config.json").write_text(json.dumps(config))

    _, processor, _ = load_template(str(folder), None)
    assert processor.image_processor.size["longest_edge"] == 1280 * 28 * 28
    assert "images get at most 1,003,520 pixels (the processor allows 12,845,056)" in capsys.readouterr().err
    _, processor, _ = load_template(str(folder), None, max_pixels=2_000_000)
    assert processor.image_processor.size["longest_edge"] == 2_000_000
    _, processor, _ = load_template(str(build_tiny("qwen2.5-vl")), None)
    assert processor.image_processor.size["longest_edge"] == 50176 and "images get" not in capsys.readouterr().err
