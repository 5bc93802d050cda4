"""Building a model's executor: the interpreter over its graphs, or native
code from the compiler (the compile cache, an artifact, a compile in a
child process under a memory budget).

The single-stream ``Model`` and the batch engine's model
(``runtime.engine.loading``) are both built here, and so are the drafters
compiled beside them (``runtime.speculative.build``): one place decides how
options become an executor, what is refused, and what the compile says on
a terminal.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from compiler.artifact import Artifact
from compiler.driver import BatchOptions, CompileOptions, LoadedModel, build_graphs, load_model
from ir.types import DEFAULT_KV_TYPE, KV_TYPES

from .errors import RunError
from .executor import InterpExecutor

#: KV cache length when the user gives none: a model's own context can be
#: 32768 or more, which would cost gigabytes of cache up front (-c raises it)
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class BuildOptions:
    """How executors are built: the same for a model and the drafter
    compiled beside it. ``passes``: the compiler's pass list, None for the
    backend's default; ``status(text)`` is told of slow steps (a
    terminal's status line)."""

    backend: str = "llvm"
    threads: int | None = None
    use_cache: bool = True
    passes: tuple[str, ...] | None = None
    status: Callable[[str], None] | None = None


@dataclass
class BuiltExecutor:
    """An executor and what it was built with."""

    executor: Any
    ctx: int
    kv_type: str
    kv_bytes: int
    #: the KV pool's options when built for batched serving, else None
    batch: BatchOptions | None
    compile_info: dict = field(default_factory=dict)


def check_run_options(loaded: LoadedModel, ctx: int | None, threads: int | None, kv_type: str | None) -> int:
    """Refuse impossible options in one line; the context to build for."""
    cfg = loaded.config
    if ctx is not None and not 0 < ctx <= cfg.seq_len:
        raise RunError(f"--ctx {ctx}: must be between 1 and the model's context {cfg.seq_len}")
    if threads is not None and not 0 < threads <= 256:
        raise RunError(f"--threads {threads}: must be between 1 and 256")
    if kv_type is not None and kv_type not in KV_TYPES:
        raise RunError(f"--kv-type {kv_type}: unknown KV cache type (one of {', '.join(KV_TYPES)})")
    return ctx or min(cfg.seq_len, DEFAULT_CTX)


def f32_executor(loaded: LoadedModel, build: BuildOptions) -> Callable[[int], Any]:
    """positions -> an executor of ``loaded`` with an f32 cache of that many
    positions (what ``key_offsets`` calibrates with)."""
    return lambda n: build_executor(loaded, build, n, kv_type="f32").executor


def build_executor(loaded: LoadedModel, build: BuildOptions, ctx: int, *, artifact: Artifact | None = None,
                   user_ctx: bool = True, mem_budget: int | None = None, stream: str | None = None,
                   kv_type: str | None = None, stream_io: str = "pread", batch: BatchOptions | None = None,
                   verify: bool = False, decode_first: bool = False) -> BuiltExecutor:
    """The executor of ``loaded`` for a KV cache of ``ctx`` positions (an
    artifact's own context wins). ``mem_budget``: bytes of peak resident
    memory for the whole process (llvm backend): weights may stream from
    disk and, unless ``user_ctx``, the context shrink to fit. ``kv_type``:
    f16 (the default), f32 or q8; None lets a budget choose. ``batch``:
    the paged batch steps (``runtime.paged``) instead of decode/prefill.
    ``verify``: also the speculative ``verify`` step. ``decode_first``: on
    a cache miss, start as soon as the decode step is compiled (a prompt
    runs as decode steps meanwhile) and take the prompt chunks' code when
    the rest is built (``compiler.native.RestOfBuild``)."""
    if batch is not None:
        try:
            batch = batch.resolved(ctx)
        except ValueError as e:
            raise RunError(str(e)) from None
    if build.backend not in ("interp", "llvm"):
        raise RunError(f"--backend {build.backend}: unknown backend (available: llvm, interp)")
    from .key_offsets import attach

    # a low-bit cache's keys are stored minus the model's key offsets (calibrated once)
    koff = attach(loaded, kv_type, build.status, f32_executor(loaded, build)) if artifact is None else {}
    if build.backend == "interp":
        from compiler.native import DEFAULT_PREFILL_CHUNK

        graphs = build_graphs(loaded, CompileOptions(backend="interp", ctx=ctx, passes=build.passes,
                                                     kv_type=kv_type or DEFAULT_KV_TYPE, batch=batch, verify=verify))
        ex = InterpExecutor(graphs, max_rows=max(DEFAULT_PREFILL_CHUNK, batch.max_batch) if batch else None)
        return BuiltExecutor(ex, ctx, kv_type or DEFAULT_KV_TYPE, sum(int(a.nbytes) for a in ex.state.values()), batch,
                             koff)
    from compiler.native import NativeOptions, compile_native

    from .native import NativeExecutor

    info: dict = dict(koff)
    res = None
    if artifact is None:
        opts = NativeOptions(ctx=ctx, use_cache=build.use_cache, passes=build.passes, kv_type=kv_type or DEFAULT_KV_TYPE,
                             progress=build.status, batch=batch, verify=verify, decode_first=decode_first)
        if mem_budget is not None or stream:
            opts.mem_budget, opts.auto_ctx, opts.threads = mem_budget, not user_ctx, build.threads
            opts.auto_kv, opts.stream, opts.stream_io = True, stream, stream_io
        if kv_type is not None:
            opts.auto_kv = False  # the user chose the KV cache type
        res = compile_within_budget(loaded, opts) if opts.mem_budget is not None and build.use_cache \
            else compile_native(loaded, opts)
        artifact = res.artifact
        info.update({"compile_s": round(res.seconds, 4), "cache_hit": res.cached})
        if res.kernels is not None:
            info.update(kernels_compiled=res.kernels.compiled, kernels_cached=res.kernels.cached)
        if res.child_peak:
            info["compile_child_peak_bytes"] = res.child_peak
        if res.rest is not None:
            info["decode_first"] = True
        if build.status is not None and res.rest is not None:
            build.status(f"compiled the decode step in {res.seconds:.1f} s; the prompt kernels go on compiling "
                         "in the background")
        elif build.status is not None and not res.cached:
            build.status(f"compiled for this CPU in {res.seconds:.1f} s" +
                         (" (cached for next time)" if build.use_cache else ""))
    elif mem_budget is not None:
        check_artifact_budget(artifact, mem_budget, loaded.path)
    man = artifact.manifest
    if man.get("batch"):
        b = man["batch"]
        batch = BatchOptions(int(b["block_size"]), int(b["n_blocks"]), int(b["max_batch"]))
    early = res is not None and res.rest is not None
    ex = NativeExecutor(artifact, loaded.path, build.threads, settle_later=early)
    if early:
        ex.follow(res.rest)
    return BuiltExecutor(ex, int(man["ctx"]), man.get("kv_type", "f32"), int(man["state_bytes"]), batch, info)


def read_artifact(path: str | os.PathLike, tokenizer: str | os.PathLike | None, backend: str,
                  kv_type: str | None) -> tuple[Artifact, LoadedModel]:
    """A compiled artifact (``lmc compile``), checked against this CPU and
    its model file, and that model file read."""
    from compiler.native import check_artifact

    art = Artifact.read(path)
    check_artifact(art, os.fspath(path))
    man = art.manifest
    loaded = load_model(man["model"]["path"],
                        tokenizer or separate_tokenizer(man["model"]["path"], man.get("tokenizer")))
    if backend != "llvm":
        raise RunError(f"{path}: an artifact runs on the llvm backend only")
    if kv_type is not None and kv_type != man.get("kv_type", "f32"):
        raise RunError(f"{path}: compiled with --kv-type {man.get('kv_type', 'f32')}, not {kv_type} "
                       f"(recompile it with --kv-type {kv_type})")
    return art, loaded


def return_freed_memory() -> None:
    """Loading and planning leave freed heap behind (graphs, the tokenizer's
    build); under a budget, give it back to the system before the run
    grows the resident set (glibc keeps freed memory otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):   # not glibc
        pass


def separate_tokenizer(model_path: str, tokenizer: str | None) -> str | None:
    """The tokenizer file to pass along, or None when the model carries its
    own (GGUF, QSF: its tokenizer's path is the model's)."""
    # realpath: the tokenizer records its resolved path, the model path may pass through a symlink
    if tokenizer is None or os.path.realpath(tokenizer) == os.path.realpath(model_path):
        return None
    return tokenizer


def compile_child(path: str, tokenizer: str | None, opts: Any, said: Any = None, result: Any = None) -> None:
    """The compile child of ``compile_within_budget`` (a spawned process).
    ``said``: a queue the child's progress lines go to (the parent's status
    line). It loads the model as a fresh ``lmc run`` would, and where that
    plus LLVM would pass the budget it compiles nothing and puts
    ("refuse", its need) on ``result`` (the parent refuses with it): the
    parent's own resident set says nothing of the child's (a long-running
    caller's may be gigabytes). Else it compiles and puts ("peak", its peak
    resident bytes)."""
    from compiler.codegen.k_sampler import prepare
    from compiler.compile_memory import compile_peak_estimate, peak_resident_bytes, resident_bytes
    from compiler.native import compile_native

    loaded = load_model(path, tokenizer)
    here = resident_bytes()
    need = compile_peak_estimate(here) if here is not None else None
    if result is not None and need is not None and need > opts.mem_budget:
        result.put(("refuse", need))
        return
    if said is not None:
        import dataclasses

        opts = dataclasses.replace(opts, progress=lambda text: said.put(f"{text} (in a child process, to stay "
                                                                        f"within the budget)"))
    compile_native(loaded, opts)
    prepare()   # sampling's own native code, so the parent starts no LLVM either
    if result is not None:
        result.put(("peak", peak_resident_bytes()))


def check_artifact_budget(artifact: Artifact, budget: int, model_path: str) -> None:
    """A compiled model runs with the memory plan it was compiled for: refuse
    a budget smaller than that plan (or a budget at all, when it was compiled
    without one and so keeps every weight resident) instead of exceeding it."""
    from passes.memory_budget import fmt_size

    plan = artifact.manifest.get("memory")
    again = f"compile it again for this budget (`lmc compile {model_path} --mem-budget {size_arg(budget)} -o ...`)"
    if not plan:
        raise RunError(f"--mem-budget {fmt_size(budget)}: this compiled model was built without a memory budget "
                       f"(every weight resident); {again}")
    if int(plan["total"]) > budget:
        raise RunError(f"--mem-budget {fmt_size(budget)}: this compiled model was planned for "
                       f"{fmt_size(int(plan['total']))} ({plan.get('describe', '')}); {again}")


def compile_within_budget(loaded: LoadedModel, opts: Any) -> Any:
    """With a memory budget, LLVM runs in a child process that fills the
    compile cache, one kernel module at a time (``jobs=1``); this process
    then loads the artifact, so its own peak stays within the budget. Where
    the child would need more than the budget, refuse and say how to
    compile once elsewhere (``lmc compile``: its artifacts and cache
    entries then run within the budget)."""
    import dataclasses
    import multiprocessing

    from compiler.native import compile_native
    from passes.memory_budget import fmt_size

    t0 = time.perf_counter()
    res = compile_native(loaded, dataclasses.replace(opts, lookup_only=True))  # plans; BudgetError here
    if res is not None:
        return res
    if opts.progress is not None:
        opts.progress("compiling for this CPU, once (in a child process, to stay within the budget)")
    mp = multiprocessing.get_context("spawn")
    said = mp.SimpleQueue() if opts.progress is not None else None
    result = mp.SimpleQueue()
    child = mp.Process(
        target=compile_child, args=(loaded.path, separate_tokenizer(loaded.path, getattr(loaded.tokenizer, "path",
                                                                                         None)),
                                    # a callback does not pickle; one kernel module in memory at a time
                                    dataclasses.replace(opts, progress=None, jobs=1), said, result),
        name="lmc-compile")
    child.start()
    while True:
        child.join(0.1)
        while said is not None and not said.empty():
            text = said.get()
            (getattr(opts.progress, "update", None) or opts.progress)(text)
        if child.exitcode is not None:
            break
    what, figure = result.get() if not result.empty() else (None, None)
    if what == "refuse":   # the child found that LLVM would not fit: nothing was compiled
        name = os.path.basename(loaded.path)
        flags = f" -t {opts.threads}" if opts.threads else ""   # the plan's scratch is per thread
        tok = separate_tokenizer(loaded.path, getattr(loaded.tokenizer, "path", None))
        flags += f" -z {tok}" if tok else ""
        raise RunError(f"--mem-budget {fmt_size(opts.mem_budget)}: compiling {name} for this CPU needs about "
                       f"{fmt_size(figure)} once (LLVM), more than the budget; compile it once where that fits "
                       f"(`lmc compile {loaded.path} --mem-budget {size_arg(opts.mem_budget)}{flags} -o "
                       f"{os.path.splitext(name)[0]}.lmc`, on this machine or one with the same CPU), "
                       f"then its runs stay within the budget")
    res = compile_native(loaded, dataclasses.replace(opts, lookup_only=True))
    if res is None:  # the child failed: compile here after all, and say so in the stats
        res = compile_native(loaded, opts)
    res.cached, res.seconds = False, time.perf_counter() - t0
    res.child_peak = figure if what == "peak" and figure else largest_child_rss()
    return res


def size_arg(n: int) -> str:
    """``n`` bytes as a --mem-budget argument (``parse_size``'s M and G are binary)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def largest_child_rss() -> int | None:
    """Peak resident bytes of the largest child process waited for (Linux
    reports KiB): the compile child's peak, for the stats."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 or None
    except (ImportError, OSError):
        return None


def loading_text(path: str) -> str:
    """What a cold load is about to do: a GGUF whose metadata was never read
    takes seconds (a large vocabulary), every later load milliseconds."""
    from frontends import gguf_cache

    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            first = f.read(4) == b"GGUF"
    except OSError:
        return f"loading {name}"
    if first and not gguf_cache.is_cached(path):
        return f"loading {name}: reading its metadata and vocabulary, once"
    return f"loading {name}"
