"""A read-bandwidth probe: what this machine's memory can feed the cores.

Token-by-token decoding reads every weight once per token, so its speed
limit is (read bandwidth) / (weight bytes per token). The probe measures the
first factor the way our kernels read memory: compiled code (wide vector
loads, several independent accumulators) called from Python threads through
ctypes, each thread summing its own share of a buffer much larger than the
last-level cache.
"""
from __future__ import annotations

import ctypes
import functools
import threading
import time

import llvmlite.ir as ir
import numpy as np

from .emit import F32, F32P, FAST, I64, VOID
from .jit import LoadedCode, emit_object
from .target import host_target

#: independent accumulators: enough loads in flight to hide the latency of
#: each add (4 cycles x 2 ports) and keep the memory pipeline busy
ACCUMULATORS = 8
_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


def _probe_module(width: int, accs: int = ACCUMULATORS) -> ir.Module:
    """``void lmc_probe_sum(float* p, i64 n, float* out)``: out[0] = sum of
    p[0:n]. ``n`` must be a multiple of width*accs (the caller pads)."""
    m = ir.Module(name="lmc_probe")
    fn = ir.Function(m, ir.FunctionType(VOID, [F32P, I64, F32P]), "lmc_probe_sum")
    fn.attributes.add("nounwind")
    p, n, out = fn.args
    vt = ir.VectorType(F32, width)
    step = width * accs
    entry = fn.append_basic_block("entry")
    head = fn.append_basic_block("head")
    body = fn.append_basic_block("body")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    zero = ir.Constant(vt, [0.0] * width)
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64, "i")
    i.add_incoming(ir.Constant(I64, 0), entry)
    acc = []
    for _ in range(accs):
        a = b.phi(vt)
        a.add_incoming(zero, entry)
        acc.append(a)
    b.cbranch(b.icmp_signed("<", i, n), body, done)
    b.position_at_end(body)
    new = []
    for k, a in enumerate(acc):
        ptr = b.gep(p, [b.add(i, ir.Constant(I64, k * width))], inbounds=True)
        v = b.load(b.bitcast(ptr, ir.PointerType(vt)), align=64)
        new.append(b.fadd(a, v, flags=FAST))
    nxt = b.add(i, ir.Constant(I64, step))
    i.add_incoming(nxt, body)
    for a, v in zip(acc, new):
        a.add_incoming(v, body)
    b.branch(head)
    b.position_at_end(done)
    total = acc[0]
    for a in acc[1:]:
        total = b.fadd(total, a, flags=FAST)
    s = b.extract_element(total, ir.Constant(I64, 0))
    for lane in range(1, width):
        s = b.fadd(s, b.extract_element(total, ir.Constant(I64, lane)), flags=FAST)
    b.store(s, out)
    b.ret_void()
    return m


class _Probe:
    def __init__(self) -> None:
        target = host_target()
        self.width = target.vector_width
        self.step = self.width * ACCUMULATORS
        # O2: we want our loop as written, not re-vectorised or unrolled away
        self.code = LoadedCode(emit_object(_probe_module(self.width), target, 2), target, shared=True)
        self.fn = _PROTO(self.code.address("lmc_probe_sum"))


@functools.cache
def _probe() -> _Probe:
    """Compiled once per process."""
    return _Probe()


def probe_sum(buf: np.ndarray) -> float:
    """The compiled sum of a float32 array (its length a multiple of the
    probe's block; used by tests to check the kernel reads what it should)."""
    pr = _probe()
    a = np.ascontiguousarray(buf, np.float32)
    if a.size % pr.step:
        raise ValueError(f"length {a.size} is not a multiple of {pr.step}")
    out = np.zeros(1, np.float32)
    pr.fn(a.ctypes.data, a.size, out.ctypes.data)
    return float(out[0])


def _aligned_floats(n: int, align: int = 4096) -> np.ndarray:
    raw = np.empty(n * 4 + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off: off + n * 4].view(np.float32)


class ReadProbe:
    """The read-bandwidth probe with its buffer kept, so that a bench can
    measure it again before each run of the workload it judges."""

    def __init__(self, threads: int, nbytes: int = 1 << 30) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.pr = _probe()
        self.threads = threads
        self.share = max(1, nbytes // 4 // threads // self.pr.step) * self.pr.step  # floats per thread
        self.buf = _aligned_floats(self.share * threads)
        self.buf.fill(1.0)  # touched once: page faults stay out of the timing

    def measure(self, repeats: int = 5) -> float:
        """Read bandwidth in GB/s (1e9 bytes/s), the median over ``repeats``
        passes of every thread summing its disjoint share concurrently."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        pr, threads, share = self.pr, self.threads, self.share
        outs = np.zeros(threads * 16, np.float32)  # one cache line each
        base, out_base = self.buf.ctypes.data, outs.ctypes.data
        start = threading.Barrier(threads)
        rounds = repeats + 1  # the first pass warms up (TLB, frequency) and is not counted
        spans = np.zeros((rounds, threads, 2))

        def work(t: int) -> None:
            # each worker times its own pass; a pass spans the first start to the
            # last end (a main thread that only waited could be descheduled past
            # the whole pass on a busy machine and time nothing)
            for r in range(rounds):
                start.wait()
                spans[r, t, 0] = time.perf_counter()
                pr.fn(base + t * share * 4, share, out_base + t * 64)
                spans[r, t, 1] = time.perf_counter()

        workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times = spans[1:, :, 1].max(axis=1) - spans[1:, :, 0].min(axis=1)
        expect = float(share)
        if not np.allclose(outs[::16], expect, rtol=1e-3):
            raise RuntimeError(f"the probe summed {outs[::16]}, expected {expect}: miscompiled?")
        return share * threads * 4 / float(np.median(times)) / 1e9


def measure_read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 bytes/s), the median over ``repeats``
    passes of ``threads`` threads each summing a disjoint share of an
    ``nbytes`` buffer concurrently. Use a buffer several times the last-level
    cache, or the figure is the cache's."""
    return ReadProbe(threads, nbytes).measure(repeats)


# --- compute peak ---------------------------------------------------------------------------
#: independent FMA chains per thread: FMA latency (4 cycles) x 2 pipes needs
#: 8 in flight; a few more hide issue jitter and stay within 16 registers
FMA_CHAINS = 12
_FMA_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)


def _fma_module(width: int, chains: int = FMA_CHAINS) -> ir.Module:
    """``void lmc_probe_fma(i64 iters, float* out)``: ``chains`` independent
    vector chains a = fma(a, m, c), ``iters`` times; out[0] = a lane sum (so
    nothing is dead). The values converge to c / (1 - m): no denormals."""
    m = ir.Module(name="lmc_probe_fma")
    fn = ir.Function(m, ir.FunctionType(VOID, [I64, F32P]), "lmc_probe_fma")
    fn.attributes.add("nounwind")
    iters, out = fn.args
    vt = ir.VectorType(F32, width)
    fma = ir.Function(m, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{width}f32")
    mul = ir.Constant(vt, [0.999] * width)
    add = ir.Constant(vt, [1e-3] * width)
    entry, head, body, done = (fn.append_basic_block(s) for s in ("entry", "head", "body", "done"))
    b = ir.IRBuilder(entry)
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64, "i")
    i.add_incoming(ir.Constant(I64, 0), entry)
    acc = []
    for k in range(chains):
        a = b.phi(vt)
        a.add_incoming(ir.Constant(vt, [0.01 * (k + 1)] * width), entry)
        acc.append(a)
    b.cbranch(b.icmp_signed("<", i, iters), body, done)
    b.position_at_end(body)
    new = [b.call(fma, [a, mul, add]) for a in acc]
    i.add_incoming(b.add(i, ir.Constant(I64, 1)), body)
    for a, v in zip(acc, new):
        a.add_incoming(v, body)
    b.branch(head)
    b.position_at_end(done)
    total = acc[0]
    for a in acc[1:]:
        total = b.fadd(total, a)
    s = b.extract_element(total, ir.Constant(I64, 0))
    for lane in range(1, width):
        s = b.fadd(s, b.extract_element(total, ir.Constant(I64, lane)))
    b.store(s, out)
    b.ret_void()
    return m


class _FmaProbe:
    def __init__(self) -> None:
        target = host_target()
        self.width = target.vector_width
        self.flops_per_iter = 2 * self.width * FMA_CHAINS
        self.code = LoadedCode(emit_object(_fma_module(self.width), target, 2), target, shared=True)
        self.fn = _FMA_PROTO(self.code.address("lmc_probe_fma"))


@functools.cache
def _fma_probe() -> _FmaProbe:
    """Compiled once per process."""
    return _FmaProbe()


@functools.cache
def measure_peak_gflops(threads: int, seconds: float = 0.02, repeats: int = 5) -> float:
    """Peak float32 GFLOP/s (an FMA is 2 FLOPs) of ``threads`` threads each
    running independent vector FMA chains at the host's vector width for
    about ``seconds``: the fastest of ``repeats`` concurrent runs (a peak:
    slower runs are other work on the machine). Cached per process and
    thread count: it is the machine's, not the kernel's."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    pr = _fma_probe()
    outs = np.zeros(threads * 16, np.float32)
    out_base = outs.ctypes.data
    t0 = time.perf_counter()
    pr.fn(100_000, out_base)
    per_iter = max(time.perf_counter() - t0, 1e-6) / 100_000
    iters = max(10_000, int(seconds / per_iter))
    rounds = repeats + 1  # the first round warms up (frequency) and is not counted
    start = threading.Barrier(threads)
    spans = np.zeros((rounds, threads, 2))

    def work(t: int) -> None:
        # each worker times itself: a main thread that only waits may be
        # descheduled past the whole round and measure nothing
        for r in range(rounds):
            start.wait()
            spans[r, t, 0] = time.perf_counter()
            pr.fn(iters, out_base + t * 64)
            spans[r, t, 1] = time.perf_counter()

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    times = spans[1:, :, 1].max(axis=1) - spans[1:, :, 0].min(axis=1)
    return iters * pr.flops_per_iter * threads / float(times.min()) / 1e9


# --- int8 peak: the unit the integer GEMMs use -------------------------------------------------------
#: tile products per block of the AMX probe (4 accumulators x this many rounds on
#: the same 2 A and 2 B tiles, straight-line: the tiles stay in registers)
AMX_ROUNDS = 32
#: independent vpdpbusd chains of the VNNI probe (latency 5 x 2 ports, and some)
VNNI_CHAINS = 12
_INT8_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)


def _amx_module() -> tuple[ir.Module, int]:
    """``void lmc_probe_int8(i64 iters, i8* ab, i32* out)``: per iteration 4
    C tiles from zero, AMX_ROUNDS x 4 ``tdpbsud`` of 2 A by 2 B tiles (16 x
    64 bytes each, at ab), the sums stored at out (so nothing is dead).
    Returns the module and the int8 operations (2 per multiply-add) per
    iteration."""
    from . import amx

    m = ir.Module(name="lmc_probe_int8")
    fn = ir.Function(m, ir.FunctionType(VOID, [I64, ir.PointerType(ir.IntType(8)), ir.PointerType(ir.IntType(32))]),
                     "lmc_probe_int8")
    fn.attributes.add("nounwind")
    iters, ab, out = fn.args

    class _KB:   # what the amx helpers need of a kernel builder
        module = m
        b: ir.IRBuilder

        @staticmethod
        def gep(p, off):
            return _KB.b.gep(p, [ir.Constant(I64, off) if isinstance(off, int) else off])

    entry, head, body, done = (fn.append_basic_block(s) for s in ("entry", "head", "body", "done"))
    kb = _KB()
    b = _KB.b = ir.IRBuilder(entry)
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64, "i")
    i.add_incoming(ir.Constant(I64, 0), entry)
    b.cbranch(b.icmp_signed("<", i, iters), body, done)
    b.position_at_end(body)
    tiles = [amx.tile_load(kb, 16, 64, kb.gep(ab, 1024 * t), 64) for t in range(4)]
    cs = [amx.tile_zero(kb, 16, 64) for _ in range(4)]
    for _ in range(AMX_ROUNDS):
        cs = [amx.dot_signed_unsigned(kb, 16, 64, c, tiles[q // 2], tiles[2 + q % 2]) for q, c in enumerate(cs)]
    o8 = b.bitcast(out, ir.PointerType(ir.IntType(8)))
    for q, c in enumerate(cs):
        amx.tile_store(kb, 16, 64, kb.gep(o8, 1024 * q), 64, c)
    i.add_incoming(b.add(i, ir.Constant(I64, 1)), body)
    b.branch(head)
    b.position_at_end(done)
    amx.tile_release(kb)
    b.ret_void()
    return m, 2 * 16 * 16 * 64 * 4 * AMX_ROUNDS


def _vnni_module(width: int) -> tuple[ir.Module, int]:
    """The same signature on ``vpdpbusd``: VNNI_CHAINS independent chains of
    int32 lanes, 64 iterations a block, the lanes stored at out."""
    m = ir.Module(name="lmc_probe_int8")
    i32, i8 = ir.IntType(32), ir.IntType(8)
    fn = ir.Function(m, ir.FunctionType(VOID, [I64, ir.PointerType(i8), ir.PointerType(i32)]), "lmc_probe_int8")
    fn.attributes.add("nounwind")
    iters, ab, out = fn.args
    vi = ir.VectorType(i32, width)
    name = "llvm.x86.avx512.vpdpbusd.512" if width == 16 else "llvm.x86.avx512.vpdpbusd.256"
    dp = ir.Function(m, ir.FunctionType(vi, [vi, vi, vi]), name)
    entry, head, body, done = (fn.append_basic_block(s) for s in ("entry", "head", "body", "done"))
    b = ir.IRBuilder(entry)
    wv = b.load(b.bitcast(ab, ir.PointerType(vi)), align=1)
    xv = b.load(b.bitcast(b.gep(ab, [ir.Constant(I64, 64)]), ir.PointerType(vi)), align=1)
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64, "i")
    i.add_incoming(ir.Constant(I64, 0), entry)
    accs = []
    for _ in range(VNNI_CHAINS):
        a = b.phi(vi)
        a.add_incoming(ir.Constant(vi, [0] * width), entry)
        accs.append(a)
    b.cbranch(b.icmp_signed("<", i, iters), body, done)
    b.position_at_end(body)
    new = list(accs)
    for _ in range(64):
        new = [b.call(dp, [a, wv, xv]) for a in new]
    i.add_incoming(b.add(i, ir.Constant(I64, 1)), body)
    for a, v in zip(accs, new):
        a.add_incoming(v, body)
    b.branch(head)
    b.position_at_end(done)
    total = accs[0]
    for a in accs[1:]:
        total = b.add(total, a)
    b.store(total, b.bitcast(out, ir.PointerType(vi)), align=1)
    b.ret_void()
    return m, 2 * 4 * width * VNNI_CHAINS * 64


class _Int8Probe:
    def __init__(self) -> None:
        target = host_target()
        from .target import vnni_width

        if target.amx:
            self.unit = "amx"
            mod, self.ops_per_iter = _amx_module()
        elif vnni_width(target.vector_width, target):
            self.unit = "vnni"
            mod, self.ops_per_iter = _vnni_module(vnni_width(target.vector_width, target))
        else:
            raise RuntimeError(f"no int8 dot-product unit on {target.cpu}")
        self.code = LoadedCode(emit_object(mod, target, 2), target, shared=True)
        self.fn = _INT8_PROTO(self.code.address("lmc_probe_int8"))


@functools.cache
def _int8_probe() -> _Int8Probe:
    return _Int8Probe()


def int8_unit() -> str | None:
    """The unit the int8 probe (and the integer GEMMs) use: "amx", "vnni" or None."""
    try:
        return _int8_probe().unit
    except RuntimeError:
        return None


def measure_int8_peak(threads: int, seconds: float = 0.02, repeats: int = 3) -> float:
    """Int8 GOPS (a multiply-add is 2 operations) of ``threads`` threads each
    running the int8 unit of the integer GEMMs (AMX tiles where this process
    has them, else ``vpdpbusd``) on operands in registers for about
    ``seconds``: the fastest of ``repeats`` concurrent runs. Not cached: the
    bench alternates it with the workload it judges."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    pr = _int8_probe()
    ab = np.ones(4096, np.int8)
    outs = np.zeros(threads * 1024, np.int32)
    t0 = time.perf_counter()
    pr.fn(50, ab.ctypes.data, outs.ctypes.data)
    per_iter = max(time.perf_counter() - t0, 1e-7) / 50
    iters = max(20, int(seconds / per_iter))
    rounds = repeats + 1
    start = threading.Barrier(threads)
    spans = np.zeros((rounds, threads, 2))

    def work(t: int) -> None:
        for r in range(rounds):
            start.wait()
            spans[r, t, 0] = time.perf_counter()
            pr.fn(iters, ab.ctypes.data, outs.ctypes.data + t * 4096)
            spans[r, t, 1] = time.perf_counter()

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    times = spans[1:, :, 1].max(axis=1) - spans[1:, :, 0].min(axis=1)
    return iters * pr.ops_per_iter * threads / float(times.min()) / 1e9
