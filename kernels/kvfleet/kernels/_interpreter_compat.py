"""Makes Triton's interpreter (TRITON_INTERPRET=1) run loops with runtime bounds under NumPy >= 2.4.

Every kernel here loops `for x in range(start, end, BLOCK)` over bounds read at run time (a sequence's
length, a split's first token, a row's part count). Compiled, that is an scf.for. Interpreted, it is
Python's range, which calls `__index__` on the bounds; the interpreter holds every scalar as a numpy
array of shape (1,), and Triton 3.6's interpreter implements `__index__` as `int(data)`. NumPy 1.25
deprecated converting an array of ndim > 0 to a Python scalar and NumPy 2.4 made it a TypeError, so
with Triton <= 3.6 and NumPy >= 2.4 every such kernel fails at its first loop with "only 0-dimensional
arrays can be converted to Python scalars" (upstream triton-lang/triton issue 9171; Triton 3.7's
interpreter converts `data.squeeze()` instead). Older NumPy only warns.

`install()` applies Triton 3.7's fix to an interpreter that lacks it: the kernels keep the loops a GPU
compiles (a while loop instead would lose software pipelining), and nothing changes for compiled
kernels, nor for an interpreter that already works. The check is by behaviour, not version number: it
asks the interpreter's own patching function what `__index__` it installs and tries it on a shape-(1,)
array, with NumPy's deprecation warning as an error, so Triton < 3.7 with NumPy 1.25-2.3 is fixed
too (no warning per loop). If that function is gone or behaves otherwise, nothing is touched.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

_installed = False


def _squeezed_index(self: Any) -> int:
    # What Triton 3.7's interpreter does: a scalar is a one-element array; squeeze it to 0-d first.
    return int(self.handle.data.squeeze())


def _index_works(patch_lang_tensor: Any) -> bool:
    """Whether the `__index__` that the interpreter's patch installs converts a scalar without a
    warning or an error. Run on a stand-in class, so no Triton state changes."""
    import numpy as np

    class Probe:
        pass

    class Scope:
        def set_attr(self, obj: Any, name: str, value: Any) -> None:
            setattr(obj, name, value)

    patch_lang_tensor(Probe, Scope())
    probe: Any = Probe()
    probe.handle = types.SimpleNamespace(data=np.array([3], dtype=np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return range(probe).stop == 3
        except (TypeError, DeprecationWarning):
            return False


def install() -> None:
    """Idempotent and cheap; a no-op unless the interpreter needs the fix. Kernel modules call it at
    import, so it is in place before any kernel of this process (the bench's too) is interpreted."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from triton.runtime import interpreter
    except ImportError:  # a triton without the interpreter: nothing to fix
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return
    try:
        if _index_works(original):
            return
    except Exception:  # noqa: BLE001  (an interpreter that patches differently: leave it alone)
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _squeezed_index)

    interpreter._patch_lang_tensor = patch_lang_tensor
