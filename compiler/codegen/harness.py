"""Compile one kernel on its own and call it on numpy arrays.

Tests compare every kernel with its op's numpy reference this way, and
``lmc kernel`` uses it to time kernels in isolation.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import llvmlite.ir as ir
import numpy as np

from ir.ops import WeightData, get_op
from ir.types import TensorType

from .emit import I8P, I64, KERNEL_TYPE, N_INPUTS, VOID
from .jit import LoadedCode, emit_object
from .kernels import KernelSig, emit_kernel
from .target import host_target

_CFUNC = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * (1 + N_INPUTS)), *([ctypes.c_int64] * 4),
                          ctypes.c_void_p)


class CompiledKernel:
    """One kernel with an exported wrapper, callable from Python."""

    def __init__(self, sig: KernelSig, vector_width: int | None = None, level: int = 3) -> None:
        target = host_target()
        self.sig = sig
        self.vector_width = vector_width or target.vector_width
        m = ir.Module(name=sig.name)
        fn = emit_kernel(m, sig, self.vector_width)
        # an exported wrapper so the internal kernel has a stable symbol
        w = ir.Function(m, KERNEL_TYPE, "lmc_kernel")
        b = ir.IRBuilder(w.append_basic_block())
        b.call(fn, list(w.args))
        b.ret_void()
        self.module = m
        self.obj = emit_object(m, target, level)
        self.code = LoadedCode(self.obj, target)
        self.fn = _CFUNC(self.code.address("lmc_kernel"))

    def __call__(self, out: np.ndarray, inputs: Sequence[Any], pos: int = 0, T: int = 1, tid: int = 0,
                 nthreads: int = 1, scratch: np.ndarray | None = None) -> None:
        keep = [_array(x) for x in inputs]  # alive until the call returns
        ptrs = [None if a is None else a.ctypes.data for a in keep] + [None] * (N_INPUTS - len(inputs))
        self.fn(out.ctypes.data, *ptrs, int(pos), int(T), int(tid), int(nthreads),
                None if scratch is None else scratch.ctypes.data)


def _array(x: Any) -> np.ndarray | None:
    """Operands as contiguous arrays; a plain int (the ``pos`` operand)
    travels in the kernel's pos argument instead."""
    if x is None or isinstance(x, int):
        return None
    if isinstance(x, WeightData):
        x = x.raw
    return np.ascontiguousarray(x)


def run_kernel_like_reference(sig: KernelSig, args: Sequence[Any], pos: int = 0, nthreads: int = 1,
                              symbols: dict[str, int] | None = None, kernel: CompiledKernel | None = None,
                              scratch_floats: int = 1 << 16) -> np.ndarray:
    """Run the compiled kernel the way the step function would (each thread id
    in turn, serially), on the same operands the reference takes."""
    k = kernel or CompiledKernel(sig)
    T = (symbols or {}).get("T", 1)
    shape = tuple(T if isinstance(d, str) else d for d in sig.out_type.shape)
    if get_op(sig.op).updates_state:
        out = args[0]
    else:
        out = np.zeros(shape, np.float32)
    scratch = np.zeros(scratch_floats, np.float32)
    for tid in range(nthreads):
        k(out, args, pos=pos, T=T, tid=tid, nthreads=nthreads, scratch=scratch)
    return out


def sig_for(op: str, in_types: Sequence[TensorType], **attrs: Any) -> KernelSig:
    """The signature of ``op`` applied to ``in_types`` (output from the rule)."""
    out = get_op(op).infer(list(in_types), attrs)
    return KernelSig(op, tuple(in_types), out, tuple(sorted(attrs.items())))
