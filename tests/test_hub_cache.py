"""Hub ids resolved through the HF cache (mmgrpo/models/loading.py): a tiny Qwen2-VL checkpoint laid
into a temporary cache under a real model's id, in huggingface_hub's layout, with HF_HUB_OFFLINE=1.
Train, eval and estimate find it there; an id not in the cache is one line with the download command."""

import json
import shutil

import pytest

from mmgrpo.cli import main as cli_main
from mmgrpo.errors import ConfigError
from mmgrpo.models.loading import checkpoint_path, infer_model_type, load_model

HUB_ID = "Qwen/Qwen2.5-VL-3B-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_qwen2_vl_path):
    """HF_HUB_CACHE holding the tiny checkpoint as `HUB_ID` at `COMMIT`, offline."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(tiny_qwen2_vl_path, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "mmgrpo-cache"))
    return repo / "snapshots" / COMMIT


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    assert checkpoint_path(HUB_ID) == str(hub_cache)
    assert infer_model_type(HUB_ID) == "qwen2-vl"  # from the cached config.json
    assert load_model(HUB_ID).config.model_type == "qwen2_vl"


def test_a_local_folder_wins_over_a_hub_id(hub_cache, tmp_path, monkeypatch, tiny_qwen2_vl_path):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_qwen2_vl_path, tmp_path / "Qwen" / "Qwen2.5-VL-3B-Instruct")
    assert checkpoint_path(HUB_ID) == HUB_ID  # the folder ./Qwen/Qwen2.5-VL-3B-Instruct, not the cached snapshot


def test_train_eval_and_estimate_run_from_the_cache(hub_cache, tmp_path, capsys):
    cli_main(["train", "--model", HUB_ID, "--dataset", "shapes-color", "--num_generations", "4",
              "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--dataloader_num_workers", "0",
              "--reward_funcs", "vqa_accuracy", "--max_steps", "1", "--report_to", "none",
              "--output_dir", str(tmp_path / "train")])  # fmt: skip
    assert [json.loads(line)["step"] for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()] == [1]
    cli_main(["eval", "--model", HUB_ID, "--dataset", "shapes-color:test", "--max_completion_length", "8",
              "--limit", "4", "--output_dir", str(tmp_path / "eval")])  # fmt: skip
    assert (tmp_path / "eval" / "eval.json").is_file()
    capsys.readouterr()
    cli_main(["estimate", "--model", HUB_ID])
    assert f"mmgrpo estimate: {HUB_ID}" in capsys.readouterr().out


def test_an_id_not_in_the_cache_is_one_line_with_the_download_command(hub_cache, tmp_path, capsys):
    missing = "Qwen/Qwen2.5-VL-7B-Instruct"
    with pytest.raises(ConfigError, match=r"not in the HF cache .*`hf download Qwen/Qwen2.5-VL-7B-Instruct`"):
        infer_model_type(missing)
    with pytest.raises(SystemExit):
        cli_main(["train", "--model", missing, "--max_steps", "1", "--output_dir", str(tmp_path / "train")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(hub_cache.parents[2]) in err and f"hf download {missing}" in err


def test_estimate_of_an_id_not_in_the_cache_names_the_random_model(hub_cache, capsys):
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--model", "Qwen/Qwen2.5-VL-7B-Instruct"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hf download Qwen/Qwen2.5-VL-7B-Instruct" in err
    assert "--model random:qwen2.5-vl-7b" in err


def test_a_hub_dataset_resolves_through_the_cache_offline(tmp_path, monkeypatch):
    """`--dataset hf:<repo id>[:split]`: a dataset repository laid into a temporary HF cache in
    huggingface_hub's layout (Parquet shards with the images inside, as hub datasets hold them) is read
    offline, its splits from the shard names; one not cached is one line with the download command."""
    import datasets

    from mmgrpo.data.catalog import mix_datasets, resolve_dataset

    source = resolve_dataset("shapes-color")
    cache = tmp_path / "hub"
    snapshot = cache / "datasets--someone--shapes-mini" / "snapshots" / COMMIT
    (snapshot / "data").mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    for split, rows in (("train", range(6)), ("test", range(6, 9))):
        records = []
        for row in source.rows.select(rows):
            with open(f"{source.media_root}/{row['images'][0]}", "rb") as image:
                records.append({"messages": row["messages"], "solution": row["solution"],
                                "images": [{"bytes": image.read(), "path": None}]})
        datasets.Dataset.from_list(records).to_parquet(str(snapshot / "data" / f"{split}-00000-of-00001.parquet"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    view = resolve_dataset("hf:someone/shapes-mini:test")
    assert (view.name, view.split, len(view)) == ("shapes-mini", "test", 3)
    sample = view[0].load_media()
    assert sample.images[0].size == (64, 64) and sample.messages[-1]["role"] == "user"
    mixed = mix_datasets(["hf:someone/shapes-mini:2", "shapes-count:1"], split="train")
    assert [source.name for source in mixed.sources] == ["shapes-mini", "shapes-count"] and len(mixed.sources[0]) == 6
    with pytest.raises(ConfigError, match=r"dataset hf:someone/other is not downloaded: .*"
                                          r"`hf download someone/other --repo-type dataset`"):
        resolve_dataset("hf:someone/other")
