"""Helpers for writing kernels with llvmlite: loops, thread shares, vectors.

Every kernel has one ABI, so the step function can call any of them and a
test (or ``lmc kernel``) can call one on its own through ctypes:

    void kernel(i8* out, i8* in0, i8* in1, i8* in2, i8* in3,
                i64 pos, i64 T, i64 tid, i64 nthreads, i8* scratch)

``out``/``inN`` point at the operands (weights: their stored bytes), ``pos``
and ``T`` are the dynamic position and chunk length, ``tid``/``nthreads`` say
which share of the rows this call computes, ``scratch`` is per-thread space.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import llvmlite.ir as ir

from ir.types import Dim

from .simd import shuffle, undef, vconst
from .target import Target, host_target

F32 = ir.FloatType()
F64 = ir.DoubleType()
I8 = ir.IntType(8)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
I8P = ir.PointerType(I8)
F32P = ir.PointerType(F32)
VOID = ir.VoidType()
N_INPUTS = 6  # attention with exact rows: q, K, V, pos, exact K, exact V
KERNEL_TYPE = ir.FunctionType(VOID, [I8P] * (1 + N_INPUTS) + [I64] * 4 + [I8P])
#: fast-math flags, for code whose bits may vary with LLVM's choices (the bandwidth probe's sum);
#: no kernel uses them: a kernel's numbers must not depend on what surrounds its arithmetic
FAST = ("reassoc", "nsz", "arcp", "contract", "afn")  # not nnan/ninf: -inf masks and overflow to inf must work


def i64(n: int) -> ir.Constant:
    return ir.Constant(I64, int(n))


def as_i64(n: int | ir.Value) -> ir.Value:
    """An index that may be known at compile time (an int) or only at run time (a value)."""
    return n if isinstance(n, ir.Value) else i64(n)


def f32c(x: float) -> ir.Constant:
    return ir.Constant(F32, float(x))


def _intrinsic_suffix(t: ir.Type) -> str:
    """LLVM's overload suffix for a type: f32, i64, v8f32 ..."""
    if isinstance(t, ir.VectorType):
        return f"v{t.count}{_intrinsic_suffix(t.element)}"
    return t.intrinsic_name


class KernelBuilder:
    """An IRBuilder positioned in a fresh kernel function, plus helpers."""

    def __init__(self, module: ir.Module, name: str, vector_width: int, target: "Target | None" = None) -> None:
        self.module = module
        #: the CPU the kernel is compiled for: emitters ask it, never the host, what instructions
        #: they may use, so one process can compile for other CPUs (tests do)
        self.target = target or host_target()
        self.fn = ir.Function(module, KERNEL_TYPE, name)
        self.fn.linkage = "internal"
        self.fn.attributes.add("nounwind")
        a = self.fn.args
        a[0].add_attribute("noalias")
        self.out_raw, self.in_raw = a[0], list(a[1:1 + N_INPUTS])
        self.pos, self.T, self.tid, self.nthreads, self.scratch = a[1 + N_INPUTS:]
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.vw = vector_width
        #: the code generator parameters an emitter chose (rows per tile,
        #: unroll ...), recorded for ``lmc kernel``; the emitters read
        #: overrides from optional kernel attributes of the same names
        self.tuning: dict[str, int] = {}

    # --- pointers ---------------------------------------------------------
    def fptr(self, raw: ir.Value) -> ir.Value:
        return self.b.bitcast(raw, F32P)

    def out_f32(self) -> ir.Value:
        return self.fptr(self.out_raw)

    def in_f32(self, i: int) -> ir.Value:
        return self.fptr(self.in_raw[i])

    def gep(self, ptr: ir.Value, idx: ir.Value | int) -> ir.Value:
        if isinstance(idx, int):
            idx = i64(idx)
        return self.b.gep(ptr, [idx], inbounds=True)

    def load(self, ptr: ir.Value, idx: ir.Value | int) -> ir.Value:
        return self.b.load(self.gep(ptr, idx), align=4)

    def store(self, val: ir.Value, ptr: ir.Value, idx: ir.Value | int) -> None:
        self.b.store(val, self.gep(ptr, idx), align=4)

    # --- vectors ------------------------------------------------------------
    def vtype(self, width: int | None = None, elem: ir.Type = F32) -> ir.VectorType:
        return ir.VectorType(elem, width or self.vw)

    def vload(self, ptr: ir.Value, idx: ir.Value | int, width: int | None = None) -> ir.Value:
        vt = self.vtype(width, ptr.type.pointee)
        p = self.b.bitcast(self.gep(ptr, idx), ir.PointerType(vt))
        return self.b.load(p, align=1)

    def vstore(self, val: ir.Value, ptr: ir.Value, idx: ir.Value | int) -> None:
        p = self.b.bitcast(self.gep(ptr, idx), ir.PointerType(val.type))
        self.b.store(val, p, align=1)

    def splat(self, x: ir.Value, width: int | None = None) -> ir.Value:
        vt = self.vtype(width, x.type)
        v = self.b.insert_element(undef(vt), x, i64(0))
        return self.b.shuffle_vector(v, undef(vt), vconst(I32, (0,) * vt.count))

    def vzero(self, width: int | None = None) -> ir.Constant:
        vt = self.vtype(width)
        return vconst(vt.element, (0.0,) * vt.count)

    def _reduce(self, v: ir.Value, combine) -> ir.Value:
        """Fold a vector to its first lane by halving shuffles (log2 steps)."""
        n = v.type.count
        while n > 1:
            half = n // 2
            lo = self.b.shuffle_vector(v, v, vconst(I32, range(half)))
            hi = self.b.shuffle_vector(v, v, vconst(I32, range(half, n)))
            v = combine(lo, hi)
            n = half
        return self.b.extract_element(v, i64(0))

    def hsum(self, v: ir.Value) -> ir.Value:
        """Horizontal sum by a fixed halving tree of strict adds: LLVM may not
        reorder it, so a dot product ends with the same bits in every kernel
        that sums it this way, whatever surrounds it."""
        return self._reduce(v, lambda a, b: self.b.fadd(a, b))

    def hmax(self, v: ir.Value) -> ir.Value:
        return self._reduce(v, lambda a, b: self.intrinsic("llvm.maxnum", [a, b]))

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        return self.intrinsic("llvm.fma", [a, b, c])

    def mul_add(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a*b + c, rounded once where the target has fused multiply-adds (an
        explicit ``llvm.fma``), else a strict multiply then add. Not
        ``llvm.fmuladd``, whose fusing is LLVM's choice: kernels that must
        give the same bits (a decode step and a batch of its rows) use this."""
        if self.target.has_fma:
            return self.intrinsic("llvm.fma", [a, b, c])
        return self.b.fadd(self.b.fmul(a, b), c)

    # --- math -----------------------------------------------------------------
    def intrinsic(self, name: str, args: Sequence[ir.Value]) -> ir.Value:
        """Call an intrinsic overloaded on its first operand's type and
        returning that type (exp, sqrt, maxnum, fma, fmuladd, floor, cos ...),
        scalar or vector. (llvmlite's declare_intrinsic cannot name vector
        overloads and declares 2-operand ones with one parameter.)"""
        t = args[0].type
        full = f"{name}.{_intrinsic_suffix(t)}"
        fn = self.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(t, [a.type for a in args]), full)
        return self.b.call(fn, list(args))

    def prefetch(self, ptr: ir.Value, nbytes: int = 1, locality: int = 3) -> None:
        """Ask for the bytes [ptr, ptr + nbytes) (ptr an i8*) ahead of their
        use, a cache line at a time: reads, kept in every cache level
        (``locality`` 3), or in L2 and below (2). A prefetch never faults,
        so the span may run past the buffer."""
        name = "llvm.prefetch.p0"
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [ptr.type, I32, I32, I32]), name)
        for off in range(0, max(1, nbytes), 64):
            self.b.call(fn, [self.gep(ptr, off) if off else ptr, ir.Constant(I32, 0), ir.Constant(I32, locality),
                             ir.Constant(I32, 1)])

    # Strict IEEE operations (no fast-math flags): LLVM may not reassociate, contract or
    # approximate them, so the same operations give the same bits in every kernel that writes
    # them (a decode step and a batch of its rows), vectorized or not, on every CPU; where a
    # fused multiply-add is wanted it is written (``mul_add``).
    def fadd(self, a, b):
        return self.b.fadd(a, b)

    def fmul(self, a, b):
        return self.b.fmul(a, b)

    def fsub(self, a, b):
        return self.b.fsub(a, b)

    def fdiv(self, a, b):
        return self.b.fdiv(a, b)

    def tanh(self, u: ir.Value) -> ir.Value:
        """tanh(u) for a float or a vector, inline so loops over it stay
        vectorised (Cephes' tanhf): for |u| < 0.625 an odd polynomial, where
        1 - 2 / (exp(2u) + 1) would lose the small result to cancellation;
        beyond, that formula, safe for large |u| (exp saturates and the
        quotient goes to 0)."""
        w = u.type.count if isinstance(u.type, ir.VectorType) else None
        c = lambda v: fconst(v, w)  # noqa: E731
        z = self.fmul(u, u)
        p = c(-5.70498872745e-3)
        for k in (2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1):
            p = fmuladd(self, p, z, c(k))
        small = fmuladd(self, self.fmul(p, z), u, u)
        e2 = exp_poly(self, self.fmul(c(2.0), u))
        big = self.fsub(c(1.0), self.fdiv(c(2.0), self.fadd(e2, c(1.0))))
        near0 = self.b.fcmp_ordered("<", self.intrinsic("llvm.fabs", [u]), c(0.625))
        return self.b.select(near0, small, big)

    def sqrt(self, x: ir.Value) -> ir.Value:
        return self.intrinsic("llvm.sqrt", [x])

    def fmax(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.intrinsic("llvm.maxnum", [a, b])

    # --- integers and control flow --------------------------------------------------
    def imin(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(self.b.icmp_signed("<", a, b), a, b)

    def imax(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(self.b.icmp_signed(">", a, b), a, b)

    def dim(self, d: Dim) -> ir.Value:
        """A shape dimension as an i64: a constant, or the dynamic ``T``."""
        if isinstance(d, int):
            return i64(d)
        if d == "T":
            return self.T
        raise ValueError(f"unknown symbolic dim {d!r}")

    def rows_of(self, shape: tuple[Dim, ...]) -> ir.Value:
        """Number of rows (all leading dims) of an activation."""
        n: ir.Value = i64(1)
        for d in shape[:-1]:
            n = self.b.mul(n, self.dim(d))
        return n

    @staticmethod
    def static_rows(shape: tuple[Dim, ...]) -> int | None:
        """The rows of an activation when its shape fixes them (a decode
        step's ``(dim,)``: 1), else None: a kernel need not emit paths
        for more rows than it can be called with."""
        n = 1
        for d in shape[:-1]:
            if not isinstance(d, int):
                return None
            n *= d
        return n

    def thread_share(self, n: ir.Value | int) -> tuple[ir.Value, ir.Value]:
        """[lo, hi) of ``n`` items for this thread: n*tid/nt .. n*(tid+1)/nt."""
        n = i64(n) if isinstance(n, int) else n
        lo = self.b.sdiv(self.b.mul(n, self.tid), self.nthreads)
        hi = self.b.sdiv(self.b.mul(n, self.b.add(self.tid, i64(1))), self.nthreads)
        return lo, hi

    @contextlib.contextmanager
    def loop(self, start: ir.Value | int, stop: ir.Value | int, step: int | ir.Value = 1,
             name: str = "i") -> Iterator[ir.Value]:
        """``for (i = start; i < stop; i += step)``; the body is what the
        with-block emits."""
        with self.loop_carry(start, stop, [], step=step, name=name) as (i, _, _set):
            yield i

    @contextlib.contextmanager
    def loop_carry(self, start, stop, inits: list[ir.Value], step: int | ir.Value = 1, name: str = "i"):
        """A loop with values carried between iterations (accumulators). The
        body receives (i, carried) and must call ``set(new_values)``. A
        positive ``step`` may be a run-time value (a strided thread share)."""
        b = self.b
        start = i64(start) if isinstance(start, int) else start
        stop = i64(stop) if isinstance(stop, int) else stop
        pre = b.block
        head = b.append_basic_block(f"{name}.head")
        body = b.append_basic_block(f"{name}.body")
        done = b.append_basic_block(f"{name}.done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64, name)
        i.add_incoming(start, pre)
        phis = []
        for v in inits:
            p = b.phi(v.type)
            p.add_incoming(v, pre)
            phis.append(p)
        b.cbranch(b.icmp_signed("<", i, stop), body, done)
        b.position_at_end(body)
        box: dict[str, list[ir.Value]] = {}
        yield i, phis, (lambda vals: box.__setitem__("v", list(vals)))
        nxt = b.add(i, as_i64(step))
        end = b.block
        i.add_incoming(nxt, end)
        for p, v in zip(phis, box.get("v", phis)):
            p.add_incoming(v, end)
        b.branch(head)
        b.position_at_end(done)
        # after the loop the phis hold the final values (plain loops leave
        # the previous loop_carry's values in place)
        if inits:
            self.last_carry = phis

    @contextlib.contextmanager
    def if_then(self, cond: ir.Value) -> Iterator[None]:
        with self.b.if_then(cond):
            yield

    def finish(self) -> ir.Function:
        self.b.ret_void()
        return self.fn



# --- shared helpers (norm/rope/attention kernels) ------------------------------------
def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is <= ``cap``: a vector
    width that covers a constant length with no scalar tail."""
    w = 1
    while w * 2 <= cap and n % (w * 2) == 0:
        w *= 2
    return w


def fconst(value: float, width: int | None = None) -> ir.Constant:
    """A float32 constant, or a splatted <width x float> one."""
    if width is None:
        return f32c(value)
    return vconst(F32, (float(value),) * width)


def const_f32_array(kb: KernelBuilder, name: str, values) -> ir.Value:
    """An internal constant float32 table in the module; returns a float* to it.
    ``name`` is prefixed with the kernel's name so tables do not collide."""
    vals = [float(v) for v in values]
    at = ir.ArrayType(F32, len(vals))
    g = ir.GlobalVariable(kb.module, at, f"{kb.fn.name}.{name}")
    g.linkage = "internal"
    g.global_constant = True
    g.initializer = ir.Constant(at, vals)
    g.align = 64
    return kb.b.bitcast(g, F32P)


def memcpy(kb: KernelBuilder, dst: ir.Value, src: ir.Value, nbytes: ir.Value) -> None:
    """llvm.memcpy on i8* pointers (non-overlapping)."""
    fn = kb.module.declare_intrinsic("llvm.memcpy", [I8P, I8P, I64])
    kb.b.call(fn, [dst, src, nbytes, ir.Constant(ir.IntType(1), 0)])


def fmuladd(kb: KernelBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a*b + c: ``kb.mul_add`` (an explicit FMA where the target has one)."""
    return kb.mul_add(a, b, c)


def hsum_many(kb: KernelBuilder, vs: Sequence[ir.Value]) -> ir.Value:
    """Horizontal sums of n vectors (n a power of two, all one power-of-two
    width) as ONE <n x float>: lane i = sum of vs[i]. A shuffle/add tree that
    folds the vectors into each other, cheaper than n separate hsums."""
    vs = list(vs)
    n = len(vs)
    assert n >= 1 and n & (n - 1) == 0, n
    width = vs[0].type.count
    seg = width  # each vector holds width/seg segments (one per input), in order
    while len(vs) > 1:
        nxt = []
        for x, y in zip(vs[0::2], vs[1::2]):
            w = x.type.count
            if seg > 1:  # fold each segment of x and y in half, keep the width
                h = seg // 2
                lo = [s + i for s in range(0, w, seg) for i in range(h)]
                lo = lo + [w + k for k in lo]
                hi = [k + h for k in lo]
                nxt.append(kb.fadd(shuffle(kb.b, x, y, lo), shuffle(kb.b, x, y, hi)))
            else:  # fully reduced lanes: concatenate
                nxt.append(shuffle(kb.b, x, y, list(range(2 * w))))
        vs = nxt
        if seg > 1:
            seg //= 2
    v = vs[0]
    while seg > 1:  # fold the segments of the last vector in half
        w, h = v.type.count, seg // 2
        lo = [s + i for s in range(0, w, seg) for i in range(h)]
        hi = [k + h for k in lo]
        v = kb.fadd(shuffle(kb.b, v, v, lo), shuffle(kb.b, v, v, hi))
        seg = h
    return v


def exp_poly(kb: KernelBuilder, x: ir.Value) -> ir.Value:
    """exp(x) for a float or <n x float>, inline (no libm call, so it stays
    vectorised): Cody-Waite reduction x = n ln2 + r and Cephes' degree-6
    polynomial, ~1-2 ulp. Inputs are clamped to [-87.33, 88.3] (so 2^n stays a
    normal float): results below ~1.2e-38 come out as ~1.2e-38 instead of 0
    or a denormal, and overflow saturates at ~2.2e38 instead of inf."""
    b = kb.b
    w = x.type.count if isinstance(x.type, ir.VectorType) else None
    c = lambda v: fconst(v, w)  # noqa: E731
    it = ir.VectorType(I32, w) if w else I32
    x = kb.intrinsic("llvm.minnum", [kb.intrinsic("llvm.maxnum", [x, c(-87.33)]), c(88.3)])
    n = kb.intrinsic("llvm.floor", [fmuladd(kb, x, c(1.44269504088896341), c(0.5))])
    r = fmuladd(kb, n, c(-0.693359375), x)
    r = fmuladd(kb, n, c(2.12194440e-4), r)
    p = c(1.9875691500e-4)
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fmuladd(kb, p, r, c(k))
    r2 = b.fmul(r, r)
    p = fmuladd(kb, p, r2, b.fadd(r, c(1.0)))
    ni = b.fptosi(n, it)
    bits = b.shl(b.add(ni, ir.Constant(it, [127] * w) if w else ir.Constant(I32, 127)),
                 ir.Constant(it, [23] * w) if w else ir.Constant(I32, 23))
    return b.fmul(p, b.bitcast(bits, x.type))
