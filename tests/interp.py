"""Running kernel checks under the Triton interpreter from CPU tests.

The interpreter is chosen when a kernel is decorated (at import), so a test runs its checks in a subprocess
started with TRITON_INTERPRET=1: `run_interpreted(__file__)` runs that test file as a script, whose
`__main__` block calls `patch_interpreter_loop_bounds()` and then its checks, printing "interpreted checks ok".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: int = 300, *args: str) -> None:
    """Run `script` (with `args`) under TRITON_INTERPRET=1; it must print "interpreted checks ok"."""
    pytest.importorskip("triton")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    r = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"interpreted checks failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "interpreted checks ok" in r.stdout


def patch_interpreter_loop_bounds() -> None:
    """The kernels loop over a runtime bound (`range(0, n_iter)`); triton 3.6's interpreter turns that tensor
    into an int with int() of a 1-element array, which numpy 2.x refuses. Take the element instead."""
    import numpy as np
    import triton.runtime.interpreter as ti

    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None:  # another triton: leave it alone
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patched


def patch_interpreter_bf16_rounding() -> None:
    """triton 3.6's interpreter casts fp32 -> bf16 by truncating the mantissa (`_convert_float` without a
    rounding mode); CUDA, and torch on the CPU, round to nearest even. A test that holds a kernel's rounding to a
    torch `.to(torch.bfloat16)` bit for bit (the fast path's rounding of a reduced sum before the residual add)
    calls this first, so that both round as CUDA does. NaNs become bf16's quiet NaN, as torch makes them."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_bf16_rne", False):  # another triton, or patched already
        return
    orig = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            b = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rne = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
            return ti.TensorHandle(np.where(np.isnan(src.data), np.uint16(0x7FC0), rne), dst_type.scalar)
        return orig(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._bf16_rne = True



def patch_interpreter_fp8_rounding() -> None:
    """triton 3.6's interpreter casts to e4m3 (`create_fp_to_fp` -> `_convert_float`) by truncating the mantissa (and
    its round-to-nearest adds the cut-off bit without a carry into the exponent); CUDA (cvt.rn.satfinite) rounds to
    nearest even and saturates at +-448, as torch's cast of the clamped value does. A test that holds a fast-path
    kernel's in-register quantization to the reference's `fp8.act_quant` calls this first, so that both quantize
    as CUDA does and only the fp32 summation order differs. NaN stays NaN."""
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_fp8_rne", False):  # another triton, or patched already
        return
    orig = builder.create_fp_to_fp

    def as_float32(src) -> np.ndarray | None:
        s, data = src.dtype.scalar, np.ascontiguousarray(src.data)
        if s == tl.float32 or s == tl.float16:
            return data.astype(np.float32)
        if s == tl.bfloat16:  # stored as its uint16 bits
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return None

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        v = as_float32(src) if dst_type.scalar == tl.float8e4nv else None
        if v is None:
            return orig(self, src, dst_type, rounding_mode)
        q = torch.from_numpy(v).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return ti.TensorHandle(q.view(torch.uint8).numpy(), dst_type.scalar)

    builder.create_fp_to_fp = create_fp_to_fp
    builder._fp8_rne = True


def patch_interpreter_bf16_dot() -> None:
    """triton 3.6's interpreter multiplies bf16 tl.dot operands as their raw uint16 bits (numpy has no bf16), so a
    bf16 dot gives garbage. Widen them to fp32 first (exact): the products are exact and summed in fp32, as on
    tensor cores (in numpy's order). A test that holds a bf16 product (the absorbed output projection) to another
    kernel's or to a reference calls this first."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_bf16_dot", False):  # another triton, or patched already
        return
    orig = builder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data, dtype=np.uint16).astype(np.uint32) << 16
        return ti.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    builder._bf16_dot = True


PREFETCHED: list = []  # the addresses of each interpreted `prefetch_l2` (`patch_interpreter_pdl`), flat int64 arrays


def patch_interpreter_pdl() -> None:
    """Run the kernels' PDL branches (`FastPathOptions.pdl`) under the interpreter, which has no inline asm and no
    launch options: `gdc_launch_dependents` / `gdc_wait` (`pdl_launch`, `pdl_wait`) and `prefetch.global.L2`
    (`prefetch_l2`) become no-ops, each prefetch's addresses appended to `PREFETCHED` (the interpreter's pointers
    are the CPU tensors' own addresses: a caller can check they lie in the weight it meant); and `pdl_kwargs` of
    every loaded `mtp.kernels` module grants PDL on the CPU too ({"launch_pdl": True}, which the interpreter's
    launcher drops), so that a kernel asked for it takes PDL=True. Call after importing the kernel modules."""
    import sys

    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    if builder is not None and not getattr(builder, "_pdl_asm", False):
        orig = builder.create_inline_asm

        class _Result:
            def __init__(self, handle):
                self.handle = handle

            def get_result(self, i):
                return self.handle

        def create_inline_asm(self, inlineAsm, constraints, values, type, isPure, pack):
            if inlineAsm.startswith("griddepcontrol.") or inlineAsm.startswith("prefetch.global.L2"):
                shape = np.shape(values[0].data) if values else ()
                if values:
                    PREFETCHED.append(np.asarray(values[0].data, dtype=np.uint64).astype(np.int64).reshape(-1))
                return _Result(ti.TensorHandle(np.zeros(shape, dtype=np.int32), tl.int32))
            return orig(self, inlineAsm, constraints, values, type, isPure, pack)

        builder.create_inline_asm = create_inline_asm
        builder._pdl_asm = True

    # the interpreter hands `_semantic` to triton.language's own builtins only, not to `tl.extra.cuda`'s: as no-ops
    import triton.language.extra.cuda as cuda

    cuda.gdc_wait = cuda.gdc_launch_dependents = lambda *args, **kwargs: None

    def granted(pdl, t):
        return {"launch_pdl": True} if pdl else {}

    for name, mod in list(sys.modules.items()):
        if name.startswith("mtp.kernels") and hasattr(mod, "pdl_kwargs"):
            mod.pdl_kwargs = granted
