"""Every modality through `mmgrpo train`, for every family, and bad input caught before a step.

- each family trains 2 GRPO steps on the built-in datasets of the modalities it takes (mixed in
  one batch where it takes several) and logs `reward/<modality>`;
- audio prompts with G > 1 are repeated by the template, not by `generate` (which would pair a
  prompt's copies with the wrong clips);
- a corrupt or empty video or audio file, a video shorter than the frames asked for, an audio
  header with an impossible sampling rate, media a processor rejects, and a medium the family
  does not take each stop the run with a DataError naming the sample (or the dataset) and what
  to change, before any training step.
"""

import io
import json
import re
import struct

import numpy as np
import pytest
import soundfile
from PIL import Image

from mmgrpo.cli import main

# family -> datasets (mixed in one run) and the modalities its metrics must show
FAMILY_RUNS = {
    "qwen2-vl": (["shapes-color", "shapes-motion"], {"image", "video"}),
    "qwen2-audio": (["tones-pitch"], {"audio"}),
    "qwen2.5-omni": (["tones-pitch", "shapes-color", "shapes-motion"], {"audio", "image", "video"}),
    "qwen3-omni": (["tones-pitch", "shapes-color", "shapes-motion"], {"audio", "image", "video"}),
    "qwen3-vl": (["shapes-motion"], {"video"}),
    "llava-onevision": (["shapes-color"], {"image"}),
    "gemma3": (["shapes-color"], {"image"}),
    "qwen2": (None, {"text"}),  # a JSONL of math questions written by the test
}
FAST = [
    "--max_steps", "2", "--num_generations", "2", "--per_device_train_batch_size", "8",
    "--max_completion_length", "8", "--beta", "0", "--dataloader_num_workers", "0", "--logging_steps", "100",
]  # fmt: skip


def train_args(family: str, datasets: list[str], out, *extra: str) -> list[str]:
    return ["train", "--model", f"tiny:{family}", "--model_type", family, "--dataset", *datasets,
            *FAST, "--output_dir", str(out), *extra]  # fmt: skip


def read_metrics(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_every_family_trains_on_its_modalities(family, tmp_path):
    datasets, modalities = FAMILY_RUNS[family]
    extra = []
    if datasets is None:
        math = tmp_path / "math.jsonl"
        math.write_text(
            "".join(
                json.dumps({"query": f"What is {i} + 2?", "response": str(i + 2)}) + "\n" for i in range(8)
            )
        )
        datasets, extra = [str(math)], ["--reward_funcs", "math_accuracy"]
    out = tmp_path / "run"
    main(train_args(family, datasets, out, *extra))
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    logged = [{key[len("reward/") :] for key in row} & {"text", "image", "video", "audio"} for row in rows]
    assert set().union(*logged) == modalities
    assert any(step == modalities for step in logged)  # all of them in one batch at least once
    assert all(np.isfinite(row["loss"]) for row in rows)


def test_audio_prompts_are_repeated_by_the_template_not_by_generate():
    """Prompt 0 has two clips, prompt 1 one: `generate(num_return_sequences=2)` would repeat the
    clips as [a0, a0, a1, a1, b, b], giving prompt 0's copies the wrong audio. Sampling with
    top_k=1 (one token per step: greedy through the sampling path) must equal greedy decoding of
    each prompt alone."""
    import torch

    from mmgrpo.data.sample import LoadedSample
    from mmgrpo.models import load_model, load_processor
    from mmgrpo.rollout import HFRollout, SamplingParams
    from mmgrpo.templates import get_template

    torch.manual_seed(0)
    model = load_model("tiny:qwen2-audio")
    template = get_template("qwen2-audio", load_processor("tiny:qwen2-audio"))
    rng = np.random.default_rng(0)
    clips = [(rng.standard_normal(n) * 0.3).astype(np.float32) for n in (16000, 8000, 24000)]
    samples = [
        LoadedSample("a", [{"role": "user", "content": "<audio><audio>Which is louder?"}], audios=clips[:2]),
        LoadedSample("b", [{"role": "user", "content": "<audio>Hi?"}], audios=clips[2:]),
    ]
    prompts = [template.encode_prompt(sample) for sample in samples]
    engine = HFRollout(model, template)
    sampled = engine.generate(prompts, SamplingParams(num_generations=2, max_new_tokens=6, top_k=1))
    alone = [engine.generate([p], SamplingParams(num_generations=1, max_new_tokens=6, greedy=True)) for p in prompts]
    expected = torch.cat([rollout.completion_ids.repeat(2, 1) for rollout in alone])  # [4, T]
    assert torch.equal(sampled.completion_ids, expected)


# ---- bad input ------------------------------------------------------------------------------


def wav_bytes(seconds: float = 0.5, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int(seconds * rate), np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def with_header_rate(data: bytes, rate: int) -> bytes:
    """A wav whose header claims `rate` Hz (bytes 24-27 of the fmt chunk)."""
    return data[:24] + struct.pack("<I", rate) + data[28:]


def bad_dataset(tmp_path, kind: str, content, tag: str) -> str:
    """A 4-row JSONL whose every row refers to the same medium (any shuffled batch meets it)."""
    folder = tmp_path / "bad"
    folder.mkdir()
    if isinstance(content, Image.Image):
        name = "picture.png"
        content.save(folder / name)
    else:
        name = {"videos": "clip.mp4", "audios": "sound.wav"}[kind]
        (folder / name).write_bytes(content)
    row = {"messages": [{"role": "user", "content": f"{tag}What is it?"}], kind: [name], "solution": "x"}
    (folder / "bad.jsonl").write_text((json.dumps(row) + "\n") * 4)
    return str(folder / "bad.jsonl")


BAD_INPUT = {  # case -> (family, kind, file content, tag, expected words)
    "corrupt video": ("qwen2-vl", "videos", b"this is not a video " * 50, "<video>", ["cannot decode video", "corrupt"]),
    "empty video": ("qwen2-vl", "videos", b"", "<video>", ["is empty (0 bytes)", "replace the file"]),
    "corrupt audio": ("qwen2-audio", "audios", b"RIFF garbage " * 50, "<audio>", ["cannot decode audio", "corrupt"]),
    "empty audio": ("qwen2-audio", "audios", b"", "<audio>", ["is empty (0 bytes)", "replace the file"]),
    "audio header rate": ("qwen2-audio", "audios", with_header_rate(wav_bytes(), 10), "<audio>",
                          ["sampling rate is 10 Hz", "re-encode the file"]),
    "image the processor rejects": ("qwen2-vl", "images", Image.new("RGB", (1, 300)), "<image>",
                                    ["cannot encode its prompt", "aspect ratio"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_media_stop_the_run_naming_the_sample(case, tmp_path, capsys):
    family, kind, content, tag, words = BAD_INPUT[case]
    out = tmp_path / "run"
    # one DataLoader worker: the error is raised in a worker process and must arrive intact
    args = train_args(
        family, [bad_dataset(tmp_path, kind, content, tag)], out, "--reward_funcs", "vqa_accuracy"
    )
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--dataloader_num_workers", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"mmgrpo train: error: sample bad/train/\d", err), err
    assert all(word in err for word in words), err
    assert "Traceback" not in err
    assert read_metrics(out) == []  # no training step ran


def test_a_video_shorter_than_the_frames_asked_for(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        main(train_args("qwen2-vl", ["shapes-motion"], out, "--video_nframes", "16"))
    err = capsys.readouterr().err
    assert re.search(
        r"error: sample shapes-motion/train/\d+, field 'videos\[0\]': video \S+ has 8 frames", err
    ), err
    assert "fewer than the 16 asked (nframes); ask for fewer frames" in err
    assert read_metrics(out) == []


def test_a_medium_the_family_does_not_take_is_an_error_at_start_up(tmp_path, capsys, monkeypatch):
    import mmgrpo.models.train_type

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(mmgrpo.models.train_type, "load_model", no_model)
    with pytest.raises(SystemExit):
        main(train_args("qwen2-audio", ["shapes-color"], tmp_path / "a"))
    err = capsys.readouterr().err
    assert (
        "dataset 'shapes-color' has image input (sample shapes-color/train/0), but --model_type 'qwen2-audio' takes only audio"
        in err
    )
    with pytest.raises(SystemExit):
        main(train_args("qwen2-vl", ["shapes-color", "tones-pitch"], tmp_path / "b"))
    err = capsys.readouterr().err
    assert "dataset 'tones-pitch' has audio input" in err and "takes only image, video" in err
    with pytest.raises(SystemExit):
        main(train_args("qwen2", ["shapes-motion"], tmp_path / "c"))
    assert "takes only text; pick a model family that takes video" in capsys.readouterr().err
