"""Running kernel checks under the Triton interpreter from CPU tests.

The interpreter is chosen when a kernel is decorated (at import), so a test runs its checks in a process of its
own under TRITON_INTERPRET=1: `run_interpreted(__file__)` runs that test file as a script, whose `__main__` block
calls `patch_interpreter_loop_bounds()` and then its checks, printing "interpreted checks ok". The process is
forked from a server that imported the heavy modules once (`interpreted`, `tests.interp_server`).
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
    r = interpreted([script, *args], timeout)
    assert r.returncode == 0, f"interpreted checks failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "interpreted checks ok" in r.stdout


def interpreted(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python *argv` ([script, *args] or ["-m", module, *args]) in its own process under TRITON_INTERPRET=1,
    from the repository root, stdout and stderr captured: forked from a server that imported torch, triton and
    the kernel modules once (`tests.interp_server`), or started afresh with MTP_TEST_NO_FORK=1."""
    pytest.importorskip("triton")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    if os.environ.get("MTP_TEST_NO_FORK") == "1" or not hasattr(os, "fork"):
        return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    from tests import interp_server

    code, out, err = interp_server.run(argv, env, ROOT, timeout)
    return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)


def patch_interpreter_loop_bounds() -> None:
    """The kernels loop over a runtime bound (`range(0, n_iter)`); triton 3.6's interpreter turns that tensor
    into an int with int() of a 1-element array, which numpy 2.x refuses. Take the element instead. Every
    interpreted script calls this first, so it also takes some of the interpreter's own overheads off
    (`patch_interpreter_overheads`: the re-patching on device-function calls, the dtype table, eager type names,
    a shape tuple per value)."""
    import numpy as np
    import triton.runtime.interpreter as ti

    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None:  # another triton: leave it alone
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    patch_interpreter_overheads()


def patch_interpreter_overheads() -> None:
    """triton 3.6's interpreter patches triton.language's builtins (`_patch_lang`: `inspect.getmembers` over the
    language modules, a wrapper per builtin) when a kernel launches, and again on every call of a @triton.jit
    device function inside it, although the launch's patch is still in place (the call's own patch is never
    restored: it re-wraps nothing, since the builtins are wrappers already). The kernel checks make ~100 device
    calls per launch: profiled, that re-patching was 60 s of test_fused_kernels' 240 s. Here a device call whose
    language modules a live launch patched runs without patching again; any other call goes the interpreter's
    way. The same wrappers run the same numpy code: results are unchanged. Then the dtype table (below) and the types'
    construction (`_lazy_type_names`, `_shared_tensor_shapes`)."""
    import inspect

    import triton
    import triton.language as tl
    import triton.runtime.interpreter as ti

    if os.environ.get("TRITON_INTERPRET") != "1" or not triton.__version__.startswith("3.6."):
        return  # the compiler builds these types too (and assigns into its tuples); another triton's internals differ
    patch_lang, fn_class = getattr(ti, "_patch_lang", None), getattr(ti, "InterpretedFunction", None)
    if patch_lang is None or fn_class is None or getattr(fn_class, "_mtp_skips_repatch", False):
        return  # another triton, or patched already
    live: list[frozenset] = []  # the language modules each live launch's scope patched, outermost first

    seen: dict = {}

    def langs(fn) -> frozenset:  # a jit function's module globals: looked through once
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    class Scope(ti._LangPatchScope):
        def restore(self) -> None:
            super().restore()
            live.remove(self._mtp_langs)

    def launch_patch(fn):
        scope = patch_lang(fn)
        tracked = Scope()
        tracked._changes, tracked._mtp_langs = scope._changes, langs(fn)
        live.append(tracked._mtp_langs)
        return tracked

    device_call = fn_class.__call__

    def call(self, *args, **kwargs):
        if not any(langs(self.fn) <= patched for patched in live):
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter's own device call reports it
            raise ti.InterpreterError(repr(e)) from e

    ti._patch_lang = launch_patch  # GridExecutor looks the name up at each launch
    fn_class.__call__ = call
    fn_class._mtp_skips_repatch = True
    np_dtype = getattr(ti, "_get_np_dtype", None)
    if np_dtype is not None:  # called per operand of every op, it builds its 17-entry table each time: built once
        table = {t: np_dtype(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                          tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16,
                                          tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}

        def get_np_dtype(tt_dtype):
            elem = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
            found = table.get(elem) if not isinstance(elem, tl.pointer_type) else None
            return found if found is not None else np_dtype(tt_dtype)

        ti._get_np_dtype = get_np_dtype
    _lazy_type_names(tl.core)


def _lazy_type_names(core) -> None:
    """Every interpreted op builds new tensors, each with a block type and a tuple of its shape, and triton 3.6 formats
    each one's name string at construction (`f'<{shape}, {element}>'`, a join over the tuple's member types): ~10% of
    an interpreted check, for names that only printing, hashing and equality of dtypes read. Here those two types
    build their names when first read (the same strings), and block types of equal dims share one triton tuple of
    them and its element count, as tensors do (`_shared_tensor_shapes`)."""
    if getattr(core.block_type, "_mtp_lazy_name", False):
        return

    def lazy_name(make):
        def get(self):
            d = self.__dict__
            if "_mtp_name" not in d:
                d["_mtp_name"] = make(self)
            return d["_mtp_name"]

        def put(self, value):
            self.__dict__["_mtp_name"] = value

        return property(get, put)

    shapes: dict = {}  # dims -> (triton tuple of them, element count): equal dims share one (never assigned into)

    def block_init(self, element_ty, shape):  # triton 3.6's block_type.__init__ without the eager name
        self.element_ty = element_ty
        assert isinstance(shape, (list, core.tuple))  # triton's tuple: what the name means in its module
        dims = tuple(core._unwrap_shape(shape))
        pair = shapes.get(dims)
        if pair is None:
            if not dims:
                raise TypeError("0d block_type is forbidden")
            t = core.tuple(list(dims))
            pair = shapes[dims] = (t, core.validate_block_shape(t))
        self.shape, self.numel = pair

    def tuple_init(self, types, fields=None):  # triton 3.6's tuple_type.__init__ without the eager name
        self.types = types
        self.fields = fields or [""] * len(types)

    core.block_type.__init__ = block_init
    core.block_type.name = lazy_name(lambda self: f"<{self.shape}, {self.element_ty}>")
    core.tuple_type.__init__ = tuple_init
    core.tuple_type.name = lazy_name(
        lambda self: "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]")
    core.block_type._mtp_lazy_name = True
    _shared_tensor_shapes(core)


def _shared_tensor_shapes(core) -> None:
    """triton 3.6's tensor.__init__ builds, for every value an interpreted op makes, its element count and a tuple of
    its dims as constexprs (a triton tuple with its own type); here tensors of equal dims share one such pair. Only
    the compiler's code generator assigns into a triton tuple (`_utils.set_iterable_path`), never the interpreter."""
    import builtins
    import math

    shapes: dict = {}

    def tensor_init(self, handle, type):  # triton 3.6's tensor.__init__, its shape pair looked up
        self.handle = handle
        dims = type.shape if type.is_block() else ()
        key = builtins.tuple(dims)
        pair = shapes.get(key)
        if pair is None:
            pair = shapes[key] = (core.constexpr(math.prod(dims)), core.tuple([core.constexpr(d) for d in dims]))
        self.numel, self.shape = pair
        self.type = type
        self.dtype = type.scalar

    core.tensor.__init__ = tensor_init


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
    launcher drops), so that a kernel asked for it takes PDL=True, as `asm_ok` grants the prefetches issued outside
    PDL (`moe_experts(item_regs=True)`'s next items). Call after importing the kernel modules."""
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
        if name.startswith("mtp.kernels") and hasattr(mod, "asm_ok"):  # the prefetches outside PDL too (no-ops)
            mod.asm_ok = lambda t: True


def interpreted_main(checks, *, fp8_rounding: bool = False, pdl: bool = False, seed: int | None = 0,
                     threads: int | None = None) -> None:
    """The `__main__` block of an interpreted test script: the interpreter's patches, then `checks` (a list of
    functions, run in order, or {name: function}, the one named by the script's first argument), then the line
    `run_interpreted` looks for. fp8_rounding: CUDA's fp32 -> e4m3 rounding (`patch_interpreter_fp8_rounding`);
    pdl: the PDL branches and L2 prefetches as no-ops (`patch_interpreter_pdl`, after the fast path's kernel modules
    are imported); seed: torch.manual_seed first (None: not seeded); threads: torch.set_num_threads."""
    import importlib

    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests.interp.run_interpreted"
    patch_interpreter_loop_bounds()
    if fp8_rounding:
        patch_interpreter_fp8_rounding()
    if pdl:
        importlib.import_module("mtp.backends.fast_path")  # the kernel modules it loads (`moe` too) before the patch
        patch_interpreter_pdl()
    if seed is not None:
        torch.manual_seed(seed)
    if threads is not None:
        torch.set_num_threads(threads)
    for check in ([checks[sys.argv[1]]] if isinstance(checks, dict) else checks):
        check()
    print("interpreted checks ok")
