"""The run's assembly, below the loops that use it (mmgrpo/engine.py, mmgrpo/sft.py) and above every
part it puts together:

    build.py         everything a run is built from, decided once (`build_run` -> `Run`)
    resume.py        a run saved so that it continues exactly, and continued
    resume_flags.py  what a resumed run may change: the checkpoint's flags against the run's
    output_dir.py    the output folder and the checkpoint to resume, checked before a model loads
    optim.py         the optimizer and its learning-rate schedule, parameter groups per component

What these stand on (checkpoint folders, locks, `TrainState`, logs) is the ground floor, mmgrpo/runstate/.
"""
