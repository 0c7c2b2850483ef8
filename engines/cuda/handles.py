"""The address behind a cuda-python handle object (a stream, a context, an event).

cuda-bindings 12.9.1 deprecates `int(handle)` on its driver/runtime objects; `getPtr()` is the supported
accessor (it returns the address the object wraps). Releases without `getPtr` still take `int()`, and a
plain int (0 for the default stream, or a handle already unwrapped) passes through.
"""

from __future__ import annotations

from typing import Any


def handle_of(obj: Any) -> int:
    """The raw handle value of a cuda-python object (CUstream, cudaStream_t, CUcontext, ...), or an int."""
    if obj is None:
        return 0
    if isinstance(obj, int):
        return obj
    get_ptr = getattr(obj, "getPtr", None)
    if callable(get_ptr):
        return int(get_ptr())
    return int(obj)  # cuda-python before getPtr(): int() was the only accessor
