"""Compatibility of Triton's CPU interpreter (``TRITON_INTERPRET=1``) with numpy >= 2.4.

The interpreter holds every scalar as a one-element numpy array and converts it to a Python int
(``range(0, n, BLOCK)`` with a run-time ``n``) with ``int(array)``. numpy 2.4 refuses that for
arrays with a dimension ("only 0-dimensional arrays can be converted to Python scalars"); Triton
3.8 converts the squeezed array, Triton 3.6 (what the GPU machines run, with numpy 2.5) does not,
so its interpreter fails on every kernel with a run-time loop bound. :func:`patch` makes the
conversion squeeze first, which is what later Tritons do; it changes nothing else.
"""

from __future__ import annotations


def patch() -> bool:
    """Make the interpreter's int conversion of scalars work with numpy >= 2.4; True if applied.

    Idempotent; a Triton without the hook (a future rename) is left alone.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # Registered after the original's __index__, so the scope restores both in order.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
