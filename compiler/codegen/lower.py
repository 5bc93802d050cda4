"""Lower planned graphs to one LLVM module with a native token step.

For each graph (decode, prefill ...) a ``step_<name>(ctl, tid)`` function calls
one specialised kernel per node with constant operand addresses (weights at
file offsets, intermediates at arena offsets, the KV cache at state offsets)
and meets the other threads at a barrier before each op that touches memory
the ops since the last barrier touch (``passes.barriers``). Python calls
``lmc_run(ctl)`` once per step; worker threads sit in ``lmc_worker(ctl, tid)``
(started once per process) and run the same step with their own thread id.

The control block ``ctl`` is an array of i64 slots (see ``Ctl``); the
barrier's counters sit on their own cache lines.
"""
from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir

from ir.graph import Graph
from ir.ops import get_op
from passes.barriers import barrier_before
from passes.plan_arena import ArenaPlan
from passes.stream_schedule import StreamSchedule, node_segments

from .emit import I8P, I32, I64, KERNEL_TYPE, N_INPUTS, VOID, i64
from .kernels import KernelSig, emit_kernel
from .ctl import PROFILE_HEADER, Ctl, StreamSlots  # noqa: F401 (the layout, re-exported)
from .lower_stream import StreamLowering
from .target import Target


I64P = ir.PointerType(I64)
BARRIER = "lmc_barrier"
USE_PAUSE = False
STEP_TYPE = ir.FunctionType(VOID, [I64P, I64])


@dataclass
class EntryInfo:
    """What the runtime needs to know about one compiled graph."""

    name: str
    index: int
    arena_offsets: dict[str, int]
    output_offset: int
    output_shape: tuple
    profile: tuple[int, int] | None = None   # profiling builds: (first slot, nodes)
    inputs: dict[str, int] | None = None     # graph input -> byte offset in the IO area
    io_bytes: int = 0                        # the IO area this entry needs


def state_layout(graph: Graph) -> tuple[dict[str, int], int]:
    """Offsets of the state buffers (KV cache) in one allocation."""
    offsets, top = {}, 0
    for name, v in graph.states.items():
        offsets[name] = top
        top += (v.type.nbytes() + 63) // 64 * 64
    return offsets, top


#: the graph input that travels in the control block (the kernels' ``pos``
#: argument) rather than the IO area
SCALAR_POS = "pos"


def io_layout(graph: Graph, symbols: dict[str, int]) -> tuple[dict[str, int], int]:
    """Byte offsets of the graph's inputs in the IO area (``Ctl.IO``), in
    input order, each on a cache line, with symbolic dims (``T``) at their
    planned size; and the area's size. The first input (the token ids) is
    at 0; a scalar ``pos`` is not there (``Ctl.POS``)."""
    offsets, top = {}, 0
    for v in graph.inputs:
        if v.name == SCALAR_POS and v.type.rank == 0:
            continue
        offsets[v.name] = top
        top += (v.type.nbytes(symbols) + 63) // 64 * 64
    return offsets, top


class Lowering:
    def __init__(self, target: Target, vector_width: int, profile: bool = False,
                 external_kernels: bool = False) -> None:
        self.target = target
        #: declare kernels only (compiled apart: ``objects.kernel_object``)
        self.external_kernels = external_kernels
        self.vw = vector_width
        self.profile = profile
        self.profile_regions: dict[str, tuple[int, int]] = {}
        self._prof_next = 0
        self._prof_ts: dict[str, ir.Value] = {}   # one struct timespec per step function
        self.module = ir.Module(name="lmc")
        self.module.triple = target.triple
        self.kernels: dict[KernelSig, ir.Function] = {}
        self.stream: StreamLowering | None = None   # set by lower_graphs when weights stream
        # compiled apart, the barrier is only declared here (``barrier_module``)
        self.barrier = ir.Function(self.module, ir.FunctionType(VOID, [I64P]), BARRIER) if external_kernels \
            else self._emit_barrier()

    def kernel(self, sig: KernelSig) -> ir.Function:
        fn = self.kernels.get(sig)
        if fn is None:
            if self.external_kernels:
                fn = ir.Function(self.module, KERNEL_TYPE, sig.name)
            else:
                fn = emit_kernel(self.module, sig, self.vw, target=self.target)
            self.kernels[sig] = fn
        return fn

    # --- the barrier ----------------------------------------------------------
    def _slot(self, b: ir.IRBuilder, ctl: ir.Value, slot: int) -> ir.Value:
        return b.gep(ctl, [i64(slot)], inbounds=True)

    def _emit_pause(self, b: ir.IRBuilder) -> None:
        """Spin-wait hint. Off: under a hypervisor, PAUSE in a loop triggers
        pause-loop exits that deschedule the waiting vCPU for a long time
        (measured: Gemma decode 17 ms/token on 1 thread, 60 ms on 2)."""
        if USE_PAUSE and self.target.triple.startswith(("x86_64", "i686")):
            fn = self.module.globals.get("llvm.x86.sse2.pause") or ir.Function(
                self.module, ir.FunctionType(VOID, []), "llvm.x86.sse2.pause")
            b.call(fn, [])

    def _emit_barrier(self) -> ir.Function:
        """Central counter barrier with a generation number: the last thread
        to arrive resets the counter and bumps the generation; the others spin
        (pausing, then yielding the core) until the generation moves."""
        fn = ir.Function(self.module, ir.FunctionType(VOID, [I64P]), BARRIER)
        fn.linkage = "internal"
        # a call per op, never inlined: inlined ~1000 times per step, it made
        # the step functions megabytes of IR and seconds of code generation
        fn.attributes.add("noinline")
        ctl, = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        nt = b.load(self._slot(b, ctl, Ctl.NTHREADS))
        single = fn.append_basic_block("single")
        multi = fn.append_basic_block("multi")
        b.cbranch(b.icmp_signed("<=", nt, i64(1)), single, multi)
        b.position_at_end(single)
        b.ret_void()
        b.position_at_end(multi)
        gen_p = self._slot(b, ctl, Ctl.BARRIER_GEN)
        cnt_p = self._slot(b, ctl, Ctl.BARRIER_COUNT)
        gen = b.load_atomic(gen_p, "acquire", 8)
        arrived = b.atomic_rmw("add", cnt_p, i64(1), "acq_rel")
        last = fn.append_basic_block("last")
        wait = fn.append_basic_block("wait")
        b.cbranch(b.icmp_signed("==", arrived, b.sub(nt, i64(1))), last, wait)
        b.position_at_end(last)
        b.store_atomic(i64(0), cnt_p, "monotonic", 8)
        b.atomic_rmw("add", gen_p, i64(1), "release")
        b.ret_void()
        b.position_at_end(wait)
        spin = fn.append_basic_block("spin")
        done = fn.append_basic_block("done")
        b.branch(spin)
        b.position_at_end(spin)
        n = b.phi(I64)
        n.add_incoming(i64(0), wait)
        self._emit_pause(b)
        yield_blk = fn.append_basic_block("yield")
        check = fn.append_basic_block("check")
        b.cbranch(b.icmp_signed(">", n, i64(1 << 12)), yield_blk, check)
        b.position_at_end(yield_blk)
        b.call(self._sched_yield(), [])
        b.branch(check)
        b.position_at_end(check)
        n2 = b.add(n, i64(1))
        n.add_incoming(n2, check)
        now = b.load_atomic(gen_p, "acquire", 8)
        b.cbranch(b.icmp_signed("==", now, gen), spin, done)
        b.position_at_end(done)
        b.ret_void()
        return fn

    def _sched_yield(self) -> ir.Function:
        f = self.module.globals.get("sched_yield")
        if f is None:
            f = ir.Function(self.module, ir.FunctionType(I32, []), "sched_yield")
        return f

    # --- steps -----------------------------------------------------------------------
    def step(self, graph: Graph, name: str, plan: ArenaPlan, state_offsets: dict[str, int],
             io_offsets: dict[str, int]) -> ir.Function:
        fn = ir.Function(self.module, STEP_TYPE, f"step_{name}")
        fn.linkage = "internal"
        ctl, tid = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))

        def base(slot: int) -> ir.Value:
            return b.inttoptr(b.load(self._slot(b, ctl, slot)), I8P)

        weights, arena, state, io = base(Ctl.WEIGHTS), base(Ctl.ARENA), base(Ctl.STATE), base(Ctl.IO)
        pos = b.load(self._slot(b, ctl, Ctl.POS))
        T = b.load(self._slot(b, ctl, Ctl.T))
        nt = b.load(self._slot(b, ctl, Ctl.NTHREADS))
        stride = b.load(self._slot(b, ctl, Ctl.SCRATCH_STRIDE))
        scratch = b.gep(base(Ctl.SCRATCH), [b.mul(tid, stride)], inbounds=True)
        null = ir.Constant(I8P, None)
        ptr: dict[int, ir.Value] = {}
        paths = {v.ref.path for v in graph.weights.values()}
        if len(paths) > 1:
            raise NotImplementedError("weights from more than one file")
        for v in graph.inputs:
            off = io_offsets.get(v.name)
            ptr[id(v)] = null if off is None else io if off == 0 else b.gep(io, [i64(off)], inbounds=True)
        for v in graph.weights.values():
            sp = self.stream.weight_ptr(b, ctl, v.name) if self.stream else None
            ptr[id(v)] = sp if sp is not None else b.gep(weights, [i64(v.ref.offset)], inbounds=True)
        segs = node_segments(graph, self.stream.sched) if self.stream else [None] * len(graph.nodes)
        sbase = self.stream.base(b, ctl) if self.stream else None
        cur_seg = -1
        for sname, v in graph.states.items():
            ptr[id(v)] = b.gep(state, [i64(state_offsets[sname])], inbounds=True)
        if self.profile:
            self._profile_mark(b, ctl, tid, start=name)
        # profiling times each op on its own, so it keeps a barrier after every one
        wait = barrier_before(graph, plan) if not self.profile else [True] * len(graph.nodes)
        for i, (node, seg) in enumerate(zip(graph.nodes, segs)):
            if seg is not None and seg > cur_seg:
                if i:   # a new segment starts once every op of the last one has finished
                    b.call(self.barrier, [ctl])
                self.stream.advance(b, ctl, tid, sbase, seg)
                cur_seg = seg
            elif i and wait[i]:
                b.call(self.barrier, [ctl])
            if get_op(node.op).updates_state:
                out = ptr[id(node.inputs[0])]
            else:
                out = b.gep(arena, [i64(plan.offsets[node.output.name])], inbounds=True)
            ptr[id(node.output)] = out
            args = [ptr[id(v)] for v in node.inputs] + [null] * (N_INPUTS - len(node.inputs))
            if node.op == "qmatmul_rows":   # the kernel writes from its block's first row on (KernelSig.of)
                out = b.gep(out, [i64(4 * int(node.attrs["row0"]))], inbounds=True)
            b.call(self.kernel(KernelSig.of(node)), [out, *args, pos, T, tid, nt, scratch])
            if self.profile:
                b.call(self.barrier, [ctl])
                self._profile_mark(b, ctl, tid)
        if not self.profile:
            b.call(self.barrier, [ctl])   # the step's results are complete before anyone reads them
        if self.stream:
            self.stream.finish(b, ctl, tid, sbase)
        if self.profile:
            self._profile_mark(b, ctl, tid, end=True)
        b.ret_void()
        return fn

    def _profile_now(self, b: ir.IRBuilder) -> ir.Value:
        """CLOCK_MONOTONIC in ns (a vDSO call, tens of ns)."""
        ts_ty = ir.LiteralStructType([I64, I64])  # struct timespec on 64-bit Linux
        clock = self.module.globals.get("clock_gettime") or ir.Function(
            self.module, ir.FunctionType(I32, [I32, ts_ty.as_pointer()]), "clock_gettime")
        ts = self._prof_ts.get(b.function.name)
        if ts is None:
            with b.goto_entry_block():
                ts = self._prof_ts[b.function.name] = b.alloca(ts_ty)
        b.call(clock, [ir.Constant(I32, _CLOCK_MONOTONIC), ts])
        sec = b.load(b.gep(ts, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
        nsec = b.load(b.gep(ts, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
        return b.add(b.mul(sec, i64(1_000_000_000)), nsec)

    def _profile_mark(self, b: ir.IRBuilder, ctl: ir.Value, tid: ir.Value, start: str | None = None,
                      end: bool = False) -> None:
        """Profiling builds: thread 0 reads the clock after an op's barrier
        and adds the time since its previous mark to that op's slot. Between
        barriers it also waits for the slowest thread, so the ops' times add
        up to the step's. ``start`` opens a step's region at Ctl.PROFILE:
        [last mark, steps run, dispatch, exit, one slot per node], where
        dispatch is the time from ``lmc_run``'s start until every thread is
        in the step (waking the workers) and exit from the last op until
        every thread is done with the step (``end``), each met at an extra
        barrier so that no op is charged for them."""
        if start is not None:
            base = self._prof_next
            self._prof_entry, self._prof_slot = start, base + PROFILE_HEADER
        else:
            base = self.profile_regions[self._prof_entry][0]
        if start is not None or end:
            b.call(self.barrier, [ctl])
        with b.if_then(b.icmp_signed("==", tid, i64(0))):
            now = self._profile_now(b)
            buf = b.inttoptr(b.load(self._slot(b, ctl, Ctl.PROFILE)), I64P)
            last_p = b.gep(buf, [i64(base)], inbounds=True)

            def accumulate(slot: int, value: ir.Value) -> None:
                p = b.gep(buf, [i64(slot)], inbounds=True)
                b.store(b.add(b.load(p), value), p)

            if start is not None:
                accumulate(base + 1, i64(1))
                accumulate(base + 2, b.sub(now, b.load(self._slot(b, ctl, Ctl.PROFILE_T0))))
            else:
                accumulate(base + 3 if end else self._prof_slot, b.sub(now, b.load(last_p)))
            b.store(now, last_p)
        if start is None and not end:
            self._prof_slot += 1
        self.profile_regions[self._prof_entry] = (base, self._prof_slot - base - PROFILE_HEADER)
        self._prof_next = self._prof_slot

    def entry_points(self, steps: list[ir.Function]) -> None:
        """``lmc_run(ctl)`` for the calling thread (tid 0) and
        ``lmc_worker(ctl, tid)`` for the others."""
        disp = ir.Function(self.module, STEP_TYPE, "lmc_dispatch")
        disp.linkage = "internal"
        ctl, tid = disp.args
        b = ir.IRBuilder(disp.append_basic_block("entry"))
        which = b.load(self._slot(b, ctl, Ctl.ENTRY))
        end = disp.append_basic_block("end")
        sw = b.switch(which, end)
        for i, s in enumerate(steps):
            blk = disp.append_basic_block(f"case{i}")
            sw.add_case(i64(i), blk)
            b.position_at_end(blk)
            b.call(s, [ctl, tid])
            b.branch(end)
        b.position_at_end(end)
        b.ret_void()

        run = ir.Function(self.module, ir.FunctionType(VOID, [I64P]), "lmc_run")
        ctl, = run.args
        b = ir.IRBuilder(run.append_basic_block("entry"))
        if self.profile:
            b.store(self._profile_now(b), self._slot(b, ctl, Ctl.PROFILE_T0))
        gen_p = self._slot(b, ctl, Ctl.GENERATION)
        b.atomic_rmw("add", gen_p, i64(1), "seq_cst")
        if self._futex is not None:
            sleepers = b.load_atomic(self._slot(b, ctl, Ctl.SLEEPERS), "seq_cst", 8)
            with b.if_then(b.icmp_signed(">", sleepers, i64(0))):
                self._futex(b, gen_p, _FUTEX_WAKE, i64(0x7FFFFFFF))
        b.call(disp, [ctl, i64(0)])
        b.call(self.barrier, [ctl])  # every thread has finished this step
        b.ret_void()
        self._emit_worker(disp)
        self._emit_stop()
        if self.stream:
            self.stream.emit_io_thread()

    def _emit_stop(self) -> None:
        """``lmc_stop(ctl)``: tell the workers to return, waking sleepers."""
        fn = ir.Function(self.module, ir.FunctionType(VOID, [I64P]), "lmc_stop")
        ctl, = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        b.store_atomic(i64(1), self._slot(b, ctl, Ctl.QUIT), "seq_cst", 8)
        gen_p = self._slot(b, ctl, Ctl.GENERATION)
        b.atomic_rmw("add", gen_p, i64(1), "seq_cst")
        if self._futex is not None:
            self._futex(b, gen_p, _FUTEX_WAKE, i64(0x7FFFFFFF))
            if self.stream:  # the I/O thread may sleep on COMP_DONE
                self._futex(b, self._slot(b, ctl, StreamSlots.COMP_DONE), _FUTEX_WAKE, i64(0x7FFFFFFF))
        b.ret_void()

    def _emit_worker(self, disp: ir.Function) -> None:
        """Wait for the generation to move, run the step, repeat until QUIT.
        Waiting spins for a while (the next step usually comes within
        microseconds), then sleeps in futex_wait so an idle model costs no
        CPU."""
        work = ir.Function(self.module, STEP_TYPE, "lmc_worker")
        ctl, tid = work.args
        blk = {n: work.append_basic_block(n) for n in
               ("entry", "loop", "spin", "idle", "check", "sleep", "dowait", "woke", "got", "run", "ret")}
        b = ir.IRBuilder(blk["entry"])
        gen_p = self._slot(b, ctl, Ctl.GENERATION)
        sl_p = self._slot(b, ctl, Ctl.SLEEPERS)
        b.branch(blk["loop"])
        b.position_at_end(blk["loop"])
        # generations start at 0; a worker that starts late still sees the
        # first step's bump (that step cannot finish without it)
        seen = b.phi(I64)
        seen.add_incoming(i64(0), blk["entry"])
        b.branch(blk["spin"])
        b.position_at_end(blk["spin"])
        n = b.phi(I64)
        n.add_incoming(i64(0), blk["loop"])
        now = b.load_atomic(gen_p, "acquire", 8)
        b.cbranch(b.icmp_signed("!=", now, seen), blk["got"], blk["idle"])
        b.position_at_end(blk["idle"])
        self._emit_pause(b)
        b.cbranch(b.icmp_signed(">", n, i64(_SPIN_LIMIT)), blk["sleep"], blk["check"])
        b.position_at_end(blk["check"])
        n.add_incoming(b.add(n, i64(1)), blk["check"])
        b.branch(blk["spin"])
        b.position_at_end(blk["sleep"])
        if self._futex is not None:
            b.atomic_rmw("add", sl_p, i64(1), "seq_cst")
            again = b.load_atomic(gen_p, "seq_cst", 8)
            b.cbranch(b.icmp_signed("==", again, seen), blk["dowait"], blk["woke"])
            b.position_at_end(blk["dowait"])
            self._futex(b, gen_p, _FUTEX_WAIT, b.and_(seen, i64(0xFFFFFFFF)))
            b.branch(blk["woke"])
            b.position_at_end(blk["woke"])
            b.atomic_rmw("sub", sl_p, i64(1), "seq_cst")
        else:  # no futex: yield the core instead
            b.call(self._sched_yield(), [])
            b.branch(blk["dowait"])
            b.position_at_end(blk["dowait"])
            b.branch(blk["woke"])
            b.position_at_end(blk["woke"])
        n.add_incoming(i64(0), blk["woke"])
        b.branch(blk["spin"])
        b.position_at_end(blk["got"])
        quit_ = b.load_atomic(self._slot(b, ctl, Ctl.QUIT), "acquire", 8)
        b.cbranch(b.icmp_signed("!=", quit_, i64(0)), blk["ret"], blk["run"])
        b.position_at_end(blk["run"])
        b.call(disp, [ctl, tid])
        b.call(self.barrier, [ctl])
        seen.add_incoming(now, blk["run"])
        b.branch(blk["loop"])
        b.position_at_end(blk["ret"])
        b.ret_void()

    @property
    def _futex(self):
        """An emitter of futex(addr, op, val) on Linux, else None."""
        nr = _FUTEX_SYSCALL.get(self.target.triple.split("-")[0])
        if nr is None or "linux" not in self.target.triple:
            return None

        def call(b: ir.IRBuilder, addr: ir.Value, op: int, val: ir.Value) -> None:
            f = self.module.globals.get("syscall") or ir.Function(
                self.module, ir.FunctionType(I64, [I64], var_arg=True), "syscall")
            b.call(f, [i64(nr), b.ptrtoint(addr, I64), i64(op), val, i64(0)])

        return call


#: futex(2) syscall numbers; the wait word is GENERATION's low 32 bits
#: (little-endian targets only, which all of these are)
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # the _PRIVATE variants
_SPIN_LIMIT = 1 << 14
_CLOCK_MONOTONIC = 1  # Linux's clock id


def lower_graphs(graphs: dict[str, Graph], plans: dict[str, ArenaPlan], target: Target,
                 vector_width: int | None = None, profile: bool = False,
                 stream: StreamSchedule | None = None, symbols: dict[str, int] | None = None,
                 external_kernels: bool = False,
                 ) -> tuple[ir.Module, dict[str, EntryInfo], dict[str, int], int]:
    """One module with a step per graph. Returns the module, entry infos,
    state offsets and the state's total size in bytes. ``profile`` builds
    time every op (see ``Lowering._profile_mark``). ``symbols``: the
    planned size of symbolic dims (``T``), for the IO area's layout.
    ``external_kernels``: the module only declares the kernels (named
    ``KernelSig.name``), which are compiled apart."""
    if profile and "linux" not in target.triple:
        raise NotImplementedError(f"profiling builds need Linux (clock_gettime), not {target.triple}")
    low = Lowering(target, vector_width or target.vector_width, profile, external_kernels)
    if stream is not None and stream.segments:
        if "linux" not in target.triple:
            raise NotImplementedError(f"layer streaming needs Linux (pread, futex), not {target.triple}")
        low.stream = StreamLowering(low, stream)
    first = next(iter(graphs.values()))
    state_offsets, state_size = state_layout(first)
    steps, infos = [], {}
    for i, (name, g) in enumerate(graphs.items()):
        if state_layout(g)[0] != state_offsets:
            raise ValueError(f"graph {name} has a different state layout")
        io_offsets, io_bytes = io_layout(g, symbols or {"T": 1})
        steps.append(low.step(g, name, plans[name], state_offsets, io_offsets))
        out = g.outputs[0]
        infos[name] = EntryInfo(name, i, dict(plans[name].offsets), plans[name].offsets[out.name],
                                tuple(out.type.shape), low.profile_regions.get(name), io_offsets, io_bytes)
    low.entry_points(steps)
    return low.module, infos, state_offsets, state_size


def barrier_module(target: Target) -> ir.Module:
    """The barrier alone, for glue that declares it (``external_kernels``):
    every thread calls it after every op, so it is compiled with the full
    code generator, while the glue's long step functions get the fast one."""
    low = Lowering(target, target.vector_width)
    low.barrier.linkage = ""   # external: the glue calls it
    return low.module
