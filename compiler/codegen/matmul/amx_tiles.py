"""Several token rows at once on AMX tiles: the integer GEMM's products
(``matmul/gemm``, ``gemm_kquants``) and the repacked weights' kernel
(``matmul/repacked``) when a call has ``MIN_TOKENS`` rows or more.

Per tile of 16 weight rows and K chunk, the chunk's blocks lie in scratch
in the GEMM's unpacked form (per 32 values 8 vectors of 16 rows x 4 bytes,
which is AMX's B operand as it stands; then the float scales): the GEMM
unpacks them there as before, a repacked weight's kernel decodes its tile
blocks there once per chunk (``stage``). Then 16 tokens at a time, per
block (K-quants: per sub-block) one ``tdpbsud`` multiplies the tokens'
quantized activations, read in place from their scratch slots as the A
operand, by the block's weights and stores the 16 x 16 int32 sums; each
token's row of them takes the same seed, conversion and FMAs as the VNNI
microkernel's lanes (the layout's ``amx_products`` and ``amx_epilogue``).
Integer sums are exact, so a token's result is the same bits on either
unit: AMX is a speed, not a different arithmetic, and the tests compare the
two kernels bit for bit.

What makes it fast (each measured): products two at a time in two tile
registers (tiles are not renamed), issued ``amx_ahead`` blocks before
their epilogues into a ring of sums buffers (a tile store takes a while to
reach the loads), and the 16 tokens' d_x and corrections side by side per
block in a panel built once per call (the epilogue broadcasts them from one
pointer instead of sixteen).

A call's last group may hold fewer than 16 tokens. From ``PADDED_FROM``
of them it takes the tiles as a short group: the A tile still reads 16
slots (the scratch has room; rows past the call's are stale numbers whose
sums are never stored), and the panel and epilogue of those rows use the
last real token's slot and output row. Fewer take the VNNI code
(``chunk``'s ``rest``): a short group costs its full products.
"""
from __future__ import annotations

from typing import Callable

import llvmlite.ir as ir

from .. import amx
from ..emit import KernelBuilder, as_i64, i64
from ..kernels import KernelSig
from .common import tuned

#: token rows from which a call takes the tiles; fewer take the VNNI code
#: (a decode step, [K], always does). Q4_1 1536x576, one thread, weights
#: in cache: 2 rows 0.33x the VNNI code, 8 rows 0.74x, 16 rows 1.15x, 32
#: rows 1.32x. In a model, weights from memory, the tiles lose below 32:
#: Qwen2.5-Coder-0.5B checks of 16, 17, 20, 24 rows cost 2.22-2.37,
#: 3.05-3.27, 3.15-3.32, 3.20-3.47 decode steps from 16 on, 1.97-2.07,
#: 2.05-2.39, 2.35-2.72, 2.54-2.97 from 32 on (2 threads, alternated runs)
MIN_TOKENS = 32
#: rows past the last whole 16 from which they take a padded group of tiles
#: (fewer take the VNNI code: a group costs its products however few of its
#: rows are real). Qwen2.5-Coder-0.5B checks, decode steps, all on the
#: tiles / the rest on VNNI (2 threads, 21 alternated calls, two runs): 33
#: rows 4.79-4.94 / 4.27-4.35, 36 rows 4.97-5.10 / 4.58-4.73, 40 rows
#: 5.05-5.24 / 5.00-5.23, 47 rows 5.54-5.73 / 6.32-6.48
PADDED_FROM = 8
#: sums buffers in the ring: more than a step's blocks plus those ahead
RING = 8
#: room for the sums: RING blocks' (16 x 16 int32 each; the 32-value
#: layouts) or super-blocks' (16 sub-blocks at most)
SUMS_BYTES = RING * amx.ROWS * amx.ROW_BYTES * 16


def usable(kb: KernelBuilder, width: int, sig: KernelSig, table_says: bool) -> bool:
    """AMX for this kernel: the target has it (``Target.amx``; the process
    was granted the tile state), the tile is 16 rows wide, and the weight
    type's row of the traits table says the tiles are faster
    (``table_says``; the kernel attribute ``amx``, 0 or 1, overrides it:
    ``lmc kernel``, tests)."""
    if not (kb.target.amx and width == 16):
        return False
    return bool(int(sig.attr.get("amx", table_says)))


def groups(slots: int) -> int:
    """16-token groups of a call of at most ``slots`` tokens."""
    return -(-slots // amx.ROWS)


def layout(used: int, slots: int, slot_bytes: int, panel_bytes: int) -> tuple[int, int, int]:
    """(panel offset, sums offset, total bytes) of the scratch of a kernel
    with an AMX path: the VNNI kernel's ``used`` bytes (``slots`` slots of
    ``slot_bytes`` at their start), the panel (``panel_bytes`` a block per
    16 tokens), the sums on cache lines of their own, and room for the A
    tile's 16 slots past a call's last."""
    panel = used
    sums = (panel + groups(slots) * panel_bytes + 63) // 64 * 64
    return panel, sums, max(sums + SUMS_BYTES, groups(slots) * amx.ROWS * slot_bytes)


def fill_panels(g, n: ir.Value, panel: ir.Value) -> None:
    """Every 16-token group's panel entries (``amx_fill_panel``) for the n
    tokens in the slots, when the call takes the tiles (n >= MIN_TOKENS);
    slots past n stand in for the last."""
    kb, b = g.kb, g.b
    last = b.sub(n, i64(1))
    with kb.if_then(b.icmp_signed(">=", n, i64(MIN_TOKENS))), kb.loop(0, n, step=amx.ROWS, name="apanels") as s0:
        slots = [g.slot(kb.imin(b.add(s0, i64(p)), last)) for p in range(amx.ROWS)]
        grp = b.sdiv(s0, i64(amx.ROWS))
        g.amx_fill_panel(slots, kb.gep(panel, b.mul(grp, i64(g.nb * g.amx_panel_bytes))))


def tokens(g, r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value, s0: ir.Value, t0: ir.Value, n: ir.Value,
           panel: ir.Value, sums: ir.Value) -> None:
    """Token slots s0 .. s0+15 (those below n real: token rows t0 + slot)
    against the blocks c0 .. c0+nblk-1 staged in scratch for the tile at
    r0: each real token's accumulator continues its chain from the output
    row (zero at block 0), as ``GemmBase.tokens``."""
    kb, b, kern, W = g.kb, g.b, g.kern, g.W
    last = b.sub(n, i64(1))
    rows = [kb.imin(b.add(s0, i64(p)), last) for p in range(amx.ROWS)]
    outs = [kb.gep(kern.out, b.add(b.mul(b.add(t0, t), i64(kern.n_out)), r0)) for t in rows]
    zero = ir.Constant(g.vf, [0.0] * W)
    if isinstance(c0, int):
        accs = [zero] * len(outs) if c0 == 0 else [kb.vload(o, 0, W) for o in outs]
    else:
        first = b.icmp_signed("==", c0, i64(0))
        accs = [b.select(first, zero, kb.vload(o, 0, W)) for o in outs]
    a0 = g.slot(s0)
    c0v = as_i64(c0)
    nb = as_i64(nblk)
    last_blk = b.sub(nb, i64(1))
    group = kb.gep(panel, b.mul(b.sdiv(s0, i64(amx.ROWS)), i64(g.nb * g.amx_panel_bytes)))
    step, ahead = tuned(kb, g.attrs, "amx_step", g.amx_step), tuned(kb, g.attrs, "amx_ahead", g.amx_ahead)
    if ahead + step > RING or ahead % step:
        raise NotImplementedError(f"amx_ahead {ahead}, amx_step {step}: a multiple of the step, at most {RING} together")

    def sums_of(jj: ir.Value) -> ir.Value:
        return kb.gep(sums, b.mul(b.and_(jj, i64(RING - 1)), i64(g.amx_sums_bytes)))

    def products(first: ir.Value) -> None:
        """The products of blocks first .. first+step-1 of the chunk (past its
        last block: the last one again, into its own buffer: harmless)."""
        specs = []
        for d in range(step):
            jj = kb.imin(b.add(first, i64(d)), last_blk)
            specs += g.amx_products(b.add(jj, c0v), g.tile_block(jj), a0, sums_of(jj))
        amx.int8_products(kb, specs)

    def epilogue(jj: ir.Value, cur: list[ir.Value]) -> list[ir.Value]:
        pj = kb.gep(group, b.mul(b.add(jj, c0v), i64(g.amx_panel_bytes)))
        return g.amx_epilogue(g.tile_block(jj), pj, cur, sums_of(jj))

    for d in range(0, ahead, step):
        products(i64(d))
    main = b.sub(nb, b.srem(nb, i64(step))) if step > 1 else nb
    with kb.loop_carry(0, main, accs, step=step, name="amxb") as (jj, cur, setv):
        products(b.add(jj, i64(ahead)))
        cur = list(cur)
        for d in range(step):
            cur = epilogue(b.add(jj, i64(d)), cur)
        setv(cur)
    accs = list(kb.last_carry)
    if step > 1:   # an odd block at the end: its product went ahead with the others
        tail = b.icmp_signed("<", main, nb)
        got = epilogue(kb.imin(main, last_blk), accs)
        accs = [b.select(tail, x, y) for x, y in zip(got, accs)]
    for p, (o, v) in enumerate(zip(outs, accs)):
        if p == 0:
            kb.vstore(v, o, 0)
            continue
        with kb.if_then(b.icmp_signed("<", b.add(s0, i64(p)), n)):
            kb.vstore(v, o, 0)


def chunk(g, stage: Callable[[ir.Value, int | ir.Value, int | ir.Value], None], n: ir.Value, t0: ir.Value,
          panel: ir.Value, sums: ir.Value,
          rest: Callable[[ir.Value, int | ir.Value, int | ir.Value, ir.Value, ir.Value], None]
          ) -> Callable[[ir.Value, int | ir.Value, int | ir.Value], None]:
    """The body of a K chunk for ``GemmBase.k_chunks``. A call of
    ``MIN_TOKENS`` rows or more: ``stage`` its blocks into the scratch tile,
    then the tokens 16 at a time on the tiles. Then ``rest(r0, c0, nblk, s0,
    staged)`` takes the slots s0 .. n-1 on the VNNI code: all of a smaller
    call's (``staged`` false), else those past the last whole 16 when they
    are fewer than ``PADDED_FROM``. One copy of the VNNI code serves both
    (the VNNI rows give the same bits)."""
    b = g.b

    def run(r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value) -> None:
        on = b.icmp_signed(">=", n, i64(MIN_TOKENS))
        whole = b.and_(n, i64(-amx.ROWS))
        whole = b.select(b.icmp_signed(">=", b.sub(n, whole), i64(PADDED_FROM)), n, whole)
        whole = b.select(on, whole, i64(0))
        with g.kb.if_then(on):
            stage(r0, c0, nblk)
            with g.kb.loop(0, whole, step=amx.ROWS, name="amxt") as s0:
                tokens(g, r0, c0, nblk, s0, t0, n, panel, sums)
        with g.kb.if_then(b.icmp_signed("<", whole, n)):
            rest(r0, c0, nblk, whole, on)
    return run
