"""Compile one kernel on its own and call it on numpy arrays.

Tests compare every kernel with its op's numpy reference this way, and
``lmc kernel`` uses it to time kernels in isolation.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Sequence

import llvmlite.ir as ir
import numpy as np

from ir.ops import WeightData, get_op
from ir.types import TensorType

from .emit import I8P, I64, KERNEL_TYPE, N_INPUTS
from .jit import LoadedCode, emit_object
from .kernels import KernelSig, emit_kernel, kernel_attrs
from .lower import STEP_TYPE, Ctl, Lowering
from .target import Target, host_target

_CFUNC = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * (1 + N_INPUTS)), *([ctypes.c_int64] * 4),
                          ctypes.c_void_p)


class IRText:
    """A compiled kernel's LLVM IR kept as text, for what reads it again
    (``jit.emit_assembly``, ``lmc kernel --show``): an ``ir.Module`` holds
    ~10x its text in Python objects (a tiled attention kernel: 36 MB against
    3 MB), and test workers that kept hundreds of them grew past 10 GB."""

    def __init__(self, module: ir.Module) -> None:
        self.triple = module.triple
        self._triple, self._text = module.triple, str(module)

    def __str__(self) -> str:
        if self.triple == self._triple:
            return self._text
        return self._text.replace(f'target triple = "{self._triple}"', f'target triple = "{self.triple}"', 1)


class CompiledKernel:
    """One kernel with an exported wrapper, callable from Python."""

    def __init__(self, sig: KernelSig, vector_width: int | None = None, level: int = 3,
                 target: Target | None = None) -> None:
        """``target``: the CPU to compile for (the host by default); it must
        be one the host can run."""
        target = target or host_target()
        self.sig = sig
        self.target = target
        self.vector_width = vector_width or target.vector_width
        m = ir.Module(name=sig.name)
        fn = emit_kernel(m, sig, self.vector_width, target=target)
        # an exported wrapper so the internal kernel has a stable symbol
        w = ir.Function(m, KERNEL_TYPE, "lmc_kernel")
        b = ir.IRBuilder(w.append_basic_block())
        b.call(fn, list(w.args))
        b.ret_void()
        self.obj = emit_object(m, target, level)
        self.module = IRText(m)
        self.code = LoadedCode(self.obj, target, shared=True)
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
    return KernelSig(op, tuple(in_types), out, tuple(sorted(kernel_attrs(op, attrs).items())))


def scratch_floats_for(sig: KernelSig) -> int:
    """Per-thread scratch (float32 elements) a kernel of ``sig`` needs, by
    the rules of the kernel families that use scratch."""
    from . import k_attention, k_norm_rope, matmul

    return max(k_attention.scratch_floats(sig), matmul.scratch_floats(sig),
               k_norm_rope.scratch_floats(sig))


#: control-block slots of the lab step, after the runtime's own (``Ctl``)
_LAB_OUT, _LAB_IN = 32, 33
_LAB_REPS, _LAB_ROT_STRIDE, _LAB_ROT_COPIES, _LAB_ROT_START = (_LAB_IN + N_INPUTS + i for i in range(4))
_LAB_SLOTS = 48
#: runners whose workers did not stop in time: kept alive for the process
_LEAKED: list = []
_RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_WORKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)


class ThreadedKernel:
    """One kernel run on N threads the way the runtime runs a step: the same
    entry points as a compiled model (``lmc_run`` for the calling thread,
    ``lmc_worker`` waiting in native code for the others, the same barrier
    after each call), around a step that calls the kernel ``reps`` times.

    ``rotate`` (an input index) makes call r read that operand from copy
    (start + r) % copies of a buffer of ``copies`` equal copies: a weight
    larger in total than the caches is read from memory on every call, as a
    decode step reads each weight once, instead of from cache."""

    def __init__(self, sig: KernelSig, vector_width: int | None = None, threads: int = 1,
                 rotate: int | None = None, level: int = 3) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        target = host_target()
        self.sig = sig
        self.vector_width = vector_width or target.vector_width
        self.threads = threads
        self.rotate = rotate
        low = Lowering(target, self.vector_width)
        self.tuning: dict[str, int] = {}
        fn = emit_kernel(low.module, sig, self.vector_width, self.tuning, target=target)
        low.entry_points([self._step(low, fn)])
        self.code = LoadedCode(emit_object(low.module, target, level), target, shared=True)
        self._run = _RUN(self.code.address("lmc_run"))
        self._worker = _WORKER(self.code.address("lmc_worker"))
        self._stop = _RUN(self.code.address("lmc_stop"))
        self._stride = (scratch_floats_for(sig) + 64 + 15) // 16 * 16 * 4  # bytes, 64-byte multiples
        self._scratch = _aligned_bytes(self._stride * threads)
        self.ctl = _aligned_bytes(_LAB_SLOTS * 8).view(np.int64)
        c = self.ctl
        c[Ctl.NTHREADS] = threads
        c[Ctl.SCRATCH] = self._scratch.ctypes.data
        c[Ctl.SCRATCH_STRIDE] = self._stride
        c[_LAB_ROT_COPIES] = 1
        self._keep: list = []
        self._workers = [threading.Thread(target=self._worker, args=(c.ctypes.data, t), daemon=True)
                         for t in range(1, threads)]
        for w in self._workers:
            w.start()

    def _step(self, low: Lowering, fn: ir.Function) -> ir.Function:
        """``step_lab(ctl, tid)``: for r in 0..reps: kernel(...); barrier."""
        step = ir.Function(low.module, STEP_TYPE, "step_lab")
        step.linkage = "internal"
        ctl, tid = step.args
        b = ir.IRBuilder(step.append_basic_block("entry"))

        def slot(i: int) -> ir.Value:
            return b.load(b.gep(ctl, [ir.Constant(I64, i)], inbounds=True))

        def ptr(i: int) -> ir.Value:
            return b.inttoptr(slot(i), I8P)

        out = ptr(_LAB_OUT)
        ins = [ptr(_LAB_IN + i) for i in range(N_INPUTS)]
        pos, T, nt = slot(Ctl.POS), slot(Ctl.T), slot(Ctl.NTHREADS)
        reps = slot(_LAB_REPS)
        rstride, copies, rstart = slot(_LAB_ROT_STRIDE), slot(_LAB_ROT_COPIES), slot(_LAB_ROT_START)
        scratch = b.gep(ptr(Ctl.SCRATCH), [b.mul(tid, slot(Ctl.SCRATCH_STRIDE))], inbounds=True)
        pre = b.block
        head, body, done = (step.append_basic_block(s) for s in ("rep.head", "rep.body", "rep.done"))
        b.branch(head)
        b.position_at_end(head)
        r = b.phi(I64, "r")
        r.add_incoming(ir.Constant(I64, 0), pre)
        b.cbranch(b.icmp_signed("<", r, reps), body, done)
        b.position_at_end(body)
        args = list(ins)
        if self.rotate is not None:
            copy = b.urem(b.add(rstart, r), copies)
            args[self.rotate] = b.gep(ins[self.rotate], [b.mul(copy, rstride)])
        b.call(fn, [out, *args, pos, T, tid, nt, scratch])
        b.call(low.barrier, [ctl])
        r.add_incoming(b.add(r, ir.Constant(I64, 1)), b.block)
        b.branch(head)
        b.position_at_end(done)
        b.ret_void()
        return step

    def set_operands(self, out: np.ndarray, inputs: Sequence[Any], pos: int = 0, T: int = 1,
                     copies: int = 1) -> None:
        """Point the kernel at ``out`` and ``inputs`` (kept alive here). With
        ``rotate``, that input holds ``copies`` equal copies back to back."""
        keep = [_array(x) for x in inputs]
        c = self.ctl
        c[_LAB_OUT] = out.ctypes.data
        for i in range(N_INPUTS):
            a = keep[i] if i < len(keep) else None
            c[_LAB_IN + i] = 0 if a is None else a.ctypes.data
        c[Ctl.POS], c[Ctl.T] = int(pos), int(T)
        if self.rotate is not None:
            total = keep[self.rotate].nbytes
            if copies < 1 or total % copies:
                raise ValueError(f"{total} bytes are not {copies} equal copies")
            c[_LAB_ROT_STRIDE], c[_LAB_ROT_COPIES] = total // copies, copies
        self._keep = [out, keep]

    def run(self, reps: int = 1) -> float:
        """Call the kernel ``reps`` times on every thread; the wall time in
        seconds of the whole batch."""
        c = self.ctl
        c[_LAB_REPS] = reps
        t0 = time.perf_counter()
        self._run(c.ctypes.data)
        dt = time.perf_counter() - t0
        c[_LAB_ROT_START] = (int(c[_LAB_ROT_START]) + reps) % max(1, int(c[_LAB_ROT_COPIES]))
        return dt

    def close(self) -> None:
        """Stop the workers (they must not outlive the code they run)."""
        workers = getattr(self, "_workers", None)
        if workers:
            self._stop(self.ctl.ctypes.data)
            for w in workers:
                w.join(timeout=10)
            if any(w.is_alive() for w in workers):  # never free code a thread may still run
                _LEAKED.append((self.code, self.ctl, self._scratch, self._keep, workers))
            self._workers = []

    def __enter__(self) -> "ThreadedKernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _aligned_bytes(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off: off + nbytes]
