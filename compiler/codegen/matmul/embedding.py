"""Embedding lookups: a table row per token (``embedding``: by its id;
``pos_embedding``: by its position), decoded from the stored table by the
float path's decoder of its type (``traits.make_decoder``)."""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, F32P, I32, I64, KernelBuilder, i64
from ..kernels import KernelSig, kernel
from ..paging import RowPositions
from .common import as_int, pow2_pieces
from .traits import make_decoder


@kernel("embedding", "pos_embedding")
def emit_embedding(kb: KernelBuilder, sig: KernelSig) -> None:
    """A table row per token: the token's id (``embedding``), or its
    position (``pos_embedding``: pos + t, or positions[t] in a batch)."""
    wt, it = sig.in_types[0], sig.in_types[-1]
    b = kb.b
    v, d = as_int(wt.shape[0]), as_int(wt.shape[1])
    dec = make_decoder(kb, wt, kb.in_raw[0])
    if sig.op == "embedding":
        ids = b.bitcast(kb.in_raw[1], ir.PointerType(I32))
        row_of = lambda t: b.sext(kb.load(ids, t), I64)  # noqa: E731
    elif sig.in_types[1].rank == 1:
        row_of = RowPositions(kb, kb.in_raw[1])
    else:
        row_of = lambda t: b.add(kb.pos, t)  # noqa: E731
    out = kb.out_f32()
    m = i64(1)
    for dd in it.shape:
        m = b.mul(m, kb.dim(dd))
    lo, hi = kb.thread_share(m)  # one token (decode): the last thread copies it
    with kb.loop(lo, hi, name="tok") as t:
        # The runtime validates token ids and positions before the call: 0 <= row < V
        # is assumed here (no clamping; an invalid one would read out of bounds).
        row = row_of(t)
        obase = b.mul(t, i64(d))
        if dec.row_aligned:
            S = dec.step(1)
            dmain = d - d % S
            if dmain:
                with kb.loop(0, dmain, step=S, name="col") as col:
                    for j, vec in enumerate(dec.decode(row, col, [kb.vw] * (S // kb.vw), S)[0]):
                        kb.vstore(vec, out, b.add(obase, b.add(col, i64(j * kb.vw))))
            pieces = pow2_pieces(d - dmain, kb.vw)
            if pieces:
                align = dmain & -dmain
                off = 0
                for w, vec in zip(pieces, dec.decode(row, i64(dmain), pieces, align)[0]):
                    kb.vstore(vec, out, b.add(obase, i64(dmain + off)))
                    off += w
        else:
            # planar Q8 with groups straddling rows: element by element
            g = dec.g
            s = b.bitcast(kb.gep(dec.raw, v * d), F32P)
            base = b.mul(row, i64(d))
            with kb.loop(0, d, name="col") as c:
                e = b.add(base, c)
                val = b.fmul(b.sitofp(kb.load(dec.raw, e), F32), kb.load(s, b.udiv(e, i64(g))))
                kb.store(val, out, b.add(obase, c))
