"""A video's sound track: decoded with PyAV into `Video.audio`, and trained on with Qwen2.5-Omni's
`--use_audio_in_video` (the track is interleaved with the frames in 2-second chunks).
"""

import json
import re

import av
import numpy as np
import pytest

from mmgrpo.data.sample import normalize_row
from mmgrpo.processors.video import load_video

FPS, RATE, SECONDS = 4, 16000, 2


def write_mp4_with_sound(path, frames: np.ndarray, samples: np.ndarray | None, rate: int = RATE) -> None:
    """uint8 frames [T, H, W, 3] at FPS and float32 mono samples (AAC) muxed into one mp4."""
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        video.thread_count = 1
        audio = None
        if samples is not None:
            audio = container.add_stream("aac", rate=rate)
            audio.layout = "mono"
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            sound = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="fltp", layout="mono")
            sound.sample_rate = rate
            container.mux(audio.encode(sound))
            container.mux(audio.encode())


def clip(seed: int):
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (FPS * SECONDS, 56, 56, 3), dtype=np.uint8)
    t = np.arange(RATE * SECONDS) / RATE
    return frames, (0.5 * np.sin(2 * np.pi * (220 + 200 * seed) * t)).astype(np.float32)


def test_the_sound_track_is_decoded_when_asked(tmp_path):
    frames, samples = clip(0)
    write_mp4_with_sound(tmp_path / "a.mp4", frames, samples)
    write_mp4_with_sound(tmp_path / "silent.mp4", frames, None)
    assert load_video(tmp_path / "a.mp4", nframes=4).audio is None  # not asked: not decoded
    for rate in (16000, 8000):
        video = load_video(tmp_path / "a.mp4", nframes=4, audio_sampling_rate=rate)
        assert video.audio.dtype == np.float32 and video.audio.ndim == 1
        # AAC adds at most a couple of frames of priming and padding
        assert SECONDS * rate <= len(video.audio) <= SECONDS * rate + 2048 * rate // RATE
        assert 0.4 < np.abs(video.audio).max() < 0.6
    from_file = load_video(tmp_path / "a.mp4", nframes=4, audio_sampling_rate=RATE).audio
    from_bytes = load_video((tmp_path / "a.mp4").read_bytes(), nframes=4, audio_sampling_rate=RATE).audio
    np.testing.assert_array_equal(from_bytes, from_file)
    assert load_video(tmp_path / "silent.mp4", nframes=4, audio_sampling_rate=RATE).audio is None
    assert load_video(list(frames[:4]), audio_sampling_rate=RATE).audio is None  # frames carry no sound
    sample = normalize_row({"query": "<video>Hi?", "videos": ["a.mp4"]}, dataset="v", media_root=tmp_path)
    assert sample.load_media(nframes=4).videos[0].audio is None
    assert len(sample.load_media(nframes=4, audio_in_video=True, sampling_rate=8000).videos[0].audio) >= 8000 * SECONDS


def write_dataset(tmp_path, sound: bool) -> str:
    rows = []
    for i in range(4):
        frames, samples = clip(i % 2)
        write_mp4_with_sound(tmp_path / f"{i}.mp4", frames, samples if sound else None)
        rows.append({"query": "<video>Is the tone high or low?", "videos": [f"{i}.mp4"], "solution": ["low", "high"][i % 2]})
    path = tmp_path / "tones_in_video.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def omni_args(data: str, out) -> list[str]:
    return ["train", "--model", "tiny:qwen2.5-omni", "--dataset", data, "--use_audio_in_video",
            "--reward_funcs", "vqa_accuracy", "--video_nframes", "4", "--max_steps", "1", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--beta", "0",
            "--dataloader_num_workers", "0", "--logging_steps", "100", "--output_dir", str(out)]  # fmt: skip


def test_omni_trains_a_step_on_videos_with_sound(tmp_path):
    from mmgrpo.cli import main

    out = tmp_path / "run"
    main(omni_args(write_dataset(tmp_path, sound=True), out))
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["step"] == 1 and np.isfinite(metrics["loss"]) and "reward/video" in metrics


def test_a_video_without_sound_is_an_error_naming_the_sample(tmp_path, capsys):
    from mmgrpo.cli import main

    with pytest.raises(SystemExit):
        main(omni_args(write_dataset(tmp_path, sound=False), tmp_path / "run"))
    assert re.search(r"error: sample tones_in_video/train/\d: video 0 has no sound track", capsys.readouterr().err)


def test_omni_evaluates_videos_with_sound(tmp_path, capsys):
    """`mmgrpo eval --use_audio_in_video` feeds the sound track as training does (a video without
    one is then the same one-line error naming the sample)."""
    from mmgrpo.cli import main

    args = ["eval", "--model", "tiny:qwen2.5-omni", "--use_audio_in_video", "--video_nframes", "4",
            "--metrics", "vqa_accuracy", "--max_completion_length", "4", "--batch_size", "2"]  # fmt: skip
    main([*args, "--dataset", write_dataset(tmp_path, sound=True), "--output_dir", str(tmp_path / "eval")])
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["counts"] == {"all": 4, "video": 4} and "vqa_accuracy" in result["metrics"]
    silent = tmp_path / "silent"
    silent.mkdir()
    with pytest.raises(SystemExit):
        main([*args, "--dataset", write_dataset(silent, sound=False), "--output_dir", str(tmp_path / "eval2")])
    assert re.search(r"error: sample tones_in_video/test/\d: video 0 has no sound track", capsys.readouterr().err)
