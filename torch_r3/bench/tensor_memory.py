"""`TensorMemory`: the bytes of tensor memory some code allocates and keeps, counted op by op.

Where no allocator statistics exist (`torch.cuda.max_memory_allocated` needs a
GPU, and the resident size of a CPU process moves with the allocator's caching),
the extra memory of a piece of code is counted from the tensors it creates:
while counting is on, every new storage an operator returns (a view or an
in-place result shares its input's storage and is not new) adds its bytes to
`live`, and its bytes leave `live` when the storage is freed, whenever that
happens. `peak` is the most `live` has held. The count is exact and
deterministic for a given sequence of operators: it needs no timing, no GPU
and no quiet machine.

```python
meter = TensorMemory()
with meter.counting():
    state = build_state()  # counted, and kept
with meter.counting():
    use(state)  # its temporaries count towards the peak, then leave
meter.peak, meter.live  # bytes
```
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemory"]


class TensorMemory:
    """Counts the bytes of the tensor storages created while `counting()` is active, until they are freed."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.allocated = 0  # every counted storage's bytes, freed or not
        self._seen: set[int] = set()  # ids of the storages counted and not freed yet
        self._mode: _Counting | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[TensorMemory]:
        """Count the storages the operators inside the block create."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def start(self) -> None:
        """Start counting (for code whose start and end are two callbacks, such as a module's forward hooks)."""
        if self._mode is not None:
            raise RuntimeError("TensorMemory: already counting")
        self._mode = _Counting(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Stop counting; what was counted leaves `live` when it is freed, as before."""
        if self._mode is None:
            raise RuntimeError("TensorMemory: not counting")
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.allocated += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


class _Counting(TorchDispatchMode):
    def __init__(self, meter: TensorMemory):
        super().__init__()
        self._meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) not in given:
                    self._meter._add(storage)
        return out
