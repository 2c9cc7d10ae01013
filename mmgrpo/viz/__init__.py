"""Pictures of what a model does: `mmgrpo viz <what>`.

    mmgrpo viz attention --model runs/x/checkpoint-50 --model_type qwen2-vl \\
        --dataset shapes-color:test --index 3 --output attention.png

attention.py: attention from the generated answer to the image (or video) tokens, drawn over
the image. See docs/evaluation.md.
"""

from __future__ import annotations

from mmgrpo.errors import ConfigError

VIEWS = {
    "attention": "attention of the answer to the image tokens, as a heatmap over the image",
}


def usage() -> str:
    lines = ["usage: mmgrpo viz <view> [options]", "", "views:"]
    lines += [f"  {name:<11}{text}" for name, text in VIEWS.items()]
    lines += ["", "Run `mmgrpo viz <view> --help` for its options."]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Dispatch `mmgrpo viz VIEW ...` to the view's own `main`."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    view, rest = argv[0], argv[1:]
    if view not in VIEWS:
        raise ConfigError(f"unknown view {view!r}; views: {', '.join(VIEWS)} (`mmgrpo viz --help`)")
    if view == "attention":
        from mmgrpo.viz.attention import main as attention_main

        attention_main(rest)
