"""--model_type inferred from a checkpoint's config.json (an explicit flag wins; unknown or ambiguous: a clear error)."""

import json
import shutil

import pytest

from mmgrpo.errors import ConfigError
from mmgrpo.models.loading import infer_model_type, load_template
from mmgrpo.templates import Template, register_template, templates_for_hf_type
from mmgrpo.templates.base import TEMPLATES


@pytest.fixture
def plain_checkpoint(tmp_path, tiny_qwen2_5_vl_path):
    """A copy of the tiny Qwen2.5-VL checkpoint as a user has it: config.json, no mmgrpo.json."""
    folder = tmp_path / "qwen25"
    shutil.copytree(tiny_qwen2_5_vl_path, folder)
    (folder / "mmgrpo.json").unlink(missing_ok=True)
    return folder


def test_every_builtin_family_declares_its_hf_types_once():
    for hf_type, name in [("qwen2_vl", "qwen2-vl"), ("qwen2_5_vl", "qwen2.5-vl"), ("qwen3_vl", "qwen3-vl"),
                          ("qwen2_audio", "qwen2-audio"), ("qwen2_5_omni_thinker", "qwen2.5-omni"),
                          ("llava_onevision", "llava-onevision"), ("gemma3", "gemma3"), ("qwen2", "qwen2")]:
        assert templates_for_hf_type(hf_type) == [name]


def test_the_config_json_model_type_picks_the_template(plain_checkpoint):
    assert infer_model_type(str(plain_checkpoint)) == "qwen2.5-vl"
    path, _, template = load_template(str(plain_checkpoint), None)
    assert template.name == "qwen2.5-vl" and str(path) == str(plain_checkpoint)


def test_an_explicit_model_type_wins(plain_checkpoint):
    # qwen2-vl's template on a Qwen2.5-VL checkpoint: the user asked for it (both read the same tokens)
    _, _, template = load_template(str(plain_checkpoint), "qwen2-vl")
    assert template.name == "qwen2-vl"


def test_an_unknown_type_lists_the_templates_and_their_hf_types(plain_checkpoint):
    config = json.loads((plain_checkpoint / "config.json").read_text())
    (plain_checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ConfigError, match=r"model_type 'bert' is not one a template declares.*qwen2.5-vl \(qwen2_5_vl\)"):
        infer_model_type(str(plain_checkpoint))


def test_an_ambiguous_type_asks_for_the_flag(plain_checkpoint):
    @register_template("doc-second-qwen25")
    class SecondQwen25(Template):
        hf_model_types = ("qwen2_5_vl",)

    try:
        with pytest.raises(ConfigError, match=r"served by several templates \(doc-second-qwen25, qwen2.5-vl\).*--model_type"):
            infer_model_type(str(plain_checkpoint))
    finally:
        TEMPLATES.unregister("doc-second-qwen25")


def test_a_folder_without_config_json_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="no config.json to infer the model type from; give --model_type"):
        infer_model_type(str(tmp_path))


def test_train_needs_no_model_type_for_a_plain_checkpoint(plain_checkpoint, tmp_path):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    cfg = TrainConfig.from_args(["--model", str(plain_checkpoint), "--dataset", "shapes-ground", "--num_generations", "2",
                                 "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--max_steps", "1",
                                 "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", str(tmp_path / "run")])
    cfg.validate()  # no "--model_type is required" any more
    out = train(cfg)
    assert json.loads((out / "checkpoint-1" / "mmgrpo.json").read_text()) == {"model_type": "qwen2.5-vl"}
