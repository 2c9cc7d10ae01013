"""Models: tiny random checkpoints built offline, and loading by path or `tiny:<family>`.

from mmgrpo.models import build_tiny, load_model, load_processor, resolve_model_path
"""

__all__ = ["build_tiny", "load_model", "load_processor", "resolve_model_path"]


def __getattr__(name):
    # Lazy, so `python -m mmgrpo.models.tiny` runs cleanly and `import mmgrpo.models` stays cheap.
    if name in ("build_tiny", "resolve_model_path"):
        from mmgrpo.models import tiny

        return getattr(tiny, name)
    if name in ("load_model", "load_processor"):
        from mmgrpo.models import loading

        return getattr(loading, name)
    raise AttributeError(name)
