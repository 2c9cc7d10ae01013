"""Flags users of TRL and ms-swift look for: --system, --media_root, --warmup_steps (and --run_name:
tests/test_trackers.py), through the code paths a run takes (`mix_datasets`, the scheduler)."""

import json
import shutil

import pytest
import torch

from mmgrpo.config import OptimConfig
from mmgrpo.data.catalog import mix_datasets, resolve_dataset
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.training.optim import make_scheduler


def bare_file(tmp_path):
    """Three shapes-color rows in a JSONL whose image paths are relative to a media folder elsewhere."""
    source = resolve_dataset("shapes-color")
    media, data = tmp_path / "media", tmp_path / "data"
    media.mkdir()
    data.mkdir()
    with open(data / "rows.jsonl", "w") as f:
        for row in source.rows.select(range(3)):
            for image in row["images"]:
                (media / image).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f"{source.media_root}/{image}", media / image)
            f.write(json.dumps(row) + "\n")
    return data / "rows.jsonl", media


def test_media_root_points_a_bare_files_relative_paths_elsewhere(tmp_path):
    path, media = bare_file(tmp_path)
    with pytest.raises(DataError, match=r"image file not found: .*--media_root for a data file"):  # the file's folder
        resolve_dataset(str(path))[0].load_media()
    sample = mix_datasets([str(path)], media_root=str(media))[0].load_media()
    assert sample.images[0].size[0] > 0
    mixed = mix_datasets([str(path), "shapes-count"], media_root=str(media))  # a registry entry keeps its own root
    assert {source.media_root for source in mixed.sources} == {str(media.resolve()), resolve_dataset("shapes-count").media_root}
    with pytest.raises(ConfigError, match=r"--media_root .*nowhere: no such folder"):
        mix_datasets([str(path)], media_root=str(tmp_path / "nowhere"))


def test_system_replaces_the_datasets_system_prompt_and_an_empty_one_drops_it():
    plain = resolve_dataset("shapes-color")[0]
    assert plain.messages[0]["role"] == "system" and "answer" in plain.messages[0]["content"].lower()
    own = mix_datasets(["shapes-color", "shapes-count"], system_prompt="Answer in one word.")
    assert all(own[i].messages[0] == {"role": "system", "content": "Answer in one word."} for i in range(4))
    assert resolve_dataset("shapes-color", system_prompt="")[0].messages[0]["role"] == "user"


def test_warmup_steps_override_the_ratio():
    def rates(**options):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make_scheduler(OptimConfig(learning_rate=1.0, lr_scheduler_type="constant_with_warmup", **options),
                                   optimizer, total_steps=10)
        out = []
        for _ in range(5):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    assert rates(warmup_ratio=0.1) == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert rates(warmup_ratio=0.1, warmup_steps=4) == [0.0, 0.25, 0.5, 0.75, 1.0]
