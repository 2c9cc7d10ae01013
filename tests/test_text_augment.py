"""Synonym replacement (mmgrpo/data/text_augment.py) through the registry's augment block and the prompt loader."""

import json

import pytest
import torch

from mmgrpo.data.augment import Augment, parse_augment
from mmgrpo.data.catalog import read_registry_file, resolve_dataset
from mmgrpo.data.prompt_batches import cycle, make_prompt_loader
from mmgrpo.data.sample import LoadedSample
from mmgrpo.data.text_augment import augment_messages, load_synonyms, protected_words, replace_synonyms
from mmgrpo.errors import ConfigError

TABLE = {"big": ["large"], "large": ["big"], "red": ["crimson"], "shape": ["figure"], "three": ["3"],
         "image": ["picture"], "circle": ["round"], "a": ["one"]}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_protected_words_answers_option_letters_and_numbers_are_never_replaced():
    text = "<image>Is the big shape red? A: three circles. B: 12 shapes. Answer A or B."
    out, swaps = replace_synonyms(text, TABLE, 1.0, protected_words("red", ["answers"], []), _gen(),
                                  kinds=("answers", "option_letters", "numbers"))
    assert out == "<image>Is the large figure red? A: three circles. B: 12 shapes. Answer A or B."
    assert swaps == [["big", "large"], ["shape", "figure"]]  # "red" (the answer), A/B, three, 12 and <image> kept
    # without the protections the same words would go
    loose, _ = replace_synonyms("Big red A three", TABLE, 1.0, set(), _gen(), kinds=())
    assert loose == "Large crimson One 3"  # to the table the option letter A is the article "a": option_letters keeps it


def test_the_draw_is_seeded_and_probabilistic():
    text = " ".join(["big"] * 200)
    half, swaps = replace_synonyms(text, TABLE, 0.5, set(), _gen(1))
    assert 60 < len(swaps) < 140
    assert replace_synonyms(text, TABLE, 0.5, set(), _gen(1))[0] == half
    assert replace_synonyms(text, TABLE, 0.5, set(), _gen(2))[0] != half
    assert replace_synonyms(text, TABLE, 0.0, set(), _gen(1)) == (text, [])


def test_only_user_turns_change():
    messages = [{"role": "system", "content": "big"}, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "big"}]},
                {"role": "assistant", "content": "big"}]
    out, swaps = augment_messages(messages, TABLE, 1.0, set(), _gen())
    assert [m["content"] for m in out] == ["big", [{"type": "image"}, {"type": "text", "text": "large"}], "big"]
    assert messages[1]["content"][1]["text"] == "big"  # the dataset's own rows are not modified


def test_synonym_files_json_and_groups(tmp_path):
    (tmp_path / "s.txt").write_text("big, large, huge\n# colours\nred, crimson\n")
    assert load_synonyms(str(tmp_path / "s.txt"), "w")["huge"] == ["big", "large"]
    (tmp_path / "s.json").write_text(json.dumps({"Big": ["large"]}))
    assert load_synonyms(str(tmp_path / "s.json"), "w") == {"big": ["large"]}
    (tmp_path / "bad.json").write_text('{"big": "large"}')
    with pytest.raises(ConfigError, match="must map each word to a list"):
        load_synonyms(str(tmp_path / "bad.json"), "registry x.yaml, entry 'd'")
    with pytest.raises(ConfigError, match=r"entry 'd', key 'augment.synonyms': no such file"):
        parse_augment({"synonyms": str(tmp_path / "missing.txt")}, "registry x.yaml, entry 'd'")
    with pytest.raises(ConfigError, match="augment.synonym_protect"):
        parse_augment({"synonyms": str(tmp_path / "s.txt"), "synonym_protect": ["verbs"]}, "w")
    with pytest.raises(ConfigError, match="needs 'augment.synonyms'"):
        parse_augment({"synonym_prob": 0.5}, "w")


def test_augment_records_the_swaps_and_keeps_the_image_draws(tmp_path):
    (tmp_path / "s.txt").write_text("big, large\n")
    import PIL.Image

    sample = LoadedSample(id="toy/train/0", messages=[{"role": "user", "content": "<image>The big one?"}],
                          images=[PIL.Image.new("RGB", (40, 20))], columns={"solution": [1, 2, 5, 6]})
    text_and_flip = parse_augment({"hflip": 0.5, "synonyms": str(tmp_path / "s.txt"), "synonym_prob": 1.0}, "w")
    out = text_and_flip(sample, seed=3, epoch=0, index=5)
    assert out.messages[0]["content"] == "<image>The large one?" and out.columns["augment"]["synonyms"] == [["big", "large"]]
    flip_only = Augment(hflip=0.5)(sample, seed=3, epoch=0, index=5)
    assert out.columns["augment"]["hflip"] == flip_only.columns["augment"]["hflip"]  # text draws come after
    assert out.columns["solution"] == flip_only.columns["solution"]


def test_the_registry_block_reaches_the_prompts_the_model_sees(tmp_path):
    (tmp_path / "syn.txt").write_text("colour, hue\nshape, figure\n")
    rows = [{"query": f"What colour is shape {i}? Reply red or blue.", "solution": "red"} for i in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "reg.yaml").write_text(
        "datasets:\n  - name: words\n    files: data.jsonl\n"
        f"    augment: {{synonyms: {tmp_path / 'syn.txt'}, synonym_prob: 1.0, protected_words: [shape]}}\n"
    )
    registry = {entry.name: entry for entry in read_registry_file(tmp_path / "reg.yaml")}
    from mmgrpo.models.loading import load_template

    _, _, template = load_template("tiny:qwen2", None)
    loader = make_prompt_loader(resolve_dataset("words", registry=registry), batch_size=4, seed=0, num_workers=0,
                                encode_fn=template.encode_prompt)
    for sample, encoded in next(cycle(loader)):
        assert "What hue is shape" in encoded.prompt_text  # "colour" replaced, the protected "shape" and numbers kept
        assert sample.columns["augment"]["synonyms"] == [["colour", "hue"]]
