"""Matrix products and embedding lookups: ``matmul`` (F32 weight),
``qmatmul`` (a stored, quantized weight dequantized in registers) and
``embedding``.

Operands (kernel ABI, see ``emit.py``)
--------------------------------------
* matmul / qmatmul: ``in0`` = activations x, float32 ``[..., K]`` (one row for
  decode, ``T`` rows for prefill); ``in1`` = the weight's stored bytes,
  ``[N, K]`` row-major as in the model file; ``out`` = float32 ``[..., N]``.
* embedding: ``in0`` = the table's stored bytes ``[V, D]``, ``in1`` = int32
  token ids of shape ``()`` or ``(T,)``; ``out`` = float32 ``[..., D]``.

Threads split the N weight rows (matmul) or the tokens (embedding) with
``kb.thread_share``; a call computes only its own share.

Structure
---------
A weight layout is a :class:`Decoder`: given a row, a column and a list of
vector widths it emits the loads that turn stored bytes into float32 vectors
of weights, in registers. Nothing else in this file knows about layouts, so a
new layout (GGUF Q8_0, Q4_K ... with their interleaved block scales) is one
more decoder class; the loop structure below does not change:

* rows ``[lo, hi)`` of this thread are taken ``R`` at a time (then one at a
  time for the remainder); tokens ``C`` at a time (then one at a time);
* a tile of ``R`` rows x ``C`` tokens runs over K in steps of ``S`` columns
  (``decoder.step``) with ``R*C*U`` vector accumulators (``U`` independent
  accumulators per dot product when ``C == 1``, so the FMAs pipeline); the
  x vectors of a step are loaded once and shared by the ``R`` rows, the
  decoded weight vectors are shared by the ``C`` tokens;
* the last ``K % S`` columns are a static tail: whole vectors, then narrower
  power-of-two vectors down to one lane;
* each dot product ends with one horizontal sum.

Decode (one token, bandwidth-bound) uses ``R = 4`` rows (rows of at least
``_LONG_ROW`` columns; shorter ones go one at a time with twice the unroll)
and ``C = 1``: F32 with 2 vectors per row per step (8 accumulators); planar
Q8 with a step of up to 4 vectors inside one group, whose scale multiplies
the step's partial dot product once (``defer``) instead of every weight
vector. Prefill uses
``R x C = 4 x 4`` register tiles (3 x 3 on 16-register AVX2) and walks all
token tiles for a block of rows before moving on, so that block's weights
stay in L1 while the activations stream through; a K of 2048 or more is cut
into chunks of ``K_CHUNK`` columns (partial sums are added in ``out``) so a
chunk of activations stays in L2.

Rows of a batch of decode rows (the ``decode_rows`` attribute, set by
``passes/int_dot``) take decode's R and U, no K chunks, and tiles of
``_DECODE_TOKENS`` tokens whose dot products each keep the decode step's
accumulators and deferred scales (``exact``): every row is summed in the
decode step's order, bit for bit its numbers, while each decoded weight
vector serves all the tokens of the tile.

R, C and U are defaults: the optional kernel attributes ``rows``,
``tile_tokens`` (prefill) and ``unroll`` replace them. Graphs never set
them; ``lmc kernel`` does, to try variants without editing this file.

The one layout that does not fit the "blocks never straddle rows" rule is
llama2.c's planar Q8 when ``K % group != 0``: a group of ``g`` values may
cover the end of one row and the start of the next. That case has its own
row-at-a-time loop (:func:`_planar_rowwise_tile`), which visits every group
overlapping the row's flat element range ``[r*K, r*K + K)``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import llvmlite.ir as ir

from ..emit import F32, F32P, I32, KernelBuilder, f32c, i64
from ..kernels import KernelSig
from ..simd import HALF

if TYPE_CHECKING:
    from ir.quant import QuantType
from .common import PREFETCH_BYTES, as_int, out_rows, pow2_pieces, tuned

#: tile shapes (rows x tokens) for prefill, by vector width (register budget)
_PREFILL_TILE = {16: (4, 4), 8: (3, 3), 4: (4, 4)}
#: rows per tile for decode (one token)
_DECODE_ROWS = 4
#: tokens per tile for a batch of decode rows (each with decode's sums)
_DECODE_TOKENS = 4
_LONG_ROW = 8192  # columns; measured on znver4: below this R=1 reads faster
#: prefill splits K into chunks of this many columns when K >= 2 chunks
K_CHUNK = 1024


# --- small helpers ---------------------------------------------------------------
def _muladd(kb: KernelBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a*b + c, an explicit FMA where the target has one (``kb.mul_add``):
    a dot product's bits must not depend on what LLVM chooses to fuse."""
    return kb.mul_add(a, b, c)


# --- decoders: stored bytes -> float32 vectors in registers -----------------------------
class Decoder:
    """One weight layout. ``decode`` emits float32 vectors of the weights
    ``W[row, col + off]`` for consecutive pieces of the given widths.

    ``step``: columns per main-loop iteration; the loop guarantees that
    ``col`` is a multiple of ``step`` there (tails pass a constant ``col``).
    A block format whose scales live once per block should make ``step`` a
    multiple or a divisor of its block so that ``decode`` can load a block's
    scales once per call."""

    #: False when blocks may straddle rows (then the row-wise path is used)
    row_aligned = True
    #: vectors per row per step in decode (matvec): independent accumulators
    #: (or, for a deferred scale, the length of the partial dot product)
    decode_unroll = 2

    def __init__(self, kb: KernelBuilder, raw: ir.Value, n: int, k: int, qt: "QuantType | None" = None) -> None:
        """``qt``: the weight type's row of ``ir.quant.table`` (block decoders read their offsets there)."""
        self.kb, self.raw, self.n, self.k = kb, raw, n, k
        self.qt = qt

    def step(self, unroll: int) -> int:
        return self.kb.vw * unroll

    def decode(self, row: ir.Value, col: ir.Value, widths: list[int], align: int,
               defer: bool = False) -> tuple[list[ir.Value], ir.Value | None]:
        """Weights W[row, col + off] as float32 vectors of ``widths``. ``col``
        is a multiple of ``align`` (0: col is 0). With ``defer`` a decoder may
        return unscaled vectors and one scalar scale for all of them, which
        the caller applies to the finished partial dot product (one multiply
        per call instead of one per vector); otherwise the scale is None."""
        raise NotImplementedError


class F32Decoder(Decoder):
    def __init__(self, kb, raw, n, k, qt=None):
        super().__init__(kb, raw, n, k, qt)
        self.w = kb.fptr(raw)

    def decode(self, row, col, widths, align, defer=False):
        kb, b = self.kb, self.kb.b
        base = b.add(b.mul(row, i64(self.k)), col)
        out, off = [], 0
        for w in widths:
            out.append(kb.vload(self.w, b.add(base, i64(off)), w))
            off += w
        return out, None


class F16Decoder(Decoder):
    def __init__(self, kb, raw, n, k, qt=None):
        super().__init__(kb, raw, n, k, qt)
        self.w = kb.b.bitcast(raw, ir.PointerType(HALF))

    def decode(self, row, col, widths, align, defer=False):
        kb, b = self.kb, self.kb.b
        base = b.add(b.mul(row, i64(self.k)), col)
        out, off = [], 0
        for w in widths:
            h = kb.vload(self.w, b.add(base, i64(off)), w)
            out.append(b.fpext(h, kb.vtype(w)))
            off += w
        return out, None


class PlanarQ8Decoder(Decoder):
    """llama2.c v2 planar Q8: N*K int8 values, then N*K/g float32 scales;
    value e = q[e] * s[e // g]. Used when K % g == 0 (groups never straddle
    rows) and g divides or is a multiple of the vector width, so every vector
    piece lies inside one group or covers whole groups."""

    decode_unroll = 4

    def __init__(self, kb, raw, n, k, group):
        super().__init__(kb, raw, n, k)
        self.g = group
        self.q = raw  # i8*
        self.s = kb.b.bitcast(kb.gep(raw, n * k), F32P)

    def step(self, unroll):
        # a step must lie inside one group or cover whole groups
        s = self.kb.vw * unroll
        while s > self.kb.vw and s % self.g and self.g % s:
            s -= self.kb.vw
        return s

    @staticmethod
    def fits(k: int, g: int, vw: int) -> bool:
        return k % g == 0 and (g % vw == 0 or vw % g == 0)

    def decode(self, row, col, widths, align, defer=False):
        kb, b, g = self.kb, self.kb.b, self.g
        e0 = b.add(b.mul(row, i64(self.k)), col)      # flat index of W[row, col]
        grp0 = b.udiv(e0, i64(g))                     # its group (row*K is a multiple of g)
        span = sum(widths)
        if align and align % g:
            # g is a multiple of align: [col, col + align) lies in one group
            assert g % align == 0 and span <= align, (g, align, widths)
        one_group = span <= g if (align == 0 or align % g == 0) else True
        shared_scale = kb.load(self.s, grp0) if one_group else None
        out, off = [], 0
        for w in widths:
            qv = b.sitofp(kb.vload(self.q, b.add(e0, i64(off)), w), kb.vtype(w))
            if shared_scale is not None and defer:
                out.append(qv)
                off += w
                continue
            if shared_scale is not None:
                sv = kb.splat(shared_scale, w)
            elif w <= g:
                # col is a multiple of g here: the piece's group is static
                assert off % g == 0 or (off // g == (off + w - 1) // g), (off, w, g)
                sv = kb.splat(kb.load(self.s, b.add(grp0, i64(off // g))), w)
            else:
                # a wide piece covers w/g whole groups: w/g scales, each repeated g times
                assert off % g == 0 and w % g == 0, (off, w, g)
                sc = kb.vload(self.s, b.add(grp0, i64(off // g)), w // g)
                sv = b.shuffle_vector(sc, sc, ir.Constant(ir.VectorType(I32, w), [i // g for i in range(w)]))
            out.append(b.fmul(qv, sv))
            off += w
        return out, (shared_scale if defer else None)


# --- the tiled dot-product loop ----------------------------------------------------------
def _tile(kb: KernelBuilder, dec: Decoder, x: ir.Value, out: ir.Value, r0: ir.Value, R: int,
          t0: ir.Value, C: int, n: int, k: int, U: int,
          k0: ir.Value | int = 0, klen: int | None = None, first: ir.Value | None = None,
          exact: bool = False, ahead: int = 0) -> None:
    """out[t, r] = sum_c W[r, c] * x[t, c] for r in r0..r0+R-1, t in t0..t0+C-1,
    over the columns c in [k0, k0 + klen) (all of K by default). With a K
    chunk, ``first`` (i1) says whether to store the sums or add them to out.
    ``exact``: each token's sums are the one-token (decode) tile's, bit for
    bit, for any C (its accumulators and deferred scales), the decoded
    weights still shared by the C tokens. ``ahead``: bytes ahead of the
    weights in use to prefetch (0: none)."""
    b, vw = kb.b, kb.vw
    S = dec.step(U)
    nvec = S // vw
    one = C == 1 or exact
    nacc = U if one else 1          # independent accumulators per dot product
    klen = k if klen is None else klen
    kmain = klen - klen % S
    assert isinstance(k0, int) or kmain == klen, "a tail needs a constant chunk start"
    k0v = i64(k0) if isinstance(k0, int) else k0
    rows = [b.add(r0, i64(i)) for i in range(R)]
    xrow = [b.mul(b.add(t0, i64(t)), i64(k)) for t in range(C)]

    def at(i: int, t: int, u: int) -> int:
        return (i * C + t) * nacc + u

    accs = [kb.vzero()] * (R * C * nacc)
    if kmain:
        with kb.loop_carry(k0v, b.add(k0v, i64(kmain)), accs, step=S, name="kk") as (col, cur, setv):
            cur = list(cur)
            if ahead:
                _prefetch_rows(kb, dec, rows, col, S, ahead)
            xs = [[kb.vload(x, b.add(xrow[t], b.add(col, i64(j * vw)))) for j in range(nvec)] for t in range(C)]
            for i in range(R):
                ws, sc = dec.decode(rows[i], col, [vw] * nvec, S, defer=("blocks" if one else False))
                if sc is None:
                    for j in range(nvec):
                        for t in range(C):
                            cur[at(i, t, j % nacc)] = _muladd(kb, ws[j], xs[t][j], cur[at(i, t, j % nacc)])
                else:  # one scale per group of vectors: scale each partial dot product once
                    scs = sc if isinstance(sc, list) else [sc]
                    per = nvec // len(scs)
                    for gi, s_ in enumerate(scs):
                        scv = kb.splat(s_)
                        for t in range(C):
                            j0 = gi * per
                            p = b.fmul(ws[j0], xs[t][j0])
                            for j in range(j0 + 1, j0 + per):
                                p = _muladd(kb, ws[j], xs[t][j], p)
                            a_ = at(i, t, gi % nacc)
                            cur[a_] = _muladd(kb, p, scv, cur[a_])
            setv(cur)
        accs = list(kb.last_carry)

    # static tail: klen % S columns at the constant column k0 + kmain
    pieces = pow2_pieces(klen - kmain, vw)
    tails: list[ir.Value | None] = [None] * (R * C)
    if pieces:
        kt = k0 + kmain
        col = i64(kt)
        align = kt & -kt  # col is a multiple of this (0: col is 0)
        xs = []
        for t in range(C):
            off, row = 0, []
            for w in pieces:
                row.append(kb.vload(x, b.add(xrow[t], i64(kt + off)), w))
                off += w
            xs.append(row)
        for i in range(R):
            ws, _ = dec.decode(rows[i], col, pieces, align)
            for j, w in enumerate(pieces):
                for t in range(C):
                    if w == vw:
                        a = at(i, t, j % nacc)
                        accs[a] = _muladd(kb, ws[j], xs[t][j], accs[a])
                    else:
                        p = kb.hsum(b.fmul(ws[j], xs[t][j]))
                        tt = tails[i * C + t]
                        tails[i * C + t] = p if tt is None else b.fadd(tt, p)

    for i in range(R):
        for t in range(C):
            # strict from here on (no reassociation): each token's sum in a fixed order
            v = accs[at(i, t, 0)]
            for u in range(1, nacc):
                v = b.fadd(v, accs[at(i, t, u)])
            s = kb.hsum(v)
            if tails[i * C + t] is not None:
                s = b.fadd(s, tails[i * C + t])
            o = b.add(b.mul(b.add(t0, i64(t)), i64(n)), rows[i])
            if first is not None:  # later K chunks add to the partial sums
                s = b.select(first, s, b.fadd(s, kb.load(out, o)))
            kb.store(s, out, o)


def _prefetch_rows(kb: KernelBuilder, dec: Decoder, rows: list[ir.Value], col: ir.Value, S: int,
                   ahead: int) -> None:
    """Ask for the bytes ``ahead`` past the weights of columns col..col+S-1
    of each row. The hardware prefetcher alone leaves a decode matvec
    latency-bound (on this project's Xeon, 8 of about 30 GB/s for Q4_0)."""
    b = kb.b
    rb, k = dec.row_bytes, dec.k
    for r in rows:
        at = b.add(b.mul(r, i64(rb)), b.udiv(b.mul(col, i64(rb)), i64(k)))
        kb.prefetch(kb.gep(dec.raw, b.add(at, i64(ahead))), S * rb // k)


def _planar_rowwise_tile(kb: KernelBuilder, dec: Decoder, x: ir.Value, out: ir.Value, r: ir.Value,
                         t0: ir.Value, C: int, n: int, k: int, n_out: int) -> None:
    """Planar Q8 where groups may straddle rows (K % g != 0) or do not fit
    the vector width: for row r visit every group j overlapping the flat
    range [r*K, r*K + K), dot its overlap [lo, hi) (in columns) with x, and
    scale the partial sum by s[j]."""
    b, g = kb.b, dec.g
    q = dec.raw
    s = kb.b.bitcast(kb.gep(dec.raw, n * k), F32P)
    wv = 1
    while wv * 2 <= min(g, kb.vw):
        wv *= 2  # vector width for the inside of a group
    base = b.mul(r, i64(k))
    j0 = b.udiv(base, i64(g))
    j1 = b.add(b.udiv(b.add(base, i64(k - 1)), i64(g)), i64(1))
    xrow = [b.mul(b.add(t0, i64(t)), i64(k)) for t in range(C)]
    zv, zs = kb.vzero(wv), f32c(0.0)
    with kb.loop_carry(j0, j1, [zv] * C + [zs] * C, name="grp") as (j, cur, setv):
        acc_v, acc_s = list(cur[:C]), list(cur[C:])
        jg = b.mul(j, i64(g))
        lo = b.sub(kb.imax(jg, base), base)
        hi = b.sub(kb.imin(b.add(jg, i64(g)), b.add(base, i64(k))), base)
        nv = b.sdiv(b.sub(hi, lo), i64(wv))
        vend = b.add(lo, b.mul(nv, i64(wv)))
        # whole vectors inside the group
        with kb.loop_carry(lo, vend, [zv] * C, step=wv, name="gv") as (c, pv, setp):
            qv = b.sitofp(kb.vload(q, b.add(base, c), wv), kb.vtype(wv))
            setp([_muladd(kb, qv, kb.vload(x, b.add(xrow[t], c), wv), pv[t]) for t in range(C)])
        pv = list(kb.last_carry)
        # the rest one by one
        with kb.loop_carry(vend, hi, [zs] * C, name="gs") as (c, ps, setp):
            qs = b.sitofp(kb.load(q, b.add(base, c)), F32)
            setp([_muladd(kb, qs, kb.load(x, b.add(xrow[t], c)), ps[t]) for t in range(C)])
        ps = list(kb.last_carry)
        sc = kb.load(s, j)
        scv = kb.splat(sc, wv)
        setv([_muladd(kb, pv[t], scv, acc_v[t]) for t in range(C)]
             + [_muladd(kb, ps[t], sc, acc_s[t]) for t in range(C)])
    fin = list(kb.last_carry)
    for t in range(C):
        v = b.fadd(kb.hsum(fin[t]), fin[C + t])
        kb.store(v, out, b.add(b.mul(b.add(t0, i64(t)), i64(n_out)), r))


def _is_one(v: ir.Value) -> bool:
    return isinstance(v, ir.Constant) and v.constant == 1


def emit_float_matmul(kb: KernelBuilder, sig: KernelSig, dec: Decoder) -> None:
    """The float path: ``dec`` turns the weight's bytes into float vectors."""
    xt, wt = sig.in_types[:2]
    if sig.op == "matmul" and wt.layout not in (None, "F32"):
        raise NotImplementedError(f"matmul on a {wt.layout} weight: dequant should have been fused")
    b = kb.b
    n, k = as_int(wt.shape[0]), as_int(wt.shape[1])
    dec.row_bytes = wt.nbytes() // n
    x = kb.in_f32(0)
    out, n_out = out_rows(kb, sig)
    m = kb.rows_of(xt.shape)          # tokens: constant 1 for decode, T for prefill
    lo, hi = kb.thread_share(n)
    as_decode = _is_one(m) or "decode_rows" in sig.attr   # every row with decode's arithmetic

    tune = sig.attr  # optional overrides of the constants below: rows, tile_tokens, unroll
    if not dec.row_aligned:
        C = 1 if as_decode else tuned(kb, tune, "tile_tokens", 4)
        with kb.loop(lo, hi, name="row") as r:
            _over_tokens(kb, m, C, lambda t0, c: _planar_rowwise_tile(kb, dec, x, out, r, t0, c, n, k, n_out))
        return

    if as_decode:
        # short rows: one row at a time is one sequential stream, which the
        # hardware prefetcher follows best; long rows: 4 rows share x loads
        R, C, U = ((_DECODE_ROWS, 1, dec.decode_unroll) if k >= _LONG_ROW
                   else (1, 1, 2 * dec.decode_unroll))
        if not _is_one(m):   # decode rows: C tokens share each decoded weight vector
            C = tuned(kb, tune, "tile_tokens", _DECODE_TOKENS)
    else:
        (R, C), U = _PREFILL_TILE.get(kb.vw, (4, 4)), 1
        C = tuned(kb, tune, "tile_tokens", C)
    R, U = tuned(kb, tune, "rows", R), tuned(kb, tune, "unroll", U)
    # dense float rows are one stream the hardware prefetcher follows alone
    quantized = (wt.layout or "F32") not in ("F32", "F16", "BF16")
    ahead = int(tune.get("prefetch", PREFETCH_BYTES if as_decode and quantized else 0))
    rows_main = b.sub(hi, b.srem(b.sub(hi, lo), i64(R)))

    def rows_pass(k0, klen, first):
        with kb.loop(lo, rows_main, step=R, name="rt") as r0:
            _over_tokens(kb, m, C, lambda t0, c: _tile(kb, dec, x, out, r0, R, t0, c, n_out, k, U, k0, klen, first,
                                                       exact=as_decode, ahead=ahead))
        with kb.loop(rows_main, hi, name="r1") as r:
            _over_tokens(kb, m, C, lambda t0, c: _tile(kb, dec, x, out, r, 1, t0, c, n_out, k, U, k0, klen, first,
                                                       exact=as_decode, ahead=ahead))

    kc = K_CHUNK
    if as_decode or k < 2 * kc or kc % dec.step(U):
        rows_pass(0, k, None)
        return
    # prefill with a long K: chunks of kc columns, so that a tile's weight
    # rows stay in L1 and the chunk of activations (T x kc) in L2
    nfull = k // kc
    with kb.loop(0, nfull, name="kchunk") as c:
        rows_pass(b.mul(c, i64(kc)), kc, b.icmp_signed("==", c, i64(0)))
    if k % kc:
        rows_pass(nfull * kc, k % kc, ir.Constant(ir.IntType(1), 0))


def _over_tokens(kb: KernelBuilder, m: ir.Value, C: int, body) -> None:
    """body(t0, c) for token tiles of C, then single tokens for the rest."""
    b = kb.b
    if _is_one(m) or C == 1:
        if _is_one(m):
            body(i64(0), 1)
        else:
            with kb.loop(0, m, name="tok") as t:
                body(t, 1)
        return
    main = b.sub(m, b.srem(m, i64(C)))
    with kb.loop(0, main, step=C, name="tt") as t0:
        body(t0, C)
    with kb.loop(main, m, name="t1") as t:
        body(t, 1)


def planar_decoder(kb: KernelBuilder, raw: ir.Value, n: int, k: int, group: int) -> Decoder:
    """llama2.c's planar Q8 of ``group`` values per scale: the vector
    decoder where groups fit the vector pieces, else a row-wise loop that
    lets groups straddle rows (``_planar_rowwise_tile``)."""
    if PlanarQ8Decoder.fits(k, group, kb.vw):
        return PlanarQ8Decoder(kb, raw, n, k, group)
    d = Decoder(kb, raw, n, k)
    d.row_aligned = False
    d.g = group
    return d
