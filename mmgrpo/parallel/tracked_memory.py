"""Peak bytes of live tensors on the CPU: what `torch.cuda.max_memory_allocated` is on a GPU.

The CPU has no allocator statistics, and the resident set counts the allocator's cache, the
libraries and memory-mapped files. `TrackedMemory` counts tensor storages instead: the ones it is
given (weights, optimizer states), and every storage an operator creates while it is active
(forward, backward, optimizer, decoding), each once however many views share it, until the
storage is freed. `mmgrpo estimate` is validated against its peak (tests/test_estimate.py).

    >>> import torch
    >>> weights = torch.zeros(1000)
    >>> with TrackedMemory(weights) as tracked:
    ...     a = torch.ones(2000)      # 8000 bytes
    ...     b = a.view(40, 50) * 2    # another 8000
    ...     del a, b
    ...     c = torch.ones(500)
    >>> tracked.peak_bytes, tracked.current_bytes   # weights 4000 + 16000 at the peak; weights + c now
    (20000, 6000)
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TrackedMemory(TorchDispatchMode):
    """Counts tensor storages (module docstring). `existing`: tensors, modules or optimizers whose
    storages count from the start (parameters, buffers, gradients, optimizer states)."""

    def __init__(self, *existing):
        super().__init__()
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.current_bytes = self.peak_bytes = 0
        for thing in existing:
            for tensor in _tensors_of(thing):
                self.track(tensor)

    def track(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself, whichever Python object or view reaches it
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current_bytes += self.live[key]
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._free, key)  # fires when the storage (not a view of it) is freed

    def _free(self, key: int) -> None:
        self.current_bytes -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            self.track(value)
        return out


def _tensors_of(thing):
    if isinstance(thing, torch.Tensor):
        yield thing
    elif isinstance(thing, torch.nn.Module):
        yield from thing.parameters()
        yield from thing.buffers()
        yield from (p.grad for p in thing.parameters() if p.grad is not None)
    elif isinstance(thing, torch.optim.Optimizer):
        for state in thing.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))
    elif thing is not None:
        for item in thing:
            yield from _tensors_of(item)
