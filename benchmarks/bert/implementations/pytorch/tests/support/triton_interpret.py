"""Triton's CPU interpreter for the tests of bert/triton_attention.py, set up once per process.

``@triton.jit`` picks interpreter or compiler from ``TRITON_INTERPRET`` when it decorates a
function: triton's own language functions (tl.rand, tl.sum, ...) at triton's first import,
our kernels at bert.triton_attention's import. torch imports triton on its own
(torch.utils.flop_counter, torch._dynamo), so conftest.py calls ``setup()`` before any test
module is collected, and it imports both under the flag. The variable is put back right
after and triton's in-process knob is set instead (triton asks again at some launches): the
process keeps interpreted Triton (nothing else here runs Triton kernels; inductor on the CPU
emits C++), and child processes see the environment unchanged. Not on a machine with a CUDA
device: these tests are CPU tests, and the GPU's Triton must stay compiled.
"""

from __future__ import annotations

import os
import sys


def setup() -> bool:
    """Import triton in interpreter mode; False (and nothing changed) when triton is missing,
    was already imported, or a CUDA device is present: there compiled Triton serves torch
    (inductor's GPU kernels), which an interpreted triton in this process would break. The
    Triton tests then skip, saying why."""
    if "triton" in sys.modules or "bert.triton_attention" in sys.modules:
        return is_interpreted()
    import torch

    if torch.cuda.is_available():
        return False
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter

        import bert.triton_attention  # noqa: F401  (its kernels are decorated now)
    except ImportError:
        return False
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    # Triton also asks later (lazy imports at a launch): its own knob, set in-process only.
    import triton
    triton.knobs.runtime.interpret = True
    _fix_index(interpreter)
    return is_interpreted()


def why_not_interpreted() -> str:
    """Why our kernels do not run in the interpreter here (the skip reason of its tests)."""
    import torch

    from bert import triton_attention

    if not triton_attention.AVAILABLE:
        return "triton is not installed (pip install -c constraints.txt triton)"
    if torch.cuda.is_available():
        return "a CUDA machine: Triton stays compiled here; these tests use its CPU interpreter"
    return "triton was imported in compiler mode before tests/conftest.py set up its interpreter"


def is_interpreted() -> bool:
    """Whether triton's language functions and our kernels run in the interpreter here."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        from bert import triton_attention
    except ImportError:
        return False
    return isinstance(tl.rand, InterpretedFunction) and \
        isinstance(triton_attention._fwd_kernel, InterpretedFunction)


def _fix_index(interpreter) -> None:
    """triton 3.6.0's interpreter turns a scalar (a 1-element array) into a loop bound with
    ``int(array)``, which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by
    triton-lang/triton#9172 after 3.6.0: ``int(data.squeeze())``). Same fix, applied on top of triton's own
    per-launch patching; a no-op for triton versions that already squeeze."""
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_bert_index_fix", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._bert_index_fix = True
    interpreter._patch_lang_tensor = patched
