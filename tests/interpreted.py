"""Run a test's script in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET is read at import, so
the interpreted kernels need their own process); the script may import the test modules beside this file.

Triton 3.6's interpreter turns a scalar (a one-element array, e.g. from a program id) into a loop bound with
int(array), which NumPy 2.4 refuses for arrays of one dimension; the script runs with that conversion made through
the array's one element instead (index_of_one_element: the same value).

The interpreter's tl.dot is NumPy's matmul, whose BLAS gives a row of an fp32 product a result that depends on the
row's place in the block (its micro-kernels sum the same row in other orders); an MMA on the GPU does not.
dot_by_row computes each row of a dot on its own, so a row's bytes depend on its own data only, as on the GPU, and a
row-invariance check tests the kernel's reduction order rather than the BLAS."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def index_of_one_element() -> None:
    """Make Triton's interpreter convert one-element arrays to indices by their element (see the module docstring)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched


def dot_by_row() -> None:
    """Make Triton's interpreter compute a 2-D tl.dot one row at a time (see the module docstring)."""
    import numpy as np
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def by_row(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [dot(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype),
                    b, interpreter.TensorHandle(d.data[i:i + 1], d.dtype), input_precision,
                    max_num_imprecise_acc).data for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows), d.dtype)
    interpreter.InterpreterBuilder.create_dot = by_row


def shims() -> None:
    """Both shims of the module docstring (index_of_one_element, dot_by_row): what an interpreted script runs under."""
    index_of_one_element()
    dot_by_row()


def interpreted_rows(script: str) -> list[list[str]]:
    """The whitespace-split lines the script printed (run with lib/ and this folder importable, under shims());
    fails the test, with the script's output, if it exits non-zero."""
    tests = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(tests, "..", "lib")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(paths)}
    prelude = f"import sys\nsys.path.insert(0, {tests!r})\nimport interpreted\ninterpreted.shims()\n"
    r = subprocess.run([sys.executable, "-c", prelude + script], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line.split() for line in r.stdout.splitlines()]
