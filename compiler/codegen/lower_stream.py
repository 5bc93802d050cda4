"""Layer streaming in native code: the compute side's waits and releases,
and the I/O thread ``lmc_io(ctl)``.

Segments (``passes/stream_schedule``) are numbered globally: step k's
segment i has sequence number s = base + i, base = k * nseg (``STREAM_BASE``,
advanced by thread 0 at the end of each step). Two counters in the control
block, on their own cache lines:

- ``IO_DONE``: segments read so far. The I/O thread reads s into buffer
  s % 2 only once ``COMP_DONE >= s - 1`` (segment s - 2, the buffer's
  previous tenant, is finished), then sets ``IO_DONE = s + 1``.
- ``COMP_DONE``: segments finished. Before its first op on segment i, a step
  marks every earlier segment finished (thread 0, after the barrier that ends
  their last op) and all threads wait for ``IO_DONE > s``.

Both sides spin briefly and then sleep in futex_wait; each side wakes the
other after every update. Thread 0 adds the time it waited for reads to
``WAIT_NS``; the I/O thread adds its time in pread to ``READ_NS``. Python is
not involved: the runtime starts ``lmc_io`` once on its own thread.
"""
from __future__ import annotations

import llvmlite.ir as ir

from passes.stream_schedule import StreamSchedule

from .ctl import IO_ERR_DECOMPRESS, IO_ERR_READ, StreamSlots  # noqa: F401 (the layout, re-exported)
from .emit import I8P, I32, I64, VOID, i64

I64P = ir.PointerType(I64)


#: i64 fields per range in the table: offset, bytes read, buffer offset, codec, bytes out, source
#: (``passes.stream_schedule.FROM_MODEL`` / ``FROM_REPACKED``)
RANGE = 6


_POSIX_FADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22


class _loop:
    """``with _loop(b, lo, hi[, step]) as i:`` a counted loop in plain IR."""

    def __init__(self, b: ir.IRBuilder, lo: ir.Value, hi: ir.Value, step: ir.Value | None = None) -> None:
        self.b, self.lo, self.hi, self.step = b, lo, hi, step or i64(1)

    def __enter__(self) -> ir.Value:
        b = self.b
        fn = b.function
        self.pre = b.block
        self.head = fn.append_basic_block("l.head")
        self.body = fn.append_basic_block("l.body")
        self.exit = fn.append_basic_block("l.exit")
        b.branch(self.head)
        b.position_at_end(self.head)
        self.i = b.phi(I64)
        self.i.add_incoming(self.lo, self.pre)
        b.cbranch(b.icmp_signed("<", self.i, self.hi), self.body, self.exit)
        b.position_at_end(self.body)
        return self.i

    def __exit__(self, *exc) -> None:
        b = self.b
        nxt = b.add(self.i, self.step)
        self.i.add_incoming(nxt, b.block)
        b.branch(self.head)
        b.position_at_end(self.exit)
_SPIN = 1 << 12


class StreamLowering:
    """Emits the streaming parts of one module for one schedule."""

    def __init__(self, low, sched: StreamSchedule) -> None:
        self.low = low
        self.sched = sched
        self.nseg = len(sched.segments)
        self.module: ir.Module = low.module
        self._wait_fn = self._emit_wait()
        self._ranges()

    # --- helpers -------------------------------------------------------------
    def _slot(self, b: ir.IRBuilder, ctl: ir.Value, slot: int) -> ir.Value:
        return self.low._slot(b, ctl, slot)

    def _extern(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        return self.module.globals.get(name) or ir.Function(self.module, ir.FunctionType(ret, args), name)

    def _wake(self, b: ir.IRBuilder, p: ir.Value) -> None:
        futex = self.low._futex
        if futex is not None:
            futex(b, p, 129, i64(0x7FFFFFFF))

    def _sleep(self, b: ir.IRBuilder, p: ir.Value, seen: ir.Value) -> None:
        futex = self.low._futex
        if futex is not None:
            futex(b, p, 128, b.and_(seen, i64(0xFFFFFFFF)))
        else:
            b.call(self.low._sched_yield(), [])

    def _ranges(self) -> None:
        """Constant tables: segment i's reads are ranges[start[i] .. start[i+1])."""
        start, flat = [0], []
        for seg in self.sched.segments:
            for r in seg.ranges:
                flat += list(r)
            start.append(len(flat) // RANGE)
        def table(name: str, vals: list[int]) -> ir.GlobalVariable:
            ty = ir.ArrayType(I64, max(1, len(vals)))
            g = ir.GlobalVariable(self.module, ty, name)
            g.global_constant = True
            g.linkage = "internal"
            g.initializer = ir.Constant(ty, [ir.Constant(I64, v) for v in (vals or [0])])
            return g
        self.start_tab = table("lmc_stream_start", start)
        self.range_tab = table("lmc_stream_ranges", flat)

    # --- the compute side -------------------------------------------------------
    def weight_ptr(self, b: ir.IRBuilder, ctl: ir.Value, name: str) -> ir.Value | None:
        p = self.sched.placement.get(name)
        if p is None or self.sched.io == "mmap":  # mmap mode: read in place from the file mapping
            return None
        seg, off = p
        buf = b.inttoptr(b.load(self._slot(b, ctl, StreamSlots.BUF0 + seg % 2)), I8P)
        return b.gep(buf, [i64(off)], inbounds=True)

    def base(self, b: ir.IRBuilder, ctl: ir.Value) -> ir.Value:
        return b.load(self._slot(b, ctl, StreamSlots.BASE))

    def advance(self, b: ir.IRBuilder, ctl: ir.Value, tid: ir.Value, base: ir.Value, seg: int) -> None:
        """Before the first op on segment ``seg``: earlier segments are done
        (the barrier after their last op has passed); wait for this one."""
        with b.if_then(b.icmp_signed("==", tid, i64(0))):
            self._release(b, ctl, b.add(base, i64(seg)))
        b.call(self._wait_fn, [ctl, b.add(base, i64(seg + 1)), tid])

    def finish(self, b: ir.IRBuilder, ctl: ir.Value, tid: ir.Value, base: ir.Value) -> None:
        """End of a step: every segment is done; the next step's numbers start
        after this one's."""
        with b.if_then(b.icmp_signed("==", tid, i64(0))):
            end = b.add(base, i64(self.nseg))
            b.call(self._wait_fn, [ctl, end, tid])  # keep the reader in step with the steps
            self._release(b, ctl, end)
            b.store(end, self._slot(b, ctl, StreamSlots.BASE))

    def _release(self, b: ir.IRBuilder, ctl: ir.Value, value: ir.Value) -> None:
        p = self._slot(b, ctl, StreamSlots.COMP_DONE)
        b.store_atomic(value, p, "release", 8)
        self._wake(b, p)

    def _emit_wait(self) -> ir.Function:
        """lmc_stream_wait(ctl, want, tid): until IO_DONE >= want."""
        fn = ir.Function(self.module, ir.FunctionType(VOID, [I64P, I64, I64]), "lmc_stream_wait")
        fn.linkage = "internal"
        ctl, want, tid = fn.args
        blk = {n: fn.append_basic_block(n) for n in ("entry", "slow", "spin", "sleep", "check", "done", "ret")}
        b = ir.IRBuilder(blk["entry"])
        p = self._slot(b, ctl, StreamSlots.IO_DONE)
        now0 = b.load_atomic(p, "acquire", 8)
        b.cbranch(b.icmp_signed(">=", now0, want), blk["ret"], blk["slow"])
        b.position_at_end(blk["slow"])
        t0 = self.low._profile_now(b)
        b.branch(blk["spin"])
        b.position_at_end(blk["spin"])
        n = b.phi(I64)
        n.add_incoming(i64(0), blk["slow"])
        cur = b.load_atomic(p, "acquire", 8)
        b.cbranch(b.icmp_signed(">=", cur, want), blk["done"], blk["check"])
        b.position_at_end(blk["check"])
        n.add_incoming(b.add(n, i64(1)), blk["check"])
        b.cbranch(b.icmp_signed(">", n, i64(_SPIN)), blk["sleep"], blk["spin"])
        b.position_at_end(blk["sleep"])
        self._sleep(b, p, cur)
        n.add_incoming(i64(0), blk["sleep"])
        b.branch(blk["spin"])
        b.position_at_end(blk["done"])
        with b.if_then(b.icmp_signed("==", tid, i64(0))):
            w = self._slot(b, ctl, StreamSlots.WAIT_NS)
            b.store(b.add(b.load(w), b.sub(self.low._profile_now(b), t0)), w)
        b.branch(blk["ret"])
        b.position_at_end(blk["ret"])
        b.ret_void()
        return fn

    # --- the I/O thread ------------------------------------------------------------
    def emit_io_thread(self) -> None:
        """lmc_io(ctl): read segment after segment into the two buffers until QUIT."""
        from .ctl import Ctl

        fn = ir.Function(self.module, ir.FunctionType(VOID, [I64P]), "lmc_io")
        ctl, = fn.args
        names = ("entry", "loop", "wait", "sleep", "ready", "rng", "rbody", "rd", "rok", "rerr", "rnext",
                 "published", "ret")
        blk = {n: fn.append_basic_block(n) for n in names}
        b = ir.IRBuilder(blk["entry"])
        pread = self._extern("pread", I64, [I32, I8P, I64, I64])
        fadvise = self._extern("posix_fadvise", I32, [I32, I64, I64, I32])
        fd = b.trunc(b.load(self._slot(b, ctl, StreamSlots.FD)), I32)
        fd_rp = b.trunc(b.load(self._slot(b, ctl, StreamSlots.FD_REPACKED)), I32)
        quit_p = self._slot(b, ctl, Ctl.QUIT)
        comp_p = self._slot(b, ctl, StreamSlots.COMP_DONE)
        io_p = self._slot(b, ctl, StreamSlots.IO_DONE)
        b.branch(blk["loop"])

        b.position_at_end(blk["loop"])
        s = b.phi(I64)
        s.add_incoming(i64(0), blk["entry"])
        t_idle = self.low._profile_now(b)
        b.branch(blk["wait"])
        # wait until segment s - 2 (this buffer's last tenant) is finished, or QUIT
        b.position_at_end(blk["wait"])
        q = b.load_atomic(quit_p, "acquire", 8)
        cur = b.load_atomic(comp_p, "acquire", 8)
        free = b.icmp_signed(">=", cur, b.sub(s, i64(1)))
        chk = fn.append_basic_block("chk")
        b.cbranch(b.icmp_signed("!=", q, i64(0)), blk["ret"], chk)
        b.position_at_end(chk)
        b.cbranch(free, blk["ready"], blk["sleep"])
        b.position_at_end(blk["sleep"])
        self._sleep(b, comp_p, cur)
        b.branch(blk["wait"])

        b.position_at_end(blk["ready"])
        idle = self._slot(b, ctl, StreamSlots.IO_IDLE_NS)
        t_read = self.low._profile_now(b)
        b.store(b.add(b.load(idle), b.sub(t_read, t_idle)), idle)
        if self.sched.io == "mmap":
            b.call(self._emit_map_segment(), [ctl, s])
            b.branch(blk["published"])
            for name in ("rng", "rbody", "rd", "rok", "rerr", "rnext"):  # unused by this mode
                blk[name].parent.blocks.remove(blk[name])
            return self._finish_io(fn, b, blk, ctl, s, t_read, io_p, fd, fadvise, fd_rp)
        seg = b.urem(s, i64(self.nseg))
        buf = b.inttoptr(b.load(b.gep(ctl, [b.add(i64(StreamSlots.BUF0), b.urem(seg, i64(2)))])), I8P)
        j0 = self._load_tab(b, self.start_tab, seg)
        j1 = self._load_tab(b, self.start_tab, b.add(seg, i64(1)))
        b.branch(blk["rng"])
        # for each range j of the segment: pread until done
        b.position_at_end(blk["rng"])
        j = b.phi(I64)
        j.add_incoming(j0, blk["ready"])
        b.cbranch(b.icmp_signed("<", j, j1), blk["rbody"], blk["published"])
        b.position_at_end(blk["rbody"])
        off0, n0, dst0, codec, nout, src = (self._load_tab(b, self.range_tab, b.add(b.mul(j, i64(RANGE)), i64(k)))
                                            for k in range(RANGE))
        # a repacked weight's bytes: its image offset, in the file that starts at repack_lo
        off0, rfd = self._source(b, src, off0, fd, fd_rp)
        # a compressed range is read into the staging buffer, then decompressed
        stage = b.inttoptr(b.load(self._slot(b, ctl, StreamSlots.STAGE)), I8P)
        plain = b.icmp_signed("==", codec, i64(0))
        target = b.select(plain, b.gep(buf, [dst0]), stage)
        b.branch(blk["rd"])
        b.position_at_end(blk["rd"])
        done = b.phi(I64)
        done.add_incoming(i64(0), blk["rbody"])
        left = b.sub(n0, done)
        finished = b.icmp_signed("<=", left, i64(0))
        more = fn.append_basic_block("more")
        b.cbranch(finished, blk["rnext"], more)
        b.position_at_end(more)
        got = b.call(pread, [rfd, b.gep(target, [done]), left, b.add(off0, done)])
        b.cbranch(b.icmp_signed(">", got, i64(0)), blk["rok"], blk["rerr"])
        b.position_at_end(blk["rok"])
        nb = self._slot(b, ctl, StreamSlots.READ_BYTES)
        b.store(b.add(b.load(nb), got), nb)
        done.add_incoming(b.add(done, got), blk["rok"])
        b.branch(blk["rd"])
        b.position_at_end(blk["rerr"])  # a failed or short read: flag it; the runtime raises
        b.store_atomic(i64(IO_ERR_READ), self._slot(b, ctl, StreamSlots.IO_ERROR), "release", 8)
        b.branch(blk["rnext"])
        b.position_at_end(blk["rnext"])
        with b.if_then(b.icmp_signed("!=", codec, i64(0))):
            self._decompress(b, ctl, codec, stage, n0, b.gep(buf, [dst0]), nout)
        j.add_incoming(b.add(j, i64(1)), b.block)
        b.branch(blk["rng"])

        self._finish_io(fn, b, blk, ctl, s, t_read, io_p, fd, fadvise, fd_rp)

    def _source(self, b: ir.IRBuilder, src: ir.Value, off: ir.Value, fd: ir.Value,
                fd_rp: ir.Value) -> tuple[ir.Value, ir.Value]:
        """A range's offset in its file and that file's descriptor."""
        lo = self.sched.repack_lo
        if lo is None:
            return off, fd
        rp = b.icmp_signed("==", src, i64(1))
        return b.select(rp, b.sub(off, i64(lo)), off), b.select(rp, fd_rp, fd)

    def _decompress(self, b: ir.IRBuilder, ctl: ir.Value, codec: ir.Value, src: ir.Value, n: ir.Value,
                    dst: ir.Value, nout: ir.Value) -> None:
        """Decompress ``n`` staged bytes into ``dst`` with the codec's C entry
        point (its address is in the control block); anything but exactly
        ``nout`` bytes out flags IO_ERR_DECOMPRESS."""
        i32 = I32
        lz4_t = ir.FunctionType(i32, [I8P, I8P, i32, i32]).as_pointer()
        zstd_t = ir.FunctionType(I64, [I8P, I64, I8P, I64]).as_pointer()
        with b.if_else(b.icmp_signed("==", codec, i64(1))) as (lz4, zstd):
            with lz4:
                fn = b.inttoptr(b.load(self._slot(b, ctl, StreamSlots.LZ4_FN)), lz4_t)
                r_lz4 = b.sext(b.call(fn, [src, dst, b.trunc(n, i32), b.trunc(nout, i32)]), I64)
                from_lz4 = b.block
            with zstd:
                fn = b.inttoptr(b.load(self._slot(b, ctl, StreamSlots.ZSTD_FN)), zstd_t)
                r_zstd = b.call(fn, [dst, nout, src, n])
                from_zstd = b.block
        res = b.phi(I64)
        res.add_incoming(r_lz4, from_lz4)
        res.add_incoming(r_zstd, from_zstd)
        with b.if_then(b.icmp_signed("!=", res, nout)):
            b.store_atomic(i64(IO_ERR_DECOMPRESS), self._slot(b, ctl, StreamSlots.IO_ERROR), "release", 8)

    def _finish_io(self, fn, b, blk, ctl, s, t_read, io_p, fd, fadvise, fd_rp) -> None:
        """Publish segment s (IO_DONE), hint the next one, loop."""
        b.position_at_end(blk["published"])
        t_end = self.low._profile_now(b)
        rn = self._slot(b, ctl, StreamSlots.READ_NS)
        b.store(b.add(b.load(rn), b.sub(t_end, t_read)), rn)
        b.store_atomic(b.add(s, i64(1)), io_p, "release", 8)
        self._wake(b, io_p)
        # hint the kernel to read ahead the next segment's ranges, each in its file
        nseg_next = b.urem(b.add(s, i64(1)), i64(self.nseg))
        k0 = self._load_tab(b, self.start_tab, nseg_next)
        k1 = self._load_tab(b, self.start_tab, b.add(nseg_next, i64(1)))
        with _loop(b, k0, k1) as k:
            row = b.mul(k, i64(RANGE))
            off, n, src = (self._load_tab(b, self.range_tab, b.add(row, i64(f))) for f in (0, 1, 5))
            off, rfd = self._source(b, src, off, fd, fd_rp)
            b.call(fadvise, [rfd, off, n, ir.Constant(I32, _POSIX_FADV_WILLNEED)])
        s.add_incoming(b.add(s, i64(1)), b.block)
        b.branch(blk["loop"])

        b.position_at_end(blk["ret"])
        b.ret_void()

    def _emit_map_segment(self) -> ir.Function:
        """lmc_io_map(ctl, s), the ``mmap`` mode: weights are read in place
        from the file mapping. Unmap segment s - 2's pages from this process
        (MADV_DONTNEED: the page cache keeps them; the resident set drops)
        and map segment s's in bulk (MADV_POPULATE_READ, Linux 5.14+; on
        older kernels, touching a byte per page)."""
        fn = ir.Function(self.module, ir.FunctionType(VOID, [I64P, I64]), "lmc_io_map")
        fn.linkage = "internal"
        ctl, s = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        madvise = self._extern("madvise", I32, [I8P, I64, I32])
        base = b.load(self._slot(b, ctl, self._weights_slot()))
        page = i64(4096)

        def each_range(seg: ir.Value, body) -> None:
            j0 = self._load_tab(b, self.start_tab, seg)
            j1 = self._load_tab(b, self.start_tab, b.add(seg, i64(1)))
            with _loop(b, j0, j1) as j:
                off = self._load_tab(b, self.range_tab, b.mul(j, i64(RANGE)))
                n = self._load_tab(b, self.range_tab, b.add(b.mul(j, i64(RANGE)), i64(1)))
                body(off, b.add(off, n), n)

        def ptr(x: ir.Value) -> ir.Value:
            return b.inttoptr(b.add(base, x), I8P)

        with b.if_then(b.icmp_signed(">=", s, i64(2))):
            def release(lo, hi, n):  # whole pages inside the range only
                a = b.and_(b.add(lo, i64(4095)), i64(~4095))
                e = b.and_(hi, i64(~4095))
                with b.if_then(b.icmp_signed(">", e, a)):
                    b.call(madvise, [ptr(a), b.sub(e, a), ir.Constant(I32, _MADV_DONTNEED)])
            each_range(b.urem(b.sub(s, i64(2)), i64(self.nseg)), release)

        def populate(lo, hi, n):
            a = b.and_(lo, i64(~4095))
            e = b.and_(b.add(hi, i64(4095)), i64(~4095))
            rc = b.call(madvise, [ptr(a), b.sub(e, a), ir.Constant(I32, _MADV_POPULATE_READ)])
            with b.if_then(b.icmp_signed("!=", rc, ir.Constant(I32, 0))):  # an older kernel: touch the pages
                sink = self._slot(b, ctl, StreamSlots.TOUCH_SINK)   # a store keeps the loads
                with _loop(b, a, e, page) as q:
                    v = b.zext(b.load(ptr(q)), I64)
                    b.store(b.add(b.load(sink), v), sink)
            nb = self._slot(b, ctl, StreamSlots.READ_BYTES)
            b.store(b.add(b.load(nb), n), nb)
        each_range(b.urem(s, i64(self.nseg)), populate)
        b.ret_void()
        return fn

    def _weights_slot(self) -> int:
        from .ctl import Ctl
        return Ctl.WEIGHTS

    def _load_tab(self, b: ir.IRBuilder, tab: ir.GlobalVariable, idx: ir.Value) -> ir.Value:
        return b.load(b.gep(tab, [i64(0), idx], inbounds=True))
