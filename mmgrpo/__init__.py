"""mmgrpo: GRPO for vision, video and audio language models.

    from mmgrpo import train, TrainConfig
    train(TrainConfig.from_args(["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--max_steps", "3"]))
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import mmgrpo` stays cheap (no torch) so `mmgrpo --help` is instant.
    if name in ("train", "TrainConfig"):
        from mmgrpo import config, engine

        return {"train": engine.train, "TrainConfig": config.TrainConfig}[name]
    raise AttributeError(name)
