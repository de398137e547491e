"""Where the host reads a tensor's value: each such read makes it wait for the device on a GPU,
and a step that waits gains nothing from faster kernels. `HostReads` counts them on any device,
a CPU included, so tests and `bench/` see on this machine what a GPU would wait on:

- reads of a value: `.item()`, `bool()`, `float()`, `int()` (each dispatches
  `aten._local_scalar_dense`), and `aten.equal`;
- operators whose output size depends on the values (`nonzero`, `masked_select`, `unique`,
  boolean indexing, `repeat_interleave` without `output_size`): CUDA must read them back to
  allocate;
- copies to the host: `.tolist()`, `.numpy()`, `.cpu()` (on a CPU tensor too: code that
  writes them means the host), `.to("cpu")` of a tensor elsewhere.

Host-side work on tensors that live on the host by design (the health check's all-gather of
step times on a gloo group, numbers the host itself measured) runs inside `host_side()`: reads of
CPU tensors there are not counted. A CUDA tensor read there still is.

This module must not import anything of shardwise's: everything may use it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
READS = {
    _aten._local_scalar_dense.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,
}
COPIES = {"tolist", "numpy", "cpu", "__array__"}
_TORCH = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
_local = threading.local()


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Work on tensors that live on the host (see the module docstring)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _on_host_side(tensors: Any) -> bool:
    if not getattr(_local, "depth", 0):
        return False
    return all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))


def caller() -> str:
    """`file:line function` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH) or os.path.abspath(name) == _HERE):
            base = os.path.basename(name)
            return f"{base}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class _Copies(TorchFunctionMode):
    def __init__(self, found: Counter[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name in COPIES or (name == "to" and _copies_to_cpu(args, kwargs))
        if to_host and not _on_host_side(args[:1]):
            self.found[f"{caller()}: .{name}()"] += 1
        return func(*args, **kwargs)


def _copies_to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`tensor.to(…)` names the CPU and the tensor is elsewhere (on a CPU run, `.to(device)` is
    the device and copies nothing)."""
    tensor = args[0] if args else None
    where = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(where, str):
        where = torch.device(where) if where.startswith("cpu") else None
    cpu = isinstance(where, torch.device) and where.type == "cpu"
    return cpu and isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"


class _Reads(TorchDispatchMode):
    def __init__(self, found: Counter[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.found = found

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        read = func in READS or (func is _aten.index.Tensor and _bool_index(args))
        if read and not _on_host_side(args):
            self.found[f"{caller()}: {func.overloadpacket.__name__}"] += 1
        return func(*args, **kwargs)


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class HostReads:
    """Counts the host's reads of tensor values while it is entered, by where they happen
    (`found`: "file:line function: what" → count)."""

    def __init__(self) -> None:
        self.found: Counter[str] = Counter()
        self._modes = (_Copies(self.found), _Reads(self.found))

    @property
    def total(self) -> int:
        return sum(self.found.values())

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)  # type: ignore[no-untyped-call]
