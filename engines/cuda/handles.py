"""The raw value of a cuda-python handle object (a stream, a context, an event).

cuda-bindings 12.9.1 deprecates `int(handle)` on its driver/runtime objects. `getPtr()` is the supported
accessor, but it returns the address of the storage that holds the handle, not the handle: the value is
read from there (checked on the GPU box with cuda-bindings 13.3.1: `c_void_p.from_address(s.getPtr())`
equals `int(s)`, and passing `getPtr()` itself as a stream crashed a kernel launch). Releases without
`getPtr` still take `int()`, and a plain int (0 for the default stream, or a handle already unwrapped)
passes through.
"""

from __future__ import annotations

import ctypes
from typing import Any


def handle_of(obj: Any) -> int:
    """The raw handle value of a cuda-python object (CUstream, cudaStream_t, CUcontext, ...), or an int."""
    if obj is None:
        return 0
    if isinstance(obj, int):
        return obj
    get_ptr = getattr(obj, "getPtr", None)
    if callable(get_ptr):
        return ctypes.c_void_p.from_address(int(get_ptr())).value or 0
    return int(obj)  # cuda-python before getPtr(): int() was the only accessor
