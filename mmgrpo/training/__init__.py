"""What a run stands on, beside the GRPO step itself (mmgrpo/engine.py):

    run.py          everything a run is built from, decided once (`build_run` -> `Run`)
    state.py        what changes while it trains (`TrainState`), every RNG, saved and restored
    resume.py       a run saved so that it continues exactly, and continued
    checkpoint.py   checkpoint folders that are complete or absent (staging, fsync, marker, rename)
    output_dir.py   the output folder and the checkpoint to resume, checked before a model loads
    optim.py        the optimizer and its learning-rate schedule
    runlog.py       metrics.jsonl / completions.jsonl, progress bars
    trackers.py     TensorBoard, W&B, MLflow
"""
