"""What a piece of code dispatches: its host synchronisations and its aten ops.

`HostSyncs` counts the calls that make the host wait for the device: `aten._local_scalar_dense` (what
`.item()`, `int(t)`, `float(t)` and `bool(t)` dispatch), ops whose output size depends on the data
(`nonzero`, indexing with a boolean mask, `masked_select`, `unique`), copies from a device to the CPU,
and `Tensor.tolist`, `Tensor.cpu` and `Tensor.numpy`. On the CPU the last three dispatch nothing, so
they are counted where they are called, on every device alike: a count measured on the CPU is the count a
GPU pays. `AtenOps` counts every aten op dispatched: the kernels a device launches, a property of the
code, not of the device. Both nest (`with HostSyncs() as syncs, AtenOps() as ops:`) and change no result.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = {"aten._local_scalar_dense.default", "aten.item.default"}
_DATA_SIZED = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
               "aten.unique_consecutive.default"}
_HOST_READS = ("tolist", "cpu", "numpy")


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = str(func)
    if name.startswith("aten._to_copy"):
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if name.startswith("aten.copy_"):
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class HostSyncs(TorchDispatchMode):
    """Counts host synchronisations (see the module docstring): `count`, and `calls` by what was called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self._inside_read = 0
        self._originals: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> "HostSyncs":
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._counted(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
            self._originals.clear()

    def _counted(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._inside_read == 0:
                self.calls[f"Tensor.{name}"] += 1
            self._inside_read += 1  # the copy it dispatches on a GPU is the same sync
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside_read -= 1
        return read

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        kwargs = kwargs or {}
        name = str(func)
        if self._inside_read == 0:
            if name in _SCALAR or name in _DATA_SIZED:
                self.calls[name] += 1
            elif name.startswith("aten.index.Tensor") and _bool_index(args):
                self.calls["aten.index.Tensor (boolean mask)"] += 1
            elif _to_host(func, args, kwargs):
                self.calls[name] += 1
        return func(*args, **kwargs)


class AtenOps(TorchDispatchMode):
    """Counts every aten op dispatched: `count`, and `calls` by op."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))
