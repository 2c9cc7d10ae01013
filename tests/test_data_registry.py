"""The YAML dataset registry, dataset specs, mixtures and `mmgrpo datasets`."""

import json
import textwrap
from collections import Counter

import PIL.Image
import pytest
from rich.console import Console

from mmgrpo.data import catalog as registry_module
from mmgrpo.data.catalog import (
    ENV_VAR,
    DatasetView,
    MixedDataset,
    describe_registry,
    load_registry,
    mix_datasets,
    parse_spec,
    print_registry,
    read_registry_file,
    resolve_dataset,
)
from mmgrpo.errors import ConfigError, DataError


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user registry with file, split, split_column and small synthetic datasets; a private cache."""
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    data = tmp_path / "data"
    (data / "media").mkdir(parents=True)
    PIL.Image.new("RGB", (8, 8), "blue").save(data / "media" / "blue.png")

    def jsonl(name, rows):
        (data / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    jsonl(
        "vqa_train.jsonl",
        [{"question": f"<image>Colour {i}?", "answer": "blue", "img": "blue.png"} for i in range(50)],
    )
    jsonl(
        "vqa_test.jsonl",
        [{"question": "<image>Colour?", "answer": "blue", "img": "blue.png"} for _ in range(5)],
    )
    jsonl(
        "text.jsonl",
        [
            {"query": f"{i}+1?", "response": str(i + 1), "part": "train" if i < 24 else "eval"}
            for i in range(30)
        ],
    )
    registry_file = tmp_path / "my_datasets.yaml"
    registry_file.write_text(
        textwrap.dedent("""\
        datasets:
          - name: my-vqa
            description: Blue squares, [x] in brackets.
            splits:
              train: data/vqa_train.jsonl
              test: [data/vqa_test.jsonl]
            columns: {question: query, answer: solution, img: images}
            media_root: data/media
            system_prompt: Answer in one word.
            reward_funcs: [vqa_accuracy]
            max_pixels: 12544
          - name: my-text
            files: data/text.jsonl
            split_column: part
            system_prompt: null
          - name: tiny-shapes
            synthetic: shapes-count
            synthetic_args: {train_size: 30, test_size: 10}
    """)
    )
    return tmp_path, registry_file


def test_builtin_registry_has_the_synthetic_datasets():
    entries = {
        entry.name: entry for entry in read_registry_file(registry_module.BUILTIN_DIR / "builtin.yaml")
    }
    assert {"shapes-color", "shapes-count", "shapes-ground"} <= set(entries)
    assert entries["shapes-color"].synthetic == "shapes-color" and entries["shapes-color"].reward_funcs


def test_user_registry_file(project):
    _, registry_file = project
    view = resolve_dataset("my-vqa", extra_files=[registry_file])
    assert isinstance(view, DatasetView) and (view.name, view.split, len(view)) == ("my-vqa", "train", 50)
    assert view.reward_funcs == ["vqa_accuracy"] and view.max_pixels == 12544
    sample = view[7]
    assert sample.id == "my-vqa/train/7"
    assert sample.messages == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "<image>Colour 7?"},
    ]
    assert sample.columns == {"solution": "blue"}
    assert sample.load_media().images[0].getpixel((0, 0)) == (0, 0, 255)  # media_root resolved from the YAML
    test = resolve_dataset("my-vqa:test", extra_files=[registry_file])
    assert (test.split, len(test)) == ("test", 5)
    assert resolve_dataset("my-vqa", "test", extra_files=[registry_file]).split == "test"


def test_split_column_and_synthetic_entries(project):
    _, registry_file = project
    registry = load_registry([registry_file])
    evaluation = resolve_dataset("my-text:eval", registry=registry)
    assert len(evaluation) == 6 and evaluation[0].id == "my-text/eval/24"  # ids keep the file's row number
    assert evaluation[0].messages == [{"role": "user", "content": "24+1?"}]  # system_prompt: null
    shapes = resolve_dataset("tiny-shapes:test", registry=registry)
    assert len(shapes) == 10 and shapes[0].load_media().images[0].size == (64, 64)
    with pytest.raises(ConfigError, match="no rows of split 'dev'.*train, eval"):
        resolve_dataset("my-text:dev", registry=registry)
    with pytest.raises(ConfigError, match="no split 'dev'.*train, test"):
        resolve_dataset("my-vqa:dev", registry=registry)


def test_env_var_registry(project, monkeypatch):
    _, registry_file = project
    monkeypatch.setenv(ENV_VAR, str(registry_file))
    assert "my-vqa" in load_registry()
    assert len(resolve_dataset("my-text")) == 24


def test_paths_as_specs(project):
    tmp_path, _ = project
    view = resolve_dataset(str(tmp_path / "data" / "text.jsonl"), "test")
    assert (view.name, view.split, len(view)) == ("text", "test", 30)
    assert view[0].columns["solution"] == "1"
    with pytest.raises(DataError, match="not found.*missing.parquet"):
        resolve_dataset(str(tmp_path / "missing.parquet"))


def test_spec_parsing_weight_versus_split():
    assert parse_spec("a:0.7") == ("a", None, 0.7)
    assert parse_spec("a:test") == ("a", "test", None)
    assert parse_spec("a:test:3") == ("a", "test", 3.0)
    for bad in ("a:test:x:1", "a:0", "a:-1", ":test", "a::1"):
        with pytest.raises(ConfigError, match="dataset spec"):
            parse_spec(bad)


def test_mixture_follows_weights_deterministically(project):
    _, registry_file = project
    registry = load_registry([registry_file])
    mix = mix_datasets(["my-vqa:0.7", "my-text:0.3"], "train", seed=3, size=1000, registry=registry)
    assert isinstance(mix, MixedDataset) and len(mix) == 1000 and mix.name == "my-vqa+my-text"
    counts = Counter(mix[i].id.split("/")[0] for i in range(len(mix)))
    assert 640 <= counts["my-vqa"] <= 760 and counts["my-vqa"] + counts["my-text"] == 1000
    again = mix_datasets(["my-vqa:0.7", "my-text:0.3"], "train", seed=3, size=1000, registry=registry)
    assert [mix[i].id for i in range(100)] == [again[i].id for i in range(100)]
    other = mix_datasets(["my-vqa:0.7", "my-text:0.3"], "train", seed=4, size=1000, registry=registry)
    assert [mix[i].id for i in range(100)] != [other[i].id for i in range(100)]
    # each source hands out all its rows before repeating one
    first = [mix[i].id for i in range(1000) if mix[i].id.startswith("my-text")][:24]
    assert len(set(first)) == 24
    # weights need not sum to 1; the default size is the sum of the sources
    mix = mix_datasets(["my-vqa:7", "my-text"], seed=0, registry=registry)
    assert len(mix) == 74 and mix.weights == pytest.approx([7 / 8, 1 / 8])
    assert mix.reward_funcs == ["vqa_accuracy"]
    assert isinstance(mix_datasets(["my-text"], registry=registry), DatasetView)


def test_unknown_dataset_lists_known_ones(project):
    _, registry_file = project
    with pytest.raises(ConfigError) as caught:
        resolve_dataset("nope", extra_files=[registry_file])
    message = str(caught.value)
    assert "'nope'" in message and "my-vqa" in message and "shapes-color" in message


def test_duplicate_names_are_an_error(project, tmp_path):
    _, registry_file = project
    twin = tmp_path / "twin.yaml"
    twin.write_text("datasets:\n  - {name: my-vqa, files: data/text.jsonl}\n")
    with pytest.raises(ConfigError) as caught:
        load_registry([registry_file, twin])
    assert (
        "my-vqa" in str(caught.value)
        and "my_datasets.yaml" in str(caught.value)
        and "twin.yaml" in str(caught.value)
    )
    clash = tmp_path / "clash.yaml"
    clash.write_text("datasets:\n  - {name: shapes-color, files: data/text.jsonl}\n")
    with pytest.raises(ConfigError, match="shapes-color.*builtin.yaml"):
        load_registry([clash])


@pytest.mark.parametrize(
    "entry, needles",
    [
        ("{name: x, files: a.jsonl, colums: {a: b}}", ["'x'", "'colums'", "unknown key"]),
        ("{name: x}", ["'x'", "exactly one of"]),
        ("{name: x, files: a.jsonl, folder: f}", ["'x'", "exactly one of"]),
        ("{name: x, files: a.jsonl, columns: [a, b]}", ["'x'", "'columns'"]),
        ("{name: x, files: a.jsonl, reward_funcs: {a: 1}}", ["'x'", "'reward_funcs'"]),
        ("{name: x, files: a.jsonl, max_pixels: -5}", ["'x'", "'max_pixels'"]),
        ("{name: x, splits: {train: a.jsonl, '0.5': b.jsonl}}", ["'x'", "'splits'", "'0.5'"]),
        ("{name: x, synthetic: shapes-colour}", ["'x'", "'synthetic'", "shapes-color"]),
        ("{name: x, synthetic: shapes-color, synthetic_args: {size: 3}}", ["'x'", "'synthetic_args'"]),
        ("{name: 'x:y', files: a.jsonl}", ["entry #0", "'name'"]),
        ("just-a-string", ["entry #0"]),
        ("{name: x, files: 5}", ["'x'", "'files'"]),
    ],
)
def test_malformed_entries_name_file_entry_and_key(tmp_path, entry, needles):
    path = tmp_path / "broken.yaml"
    path.write_text(f"datasets:\n  - {entry}\n")
    with pytest.raises(ConfigError) as caught:
        read_registry_file(path)
    message = str(caught.value)
    assert "broken.yaml" in message
    for needle in needles:
        assert needle in message


def test_malformed_files(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("datasets: {name: x}\n")
    with pytest.raises(ConfigError, match="r.yaml.*'datasets', a list"):
        read_registry_file(path)
    path.write_text("datasets:\n  - name: [unclosed\n")
    with pytest.raises(ConfigError, match="r.yaml is not valid YAML"):
        read_registry_file(path)
    with pytest.raises(ConfigError, match="not found.*nothere.yaml"):
        load_registry([tmp_path / "nothere.yaml"])


def test_column_mapping_naming_a_missing_column(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "r.yaml").write_text(
        "datasets:\n  - {name: bad-map, files: d.jsonl, columns: {question: query}}\n"
    )
    view = resolve_dataset("bad-map", extra_files=[tmp_path / "r.yaml"])
    with pytest.raises(DataError) as caught:
        view[0]
    assert (
        "'bad-map'" in str(caught.value)
        and "row 0" in str(caught.value)
        and "'question'" in str(caught.value)
    )


def test_describe_and_print_registry(project, monkeypatch):
    tmp_path, registry_file = project
    monkeypatch.setattr(registry_module, "BUILTIN_DIR", tmp_path / "no-builtin")
    (tmp_path / "broken.yaml").write_text("datasets:\n  - {name: gone, files: data/none.jsonl}\n")
    rows = {row["name"]: row for row in describe_registry([registry_file, tmp_path / "broken.yaml"])}
    assert rows["my-vqa"]["splits"] == {"train": 50, "test": 5} and rows["my-vqa"]["modality"] == "image"
    assert rows["my-text"]["splits"] == {"train": 24, "eval": 6} and rows["my-text"]["modality"] == "text"
    assert rows["tiny-shapes"]["splits"] == {"train": 30, "test": 10, "validation": 5}
    assert "none.jsonl" in rows["gone"]["error"]
    console = Console(record=True, width=200)
    print_registry(console, extra_files=[registry_file])
    text = console.export_text()
    assert "my-vqa" in text and "train 50, test 5" in text and "[x] in brackets" in text
    narrow = Console(record=True, width=80)  # a terminal of 80 columns: one block per dataset, lines not folded
    print_registry(narrow, extra_files=[registry_file])
    lines = narrow.export_text().splitlines()
    assert any(line.startswith("my-vqa  image  train 50, test 5") for line in lines)
    assert "  rewards: " + ", ".join(rows["my-vqa"]["reward_funcs"]) in lines
