"""The ground floor: what a run leaves on disk and reads back, imported by every floor above and
importing none of them (mmgrpo.errors aside).

    checkpoint.py  atomic checkpoint folders (staging, fsync, completeness marker, rename), `latest`, rotation
    disk_space.py  checkpoint sizes, the start-up warning of a disk too small, a full disk in one line
    run_lock.py    one run per output folder: the lock file, stale locks taken over
    preemption.py  SIGTERM / SIGUSR1: the step finishes, is saved, the run exits 75
    state.py       `TrainState`, what changes while training; seeds and RNG states
    runlog.py      metrics.jsonl / completions.jsonl, the console, progress bars
    trackers.py    TensorBoard / W&B / MLflow (`--report_to`)
"""
