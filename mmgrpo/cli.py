"""The `mmgrpo` command.

    mmgrpo train    --model tiny:qwen2-vl --dataset shapes-color --reward_funcs vqa_accuracy format
    mmgrpo sft      --model tiny:qwen2-vl --dataset shapes-color --max_steps 100
    mmgrpo eval     --model runs/x/checkpoint-50 --model_type qwen2-vl --dataset shapes-color:test
    mmgrpo compare  runs/a/eval runs/b/eval
    mmgrpo report   runs/x
    mmgrpo export   --merge_lora --model runs/x/checkpoint-50 --output_dir runs/x/merged
    mmgrpo viz      attention --model runs/x/checkpoint-50 --model_type qwen2-vl --dataset shapes-color:test --index 0
    mmgrpo rollout-server --model tiny:qwen2-vl --port 8000     # vLLM rollouts for --vllm_mode server
    mmgrpo estimate --model random:qwen2.5-vl-7b --parallel fsdp2 --world_size 8 --bf16   # memory per GPU
    mmgrpo datasets
    mmgrpo demo

`mmgrpo <command> --help` explains each. Errors about input print one line and exit 2; a run stopped by
SIGTERM / SIGUSR1 saves a checkpoint, prints how to resume and exits 75.
"""

from __future__ import annotations

import errno
import os
import sys

COMMANDS = {
    "train": "GRPO training (flags as in TRL / ms-swift)",
    "sft": "supervised warm start on the dataset's reference answers",
    "eval": "evaluate a model on a dataset split: eval.json + eval.md",
    "compare": "A/B comparison of two evals with bootstrap intervals and p-values",
    "report": "HTML report with plots of a training run",
    "viz": "pictures of a model: `viz attention` draws the answer's attention over the image",
    "export": "write a LoRA checkpoint as a plain HF folder (--merge_lora)",
    "rollout-server": "serve vLLM rollouts to `train --use_vllm --vllm_mode server` (docs/vllm.md)",
    "estimate": "memory per device of a run's flags, by part; does it fit (docs/distributed.md)",
    "datasets": "list the dataset registry with splits and sizes",
    "demo": "the embedded demo: build a tiny Qwen2-VL, SFT, GRPO, evaluate before/after",
}


def _usage() -> str:
    lines = [__doc__.strip().splitlines()[0], "", "commands:"]
    width = max(map(len, COMMANDS)) + 2
    lines += [f"  {name:<{width}}{text}" for name, text in COMMANDS.items()]
    lines += ["", "Run `mmgrpo <command> --help` for its options."]
    return "\n".join(lines)


def cmd_train(argv):
    from mmgrpo.config import TrainConfig

    cfg = TrainConfig.from_args(argv, required=("model.model",))  # before the engine's imports: `--help` and flag errors come at once
    from mmgrpo.engine import train
    from mmgrpo.parallel import rank_errors

    with rank_errors():  # under torchrun: an error names its rank, a timed-out collective says why
        out = train(cfg)
    print(f"run written to {out}")


def cmd_sft(argv):
    from mmgrpo.config import SFTConfig
    from mmgrpo.config.flags import build_parser, config_from_namespace

    parser = build_parser(SFTConfig, prog="mmgrpo sft")
    cfg = config_from_namespace(SFTConfig, parser.parse_args(argv), required=("model.model",))
    from mmgrpo.sft import sft

    out = sft(cfg)
    print(f"SFT model written to {out}")


def cmd_export(argv):
    import argparse

    from mmgrpo.errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="mmgrpo export",
        description="Write a LoRA checkpoint as a plain Hugging Face folder: base weights with the adapter merged in.",
    )
    parser.add_argument("--model", required=True, help="A checkpoint folder of a --train_type lora run (holds adapter_config.json).")
    parser.add_argument("--output_dir", required=True, help="Where the merged model and its processor are written.")
    parser.add_argument("--merge_lora", action="store_true", help="Merge the adapter into the base weights (required).")
    parser.add_argument("--base_model", default=None, help="The base model (default: the one adapter_config.json names).")
    parser.add_argument("--model_type", default=None, help="The model family (default: the one the training run recorded in the checkpoint).")
    args = parser.parse_args(argv)  # before torch is imported: --help stays instant
    if not args.merge_lora:
        raise ConfigError("mmgrpo export writes merged LoRA weights: pass --merge_lora.")
    from mmgrpo.models.saving import merge_lora

    print(f"merged model written to {merge_lora(args.model, args.output_dir, args.base_model, args.model_type)}")


def cmd_datasets(argv):
    import argparse

    from rich.console import Console

    from mmgrpo.data.catalog import print_registry

    parser = argparse.ArgumentParser(prog="mmgrpo datasets", description="List the dataset registry (built-in and user files).")
    parser.add_argument("--dataset_registry", nargs="*", default=[], help="Extra registry YAML files.")
    args = parser.parse_args(argv)
    print_registry(Console(), extra_files=args.dataset_registry)


def cmd_eval(argv):
    from mmgrpo.eval.evaluate import main as eval_main

    eval_main(argv)


def cmd_compare(argv):
    from mmgrpo.eval.evaluate import compare_main

    compare_main(argv)


def cmd_report(argv):
    import argparse

    from mmgrpo.eval.report import write_report

    parser = argparse.ArgumentParser(prog="mmgrpo report", description="Write RUN_DIR/report.html (and PNG plots) for a training run.")
    parser.add_argument("run_dir", help="A training output folder holding metrics.jsonl.")
    args = parser.parse_args(argv)
    print(f"report written to {write_report(args.run_dir)}")


def cmd_viz(argv):
    from mmgrpo.viz import main as viz_main

    viz_main(argv)


def cmd_estimate(argv):
    from mmgrpo.estimate import main as estimate_main

    estimate_main(argv)


def cmd_rollout_server(argv):
    from mmgrpo.config.server import server_parser

    args = server_parser().parse_args(argv)  # before torch and vLLM are imported: --help stays instant
    from mmgrpo.rollout.vllm_server import main as serve

    serve(args)


def cmd_demo(argv):
    from mmgrpo.demo import main as demo_main

    demo_main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"mmgrpo: unknown command {command!r}.\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    from mmgrpo.errors import MMGRPOError
    from mmgrpo.runstate.preemption import exit_on_second_interrupt

    exit_on_second_interrupt()  # a second Ctrl-C during the first one's cleanup: one line, no traceback
    code = 0
    try:
        globals()[f"cmd_{command.replace('-', '_')}"](rest)
    except MMGRPOError as exc:
        code = getattr(exc, "exit_code", 2)  # 75: stopped on a signal after a checkpoint (mmgrpo/runstate/preemption.py)
        if code == 2:
            print(f"mmgrpo {command}: error: {exc}", file=sys.stderr)
        elif os.environ.get("RANK", "0") == "0":  # one line for the whole run
            print(f"mmgrpo {command}: {exc}", file=sys.stderr)
    except OSError as exc:  # a log or file a run writes when the disk fills up (a checkpoint's save says more)
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # the folder turned read-only mid-run
            print(f"mmgrpo {command}: error: cannot write {exc.filename or 'a file'} ({exc.strerror}): make its folder "
                  "writable again, then run again (a training run: with --resume_from_checkpoint latest; its "
                  "checkpoints are kept)", file=sys.stderr)
            code = 2
        elif exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        else:
            print(f"mmgrpo {command}: error: no space left writing {exc.filename or 'a file'}: free space on its disk, "
                  "then run again (a training run: with --resume_from_checkpoint latest)", file=sys.stderr)
            code = 2
    except KeyboardInterrupt:
        print(f"mmgrpo {command}: interrupted", file=sys.stderr)
        code = 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _end_launched_rank(code)
    if code:
        sys.exit(code)


def _end_launched_rank(code: int) -> None:
    """End a rank started by torchrun without the interpreter's teardown.

    Everything is written by now (checkpoints awaited, logs closed, the process group destroyed),
    but DeepSpeed and FSDP keep Python references to their process groups until the interpreter
    frees its last objects. Freeing a gloo group that late lets its worker threads take the GIL
    from a dying interpreter, and about one run in five ended in SIGABRT ("terminate called
    without an active exception") after a complete run. The rank leaves with its own code instead.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
