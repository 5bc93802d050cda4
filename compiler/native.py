"""Compile a model to native code: graphs -> plans -> LLVM -> an Artifact.

The artifact holds object code for a decode step, a prefill chunk and a
prefill that keeps every row's logits, and the manifest that says where
everything lives (arena offsets, state layout, IO area, outputs). Built for
batched serving (``NativeOptions.batch``) it holds the paged batch steps
instead, ``batch`` and ``batch_last`` (and ``batch_decode``, decode rows on
the integer path, when the pipeline has ``int_dot``), over a KV pool of
blocks: a single stream's contiguous cache cannot share the pool's state
layout, and a server needs only the batch steps (one sequence is a batch of
one).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import llvmlite   # the package only: llvmlite.binding (LLVM itself) loads when code is generated

from frontends.loader import LoadedModel
from ir.graph import packed_regions
from ir.ops import get_op
from ir.ops.attention import sliding_window
from ir.printer import print_graph
from ir.switches import switch
from ir.types import DEFAULT_KV_TYPE
from passes.plan_arena import plan_arena

from . import cache, key_memo, repack_cache
from .artifact import FORMAT_VERSION, KINDS, Artifact, ArtifactError, file_fingerprint
from .codegen.ctl import PROFILE_HEADER
from .codegen.target import Target, host_target
from .host_cores import usable_cores
from .memory import plan_manifest
from .objpack import pack
from .driver import (FROM_POSITION, BatchOptions, CompileOptions, attention_tiles, build_graphs, max_blocks_per_seq,
                     repack_width)

if TYPE_CHECKING:
    from .kernel_build import KernelStats

LMC_VERSION = "0.1.0"
DEFAULT_PREFILL_CHUNK = 128


@dataclass
class NativeOptions:
    ctx: int | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    vector_width: int | None = None
    opt_level: int = 3
    use_cache: bool = True
    dump_dir: str | None = None
    dump_after: str | None = None   # with dump_dir: one pass's input and output only, or "all"
    passes: tuple[str, ...] | None = None   # default: default_pipeline("llvm")
    kv_type: str = DEFAULT_KV_TYPE    # KV cache storage: f16, f32, q8, q4, q2 ... (ir.types.KV_TYPES)
    profile: bool = False   # time every op (lmc profile); never served to a normal run
    mem_budget: int | None = None   # bytes of peak RSS the process may use (passes/memory_budget)
    stream: str | None = None       # "layers" / "all": stream at least these weights, budget or not
    head_rows: int | None = None    # rows per streamed head block (default: about a layer's bytes)
    stream_io: str = "pread"        # pread: copy into two buffers; mmap: map in place, unmap after use
    lookup_only: bool = False       # return None on a cache miss instead of compiling
    auto_ctx: bool = False          # with a budget: the planner may shorten the context
    auto_kv: bool = False           # with a budget: the planner picks the KV cache dtype
    threads: int | None = None      # for the budget's scratch estimate (default: the cores)
    jobs: int | None = None         # processes compiling kernels (default: the cores; 1 under a budget)
    #: told what is happening on a cache miss (a terminal's status line); not part of the cache key
    progress: Callable[[str], None] | None = None
    batch: BatchOptions | None = None   # paged batch entries (batch, batch_last, batch_decode), not decode/prefill
    verify: bool = False    # also the verify entry: prefill rows as decode computes them (speculative decoding)
    #: on a cache miss, return an artifact of the decode step alone as soon as its kernels are
    #: compiled; the rest of the build goes on in the background (``CompileResult.rest``)
    decode_first: bool = False


@dataclass
class CompileResult:
    artifact: Artifact
    cached: bool
    seconds: float
    cache_path: str | None = None
    graphs: dict | None = None   # the planned graphs, by entry name (None: a warm start that skipped planning)
    kernels: "KernelStats | None" = None   # what a compile found in the kernel cache and compiled
    child_peak: int | None = None        # compiled in a child process (a budget): its peak resident bytes
    #: ``decode_first``: the build of the whole artifact, still going (``artifact`` has the decode step only)
    rest: "RestOfBuild | None" = None


def scratch_floats(graphs: dict, ctx: int) -> int:
    """Per-thread scratch (float32 elements): attention scores over the whole
    context at least, and whatever any kernel's own rule asks for (attention
    scores per head, the integer path's quantized activations: a row each
    of up to ``decode_rows`` rows in ``batch_decode``, rope's cos/sin table
    and the rotated head rope_kv_write quantizes for a q8 cache)."""
    from .codegen import k_attention, k_norm_rope, matmul
    from .codegen.kernels import KernelSig

    need = ctx + 64
    for g in graphs.values():
        for n in g.nodes:
            if n.op in ("attention", "attention_paged"):
                need = max(need, int(k_attention.scratch_floats(KernelSig.of(n))))
            elif n.op in ("rope", "rope_kv_write", "rope_kv_write_paged"):
                need = max(need, int(k_norm_rope.scratch_floats(KernelSig.of(n))))
            elif n.attrs.get("act"):
                need = max(need, int(matmul.scratch_floats(KernelSig.of(n))))
    return (need + 15) // 16 * 16


@functools.cache
def codegen_fingerprint() -> str:
    """Hash of the code generator's own source: a changed kernel or lowering
    must never be served stale object code from the cache."""
    from ir.digest import sha256
    import pathlib

    h = sha256()
    here = pathlib.Path(__file__).resolve().parent
    for f in sorted([*here.rglob("*.py"), *(here.parent / "ir").rglob("*.py"), *(here.parent / "passes").rglob("*.py")]):
        h.update(str(f.relative_to(here.parent)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _target_info(t: Target) -> dict[str, Any]:
    return {"cpu": t.cpu, "features": t.features, "triple": t.triple}


def compile_native(model: LoadedModel, options: NativeOptions | None = None) -> CompileResult | None:
    """Build (or fetch from the cache) the native code for ``model``."""
    o = options or NativeOptions()
    t0 = time.perf_counter()
    target = host_target()
    versions = {"target": _target_info(target), "lmc": LMC_VERSION, "format": FORMAT_VERSION,
                "codegen": codegen_fingerprint(), "llvmlite": llvmlite.__version__}
    # a warm start skips planning when it compiled these inputs before (the
    # planned graphs are then not returned: dumps and profiles plan anyway)
    # (the repack width follows the host and LMC_REPACK, rings LMC_KV_RING, tiles LMC_ATTN_TILED,
    # not the options)
    memo = (key_memo.memo_key(model, o, {**versions, "repack": repack_width(o.vector_width),
                                         "rings": ring_rows_for(1) is not None, "kv_exact": switch("LMC_KV_EXACT"),
                                         **({"attn_tiled_from": FROM_POSITION} if attention_tiles() else {})})
            if o.use_cache and not (o.dump_dir or o.profile) else None)
    known = key_memo.recall(memo) if memo else None
    if known is not None:
        hit = _cached(known, model)
        if hit is not None:
            return CompileResult(hit, True, time.perf_counter() - t0, cache.cache_path(known))
    if o.decode_first and _can_start_first(o) and not o.lookup_only:
        return _decode_first(model, o, target, versions, memo, t0)
    planned = plan_native(model, o)
    key, hit = _key_of(model, o, planned, versions, memo)
    if hit is not None:
        return CompileResult(hit, True, time.perf_counter() - t0, cache.cache_path(key), planned.graphs)
    if o.lookup_only:
        return None
    from .kernel_build import KernelBuild

    # workers fork first, then this process lowers and compiles the glue (and
    # hashes the model file on a thread) while they compile kernels
    kernels = KernelBuild(_sigs(planned.graphs), target, o.vector_width or target.vector_width, o.opt_level,
                          codegen_fingerprint(), use_cache=o.use_cache, jobs=o.jobs, progress=o.progress)
    art, path = _link_all(model, o, target, planned, key, kernels, memo)
    return CompileResult(art, False, time.perf_counter() - t0, path, planned.graphs, kernels.stats)


def _link_all(model: LoadedModel, o: NativeOptions, target: Target, planned: NativePlan, key: str, kernels: Any,
              memo: str | None, cancelled: Callable[[], bool] = lambda: False) -> tuple[Artifact | None, str | None]:
    """Glue of every graph (compiled here while the kernel build's workers
    compile), then the whole artifact, stored in the cache; (None, None)
    when ``cancelled()`` says so once the kernels are done."""
    try:
        link = _Linker(model, o, target, planned, key)
        glue = link.glue(list(planned.graphs))
        objects = kernels.finish()
    finally:
        kernels.close()
    if cancelled():
        return None, None
    art = link.artifact(list(planned.graphs), objects, glue)
    return art, link.store(art, memo)


def _key_of(model: LoadedModel, o: NativeOptions, planned: NativePlan, versions: dict,
            memo: str | None) -> tuple[str, Artifact | None]:
    """The artifact cache's key of a plan, and the artifact when cached."""
    what = {
        "graphs": {n: print_graph(g) for n, g in planned.graphs.items()},
        "chunk": planned.chunk, "vw": o.vector_width, "opt": o.opt_level, "profile": o.profile,
        "memory": plan_manifest(planned.memory, planned.schedule) if planned.memory else None,
        **versions,   # llvmlite's version pins LLVM's; asking LLVM would load it
    }
    if planned.batch is not None:   # only then: other artifacts keep their keys
        what["batch"] = dataclasses.asdict(planned.batch)
    key = cache.cache_key(what)
    hit = _cached(key, model) if o.use_cache else None
    if hit is not None and memo:
        key_memo.remember(memo, key)
    return key, hit


def _sigs(graphs: dict) -> list:
    from .codegen.kernels import KernelSig

    return list(dict.fromkeys(KernelSig.of(node) for g in graphs.values() for node in g.nodes))


def _decode_first(model: LoadedModel, o: NativeOptions, target: Target, versions: dict, memo: str | None,
                  t0: float) -> CompileResult:
    """``NativeOptions.decode_first`` on a cache miss: plan and compile the
    decode step alone and return its artifact; the rest of the build
    (planning every graph, their kernels, the whole artifact) goes on in
    the background (``RestOfBuild``), in the same worker processes."""
    from .kernel_build import KernelBuild

    planned = plan_native(model, o, only=(FIRST_GRAPH,))
    sigs = _sigs(planned.graphs)
    kernels = KernelBuild(sigs, target, o.vector_width or target.vector_width, o.opt_level, codegen_fingerprint(),
                          use_cache=o.use_cache, jobs=o.jobs, progress=o.progress)
    try:
        link = _Linker(model, o, target, planned, None)
        glue = link.glue([FIRST_GRAPH])
        art = link.artifact([FIRST_GRAPH], kernels.wait_for(sigs), glue)
        link.finish_weights()
        rest = RestOfBuild(model, o, target, versions, memo, kernels)
    except BaseException:
        kernels.close()
        raise
    return CompileResult(art, False, time.perf_counter() - t0, None, planned.graphs, kernels.stats, rest=rest)


#: the graph a run needs first: a prompt can run as decode steps, with the
#: same bits as a prompt chunk (what ``test_repack``'s one-arithmetic test
#: checks), so a cold start waits for the decode step's kernels only
FIRST_GRAPH = "decode"


def _can_start_first(o: NativeOptions) -> bool:
    """Whether the decode step can run before the other graphs are built:
    a single stream's artifact, without a budget (one compile at a time)
    or profiling. Its prompt rows have the decode step's bits up to
    ``compiler.driver.FROM_POSITION``, where a prompt run as decode steps
    waits for the prompt chunks' kernels (``NativeExecutor._prefill_by_steps``)."""
    return o.batch is None and o.mem_budget is None and not o.stream and not o.profile and not o.dump_dir


class _Linker:
    """Glue and manifest for a plan's graphs, or some of them. It starts
    the file's fingerprint and the repacked weights' cache entry on
    threads at once, so they are made beside LLVM."""

    def __init__(self, model: LoadedModel, o: NativeOptions, target: Target, planned: NativePlan,
                 key: str | None) -> None:
        self.model, self.o, self.target, self.planned, self.key = model, o, target, planned, key
        self.regions = packed_regions(w.ref for g in planned.graphs.values() for w in g.weights.values())
        _check_disjoint(self.regions)
        self.fingerprint = _in_background(file_fingerprint, model.path)
        # repacked weights are built now, beside LLVM, and cached for the runtime to map
        self._repacked = (_in_background(_prepare_repacked, model, self.fingerprint, self.regions)
                          if o.use_cache and repack_cache.repack_regions(self.regions) else None)

    def glue(self, names: list[str]) -> tuple[bytes, bytes, dict, dict, int]:
        from .codegen.lower import lower_graphs
        from .codegen.objects import barrier_object, glue_object

        p, o = self.planned, self.o
        graphs = {n: p.graphs[n] for n in names}
        module, entries, state_offsets, state_bytes = lower_graphs(graphs, {n: p.plans[n] for n in names}, self.target,
                                                                   o.vector_width, profile=o.profile,
                                                                   stream=p.schedule, symbols=p.symbols,
                                                                   external_kernels=True)
        glue = glue_object(module, [s.name for s in _sigs(graphs)], self.target, o.opt_level)
        return glue, barrier_object(self.target, o.opt_level), entries, state_offsets, state_bytes

    def finish_weights(self) -> None:
        """Wait for the repacked weights' cache entry (the runtime maps it)."""
        if self._repacked is not None:
            self._repacked()

    def store(self, art: Artifact, memo: str | None) -> str | None:
        """Put ``art`` in the artifact cache (and the memo's key beside it)."""
        self.finish_weights()
        path = cache.store(self.key, art) if self.o.use_cache else None
        if path and memo:
            key_memo.remember(memo, self.key)
        return path

    def artifact(self, names: list[str], objects: dict, glue: tuple) -> Artifact:
        import llvmlite.binding as llvm

        p, o, target = self.planned, self.o, self.target
        graphs, plans, memory, sched, ctx, chunk = p.graphs, p.plans, p.memory, p.schedule, p.ctx, p.chunk
        glue_obj, barrier, entries, state_offsets, state_bytes = glue
        obj = pack([glue_obj, barrier, *(objects[s] for s in _sigs({n: graphs[n] for n in names}))])
        manifest = {
            "format_version": FORMAT_VERSION,
            "lmc_version": LMC_VERSION,
            "llvm": ".".join(map(str, llvm.llvm_version_info)),
            "target": _target_info(target),
            "vector_width": o.vector_width or target.vector_width,
            "cache_key": self.key,
            "model": {"path": os.path.abspath(self.model.path), "format": self.model.format, **self.fingerprint()},
            "tokenizer": getattr(self.model.tokenizer, "path", None),
            "config": dataclasses.asdict(self.model.config),
            "ctx": ctx,
            "kv_type": next(iter(graphs.values())).meta.get("kv_type", "f32"),
            "prefill_chunk": chunk,
            "ring_slack": next(iter(graphs.values())).meta.get("ring_slack"),
            "entries": {n: {"index": e.index, "output_offset": e.output_offset,
                            "output_shape": list(e.output_shape), "inputs": e.inputs} for n, e in entries.items()},
            "io_bytes": max(e.io_bytes for e in entries.values()),
            "arena_bytes": max(plans[n].size for n in names),
            "plans": {n: {"size": plans[n].size, "lower_bound": plans[n].lower_bound,
                          "no_sharing": plans[n].no_sharing, "strategy": plans[n].strategy} for n in names},
            "state_offsets": state_offsets,
            "state_bytes": state_bytes,
            "scratch_floats": scratch_floats({n: graphs[n] for n in names}, ctx),
            "kernels": sorted({nd.op for n in names for nd in graphs[n].nodes}),
            "updates_state": sorted({nd.op for n in names for nd in graphs[n].nodes if get_op(nd.op).updates_state}),
        }
        if o.profile:
            manifest["profile"] = {"slots": max(e.profile[0] + PROFILE_HEADER + e.profile[1] for e in entries.values()),
                                   "entries": {n: {"base": e.profile[0], "nodes": e.profile[1]}
                                               for n, e in entries.items()}}
        if memory is not None:
            manifest["memory"] = plan_manifest(memory, sched)
        if p.batch is not None:
            manifest["batch"] = batch_manifest(p.batch, ctx, p.symbols["T"], next(iter(graphs.values())))
        if self.regions:  # compressed layers, repacked weights: the runtime builds the weight image (runtime/weight_image.py)
            manifest["image"] = {"size": max(r.image_offset + r.size for r in self.regions),
                                 "regions": [dataclasses.asdict(r) for r in self.regions]}
        return Artifact(manifest, obj)


#: the longest the rest of a decode-first build waits for the model's first step
#: (``RestOfBuild.start``; a chat waiting for its first message never takes one)
START_WAIT_S = 2.0


class RestOfBuild:
    """The rest of a ``decode_first`` build, on a thread: every graph
    planned, the kernels the decode step did not need compiled in the same
    worker processes (at the lowest priority: the model runs meanwhile),
    the whole artifact linked and cached. ``result`` waits for it;
    ``cancel`` stops it (a run that ends first: the kernels compiled so
    far stay in the kernel cache, and the next start needs fewer)."""

    def __init__(self, model: LoadedModel, o: NativeOptions, target: Target, versions: dict, memo: str | None,
                 kernels: Any) -> None:
        import threading

        self._args = (model, o, target, versions, memo)
        self._pid = os.getpid()
        self._kernels = kernels
        kernels.progress = None   # the terminal's status line has moved on
        kernels.yield_cpu()
        self._done = threading.Event()
        self._go = threading.Event()
        self._cancelled = False
        self._result: CompileResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Artifact], None]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="lmc-compile-rest", daemon=True)
        self._thread.start()
        # a process that ends first must not wait for the workers' kernels: concurrent.futures
        # waits for them in a threading-atexit call, and those run last registered, first called
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self.cancel)

    def _build(self) -> CompileResult | None:
        model, o, target, versions, memo = self._args
        if self._cancelled:
            self._kernels.close()
            return None
        planned = plan_native(model, o)
        key, hit = _key_of(model, o, planned, versions, memo)
        if hit is not None or self._cancelled:
            self._kernels.close()
            return CompileResult(hit, True, time.perf_counter() - self._t0, cache.cache_path(key),
                                 planned.graphs) if hit is not None else None
        kernels = self._kernels
        kernels.add(_sigs(planned.graphs))
        art, path = _link_all(model, o, target, planned, key, kernels, memo, lambda: self._cancelled)
        if art is None:
            return None
        return CompileResult(art, False, time.perf_counter() - self._t0, path, planned.graphs, kernels.stats)

    def start(self) -> None:
        """The model has taken its first step: plan and compile the rest now.
        Until then (or ``START_WAIT_S``) the planning, Python under the GIL,
        stays out of the way of the model's own start: beside it, Gemma 3's
        executor took 0.36 s to set up instead of ~0.1 s."""
        self._go.set()

    def _run(self) -> None:
        try:
            self._go.wait(START_WAIT_S)
            result = self._build()
            with self._lock:   # whoever result() wakes finds the artifact offered already
                self._result, callbacks, self._callbacks = result, self._callbacks, []
            if result is not None:
                for cb in callbacks:
                    cb(result.artifact)
        except BaseException as e:   # told to whoever waits
            self._error = e
        finally:
            self._done.set()

    def when_done(self, callback: Callable[[Artifact], None]) -> None:
        """Call ``callback(artifact)`` (on the build's thread) when the
        whole artifact is built; at once if it already is."""
        with self._lock:
            if self._result is None:
                self._callbacks.append(callback)
                return
        callback(self._result.artifact)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> CompileResult:
        """Wait for the whole artifact (the workers get their priority back:
        the caller waits for them)."""
        if not self._done.is_set():
            self._kernels.take_cpu()
        self._go.set()
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the build was cancelled")
        return self._result

    def cancel(self) -> None:
        if os.getpid() != self._pid:   # a forked compile worker at its exit: the atexit call is inherited
            return
        self._cancelled = True
        self._go.set()
        self._kernels.cancel()


def _check_disjoint(regions: list) -> None:
    """The image regions of all graphs, in image order, must not overlap:
    every graph of a model places a weight at the same offset."""
    for a, b in zip(regions, regions[1:]):
        if b.image_offset < a.image_offset + a.size:
            raise RuntimeError(f"weight image regions overlap at {b.image_offset}: the graphs disagree "
                               "on where a repacked or decompressed weight lies")


def _prepare_repacked(model: LoadedModel, fingerprint: Callable[[], Any], regions: list) -> None:
    repack_cache.prepare(model.path, repack_cache.cache_key({"format": model.format, **fingerprint()}, regions),
                         regions)


def _cached(key: str, model: LoadedModel) -> Artifact | None:
    """The cached artifact ``key``, if it was built from a file of this size."""
    hit = cache.lookup(key)
    if hit is None or hit.manifest.get("model", {}).get("size") != os.path.getsize(model.path):
        return None
    hit.manifest["model"]["path"] = os.path.abspath(model.path)
    hit.manifest["tokenizer"] = getattr(model.tokenizer, "path", None)
    return hit


def _in_background(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """Run ``fn(*args)`` on a thread now; the returned call waits for its
    result (or raises its exception)."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:   # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="lmc-fingerprint", daemon=True)
    t.start()

    def result() -> Any:
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result


@dataclass
class NativePlan:
    """Everything decided before code generation: graphs, arena plans, the
    memory plan and stream schedule (with a budget), the KV length, the
    rows a step is planned for and the batch options (filled in)."""

    graphs: dict
    plans: dict
    memory: Any
    schedule: Any
    ctx: int
    chunk: int
    symbols: dict | None = None
    batch: BatchOptions | None = None


def ring_rows_for(chunk: int) -> int | None:
    """The rows a step writes, for sizing sliding-window rings; None with
    ``LMC_KV_RING=0`` (whole caches: for comparisons, as LMC_REPACK=0)."""
    return chunk if switch("LMC_KV_RING") else None


def plan_native(model: LoadedModel, o: NativeOptions, only: tuple[str, ...] | None = None) -> NativePlan:
    """The planning half of ``compile_native`` (``lmc plan`` stops here).
    ``only``: plan these graphs alone (``decode_first``; no budget)."""
    ctx = o.ctx or model.config.seq_len
    chunk = max(1, min(o.prefill_chunk, ctx))
    batch = o.batch.resolved(ctx) if o.batch is not None else None
    if batch is not None and (o.mem_budget is not None or o.stream):
        raise ValueError("batched serving (a paged KV pool) does not take a memory budget or streamed weights yet")
    # streamed weights are repacked too (read from the repacked bytes' file): a budget
    # changes where a weight lives, never the arithmetic a token sees
    rw = repack_width(o.vector_width)
    graphs = build_graphs(model, CompileOptions(backend="llvm", ctx=ctx, dump_dir=o.dump_dir, passes=o.passes,
                                                kv_type=o.kv_type, dump_after=o.dump_after, batch=batch,
                                                verify=o.verify and batch is None, repack_width=rw,
                                                max_rows=ring_rows_for(chunk), attn_tiled=attention_tiles()),
                          only=only)
    # a batch step takes a decode row per sequence or one sequence's prompt chunk
    symbols = {"T": max(chunk, batch.max_batch) if batch is not None else chunk}
    plans = {name: plan_arena(g, symbols) for name, g in graphs.items()}
    memory, sched = None, None
    if o.mem_budget is not None or o.stream:
        memory, sched, graphs, plans, ctx = _fit_budget(model, o, graphs, plans, ctx, symbols, rw)
    return NativePlan(graphs, plans, memory, sched, ctx, chunk, symbols, batch)


def batch_manifest(batch: BatchOptions, ctx: int, rows: int, graph) -> dict[str, Any]:
    """The pool as the runtime needs it: blocks, rows per step, and the
    bytes of one block of each state (for ``copy_block``)."""
    return {"block_size": batch.block_size, "n_blocks": batch.n_blocks, "max_batch": batch.max_batch,
            "max_blocks_per_seq": max_blocks_per_seq(ctx, batch.block_size), "max_rows": rows,
            "window": sliding_window(graph),
            "block_bytes": {name: v.type.nbytes() // int(v.type.shape[0]) * batch.block_size
                            for name, v in graph.states.items()}}


def _fit_budget(model: LoadedModel, o: NativeOptions, graphs: dict, plans: dict, ctx: int,
                symbols: dict, repack_width: int | None) -> tuple:
    """Plan memory for ``o.mem_budget``; rebuild the graphs when the plan
    changes the KV cache or splits the head. Raises BudgetError."""
    from passes.memory_budget import plan_memory
    from passes.stream_schedule import build_schedule

    from .memory import model_sizes

    sizes = model_sizes(model, graphs, plans, scratch_floats(graphs, 0), 2 << 20, ctx)
    kv = getattr(o, "kv_type", None)
    mp = plan_memory(sizes, o.mem_budget, o.threads or usable_cores(),
                     ctx=None if o.auto_ctx else ctx, kv_type=None if (o.auto_kv or not kv) else kv,
                     stream=o.stream)
    if o.head_rows and mp.stream_head:
        mp.head_rows = o.head_rows
    split = {name: mp.head_rows for name in mp.stream_head}
    cur_kv = next(iter(graphs.values())).meta.get("kv_type", "f32")
    if mp.ctx != ctx or mp.kv_type != cur_kv or split:
        graphs = build_graphs(model, CompileOptions(backend="llvm", ctx=mp.ctx, dump_dir=o.dump_dir,
                                                    passes=o.passes, kv_type=mp.kv_type, split_rows=split,
                                                    dump_after=o.dump_after, verify=o.verify,
                                                    repack_width=repack_width, max_rows=ring_rows_for(symbols["T"]),
                                                    attn_tiled=attention_tiles()))
        plans = {name: plan_arena(g, symbols) for name, g in graphs.items()}
    repacked = repack_cache.repack_regions(packed_regions(w.ref for g in graphs.values() for w in g.weights.values()))
    sched = build_schedule(graphs, mp.stream_layers, mp.stream_head, o.stream_io,
                           repack_cache.span(repacked)[0] if repacked else None) if mp.streaming else None
    if sched is not None:  # the exact buffer size, now that the segments are known
        mp.buffer_bytes = sched.buffer_bytes
        mp.categories["stream buffers"] = 2 * sched.buffer_bytes
    return mp, sched, graphs, plans, mp.ctx


def check_artifact(art: Artifact, name: str, model_path: str | None = None) -> None:
    """Refuse an artifact built for another CPU or another model file."""
    t = host_target()
    want = art.manifest.get("target", {})
    if want.get("cpu") != t.cpu or want.get("features") != t.features:
        raise ArtifactError(f"{name}: built for CPU {want.get('cpu')} with other features; this machine is "
                            f"{t.cpu}: recompile it here")
    m = art.manifest.get("model", {})
    path = model_path or m.get("path")
    if not path or not os.path.exists(path):
        raise ArtifactError(f"{name}: its model file {path} is missing")
    fp = file_fingerprint(path, next((k for k in KINDS if k in m), None))   # the kind it recorded
    if any(fp.get(k) != m.get(k) for k in fp):
        raise ArtifactError(f"{name}: built for another model file than {path} (size or hash differ)")
