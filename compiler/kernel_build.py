"""Get the object code of a model's kernels: from the kernel cache, or
compiled in worker processes.

llvmlite serialises every call into LLVM behind one lock, so threads
cannot compile two kernels at once; forked worker processes can (each has
its own LLVM). The build is started first and collected later, so the
caller compiles the glue module while the workers compile kernels. With
``jobs=1`` (a memory budget: one kernel module in memory at a time) or
where processes cannot be forked, kernels compile one after another in
this process.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Callable

import llvmlite

from . import kernel_cache
from .codegen.kernels import KernelSig
from .codegen.target import Target

#: kernels whose objects take longest to compile go first (better packing
#: of the last seconds over the workers)
_SLOW_OPS = ("qmatmul", "qmatmul_add", "attention", "attention_paged", "matmul")


@dataclass
class KernelStats:
    """What one build found: counted, never timed, by the tests."""

    total: int = 0
    cached: int = 0      # read from the kernel cache
    compiled: int = 0    # compiled now
    corrupt: int = 0     # damaged cache entries found, removed and compiled again
    jobs: int = 1        # processes that compiled
    compile_s: float = 0.0   # LLVM time summed over the kernels compiled

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def kernel_parts(sig: KernelSig, target: Target, vector_width: int, level: int, codegen: str) -> dict:
    """Everything a kernel's object code depends on."""
    return {"sig": repr(sig), "cpu": target.cpu, "features": target.features, "triple": target.triple,
            "vw": vector_width, "opt": level, "codegen": codegen, "llvmlite": llvmlite.__version__}


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class KernelBuild:
    """A started build; ``finish()`` returns every kernel's object code."""

    def __init__(self, sigs: list[KernelSig], target: Target, vector_width: int, level: int, codegen: str,
                 use_cache: bool = True, jobs: int | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        from .codegen.kernels import load_emitters

        load_emitters()   # before forking: the workers inherit the emitters
        self.sigs = list(dict.fromkeys(sigs))
        self.target, self.vw, self.level = target, vector_width, level
        self.use_cache = use_cache
        self.progress = progress
        self.objects: dict[KernelSig, bytes] = {}
        self.keys = {s: kernel_cache.kernel_key(kernel_parts(s, target, vector_width, level, codegen))
                     for s in self.sigs}
        self.stats = KernelStats(total=len(self.sigs))
        self.missing: list[KernelSig] = []
        for s in self.sigs:
            obj, corrupt = kernel_cache.load(self.keys[s]) if use_cache else (None, False)
            self.stats.corrupt += corrupt
            if obj is None:
                self.missing.append(s)
            else:
                self.objects[s] = obj
        self.stats.cached = len(self.objects)
        self.missing.sort(key=lambda s: s.op not in _SLOW_OPS)
        want = min(jobs or default_jobs(), len(self.missing))
        self._pool = None
        self._futures: dict[Future, KernelSig] = {}
        if want > 1:
            self._start_pool(want)
        self.stats.jobs = max(1, want if self._pool is not None else 1)
        self._say()

    def _start_pool(self, jobs: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from .codegen.objects import timed_kernel_object

        if "fork" not in multiprocessing.get_all_start_methods():
            return
        try:
            self._pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
            for s in self.missing:
                self._futures[self._pool.submit(timed_kernel_object, s, self.target, self.vw, self.level)] = s
        except (OSError, RuntimeError):
            self.close()

    def _say(self) -> None:
        if self.progress is None:
            return
        n, done = self.stats.total, len(self.objects)
        cached = f", {self.stats.cached} from the kernel cache" if self.stats.cached else ""
        procs = f" in {self.stats.jobs} processes" if self.stats.jobs > 1 else ""
        text = f"compiling for this CPU, once: kernel {done}/{n}{cached}{procs}"
        update = getattr(self.progress, "update", None)   # a StatusLine keeps its clock running
        (update or self.progress)(text)

    def _got(self, sig: KernelSig, obj: bytes, seconds: float) -> None:
        self.objects[sig] = obj
        self.stats.compiled += 1
        self.stats.compile_s += seconds
        if self.use_cache:
            kernel_cache.store(self.keys[sig], obj)
        self._say()

    def finish(self) -> dict[KernelSig, bytes]:
        """Wait for the workers (or compile here what they did not)."""
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        from .codegen.objects import timed_kernel_object

        try:
            for fut in as_completed(list(self._futures)):
                sig = self._futures[fut]
                try:
                    obj, seconds = fut.result()
                except BrokenProcessPool:
                    break   # a worker died (out of memory?): the rest compile here
                self._got(sig, obj, seconds)
        finally:
            self.close()
        for s in self.missing:
            if s not in self.objects:
                self._got(s, *timed_kernel_object(s, self.target, self.vw, self.level))
        return {s: self.objects[s] for s in self.sigs}

    def close(self) -> None:
        """Stop the workers (after ``finish``, or when the caller failed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._futures = {}
