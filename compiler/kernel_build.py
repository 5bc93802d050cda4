"""Get the object code of a model's kernels: from the kernel cache, or
compiled in worker processes.

llvmlite serialises every call into LLVM behind one lock, so threads
cannot compile two kernels at once; forked worker processes can (each has
its own LLVM). The build is started first and collected later, so the
caller compiles the glue module while the workers compile kernels. A
build can hand over its kernels as soon as they are done (``wait_for``: a
decode step's), then take more (``add``) for the same workers; ``cancel``
stops them where they are (what is done stays in the kernel cache). With
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
from .host_cores import usable_cores

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


class KernelBuild:
    """A started build; ``finish()`` returns every kernel's object code."""

    def __init__(self, sigs: list[KernelSig], target: Target, vector_width: int, level: int, codegen: str,
                 use_cache: bool = True, jobs: int | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        from .codegen.kernels import load_emitters

        load_emitters()   # before forking: the workers inherit the emitters
        self.target, self.vw, self.level, self.codegen = target, vector_width, level, codegen
        self.use_cache = use_cache
        self.progress = progress
        self.sigs: list[KernelSig] = []
        self.objects: dict[KernelSig, bytes] = {}
        self.keys: dict[KernelSig, str] = {}
        self.stats = KernelStats()
        self.missing: list[KernelSig] = []
        self._look_up(sigs)
        self.jobs = jobs or usable_cores()
        want = min(self.jobs, len(self.missing))
        self._pool = None
        self._futures: dict[Future, KernelSig] = {}
        if want > 1:
            self._start_pool(want)
            self._submit(self.missing)
        self.stats.jobs = max(1, want if self._pool is not None else 1)
        self._niced = False
        self._cancelled = False
        self._say()

    def add(self, sigs: list[KernelSig]) -> None:
        """More kernels for the same build (the rest of a ``decode_first``
        build): from the kernel cache, else to the workers still running."""
        todo = self._look_up(sigs)
        if self._pool is None and min(self.jobs, len(todo)) > 1:
            self._start_pool(min(self.jobs, len(todo)))
        self._submit(todo)
        self.stats.jobs = max(self.stats.jobs, len(self._processes()))
        if self._niced:
            self.yield_cpu()

    def _look_up(self, sigs: list[KernelSig]) -> list[KernelSig]:
        """Take ``sigs`` (those not in the build yet) from the kernel cache;
        the ones missing there, slowest first, are also noted as missing."""
        new = [s for s in dict.fromkeys(sigs) if s not in self.keys]
        todo = []
        for s in new:
            self.keys[s] = kernel_cache.kernel_key(kernel_parts(s, self.target, self.vw, self.level, self.codegen))
            obj, corrupt = kernel_cache.load(self.keys[s]) if self.use_cache else (None, False)
            self.stats.corrupt += corrupt
            if obj is None:
                todo.append(s)
            else:
                self.objects[s] = obj
                self.stats.cached += 1
        todo.sort(key=lambda s: s.op not in _SLOW_OPS)
        self.sigs += new
        self.missing += todo
        self.stats.total = len(self.sigs)
        return todo

    def _submit(self, sigs: list[KernelSig]) -> None:
        """Hand ``sigs`` to the workers (none: ``finish`` compiles them here)."""
        if self._pool is None:
            return
        from .codegen.objects import timed_kernel_object

        try:
            for s in sigs:
                self._futures[self._pool.submit(timed_kernel_object, s, self.target, self.vw, self.level)] = s
        except (OSError, RuntimeError):   # no fork, or the pool broke: finish compiles them here
            self.close()

    def _start_pool(self, jobs: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if "fork" not in multiprocessing.get_all_start_methods():
            return
        try:
            self._pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
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

    def wait_for(self, sigs: list[KernelSig]) -> dict[KernelSig, bytes]:
        """The object code of ``sigs`` (a subset of the build's), once they
        are done; the workers go on with the rest."""
        from concurrent.futures import FIRST_COMPLETED, wait

        from .codegen.objects import timed_kernel_object

        while any(s not in self.objects for s in sigs) and self._futures:
            done = [f for f in self._futures if f.done()]
            if not done:
                wait(list(self._futures), return_when=FIRST_COMPLETED)
            elif not self._collect(done):
                break
        for s in sigs:   # no workers (or they died): compile here
            if s not in self.objects:
                self._got(s, *timed_kernel_object(s, self.target, self.vw, self.level))
        return {s: self.objects[s] for s in sigs}

    def _collect(self, futures) -> bool:
        """Take the results of finished ``futures``; False when a worker
        died (out of memory?): the pool is closed and the rest compile here."""
        from concurrent.futures.process import BrokenProcessPool

        for fut in futures:
            sig = self._futures.pop(fut)
            try:
                obj, seconds = fut.result()
            except BrokenProcessPool:
                self.close()
                return False
            self._got(sig, obj, seconds)
        return True

    def finish(self) -> dict[KernelSig, bytes]:
        """Wait for the workers (or compile here what they did not)."""
        from concurrent.futures import as_completed

        from .codegen.objects import timed_kernel_object

        try:
            for fut in as_completed(list(self._futures)):
                if fut in self._futures and not self._collect([fut]):
                    break
        finally:
            self.close()
        for s in self.missing:
            if s not in self.objects and not self._cancelled:
                self._got(s, *timed_kernel_object(s, self.target, self.vw, self.level))
        return {s: self.objects[s] for s in self.sigs if s in self.objects}

    def _processes(self) -> list:
        # ProcessPoolExecutor keeps its processes private (3.14 adds terminate_workers())
        return list(getattr(self._pool, "_processes", {}).values()) if self._pool is not None else []

    def yield_cpu(self) -> None:
        """The workers go on at the lowest priority: a model is running on
        the cores now, and its first tokens should not wait for kernels it
        does not need yet."""
        self._niced = True
        self._renice(19)

    def take_cpu(self) -> None:
        """Back to the priority the workers started with, where the system
        lets a process raise it again (root, or RLIMIT_NICE): someone now
        waits for the kernels and nothing else of ours runs. At the lowest
        priority, beside a busy neighbour (two test workers on two cores),
        the rest of Gemma's build took 237 s instead of ~10."""
        self._niced = False
        self._renice(os.getpriority(os.PRIO_PROCESS, 0))

    def _renice(self, nice: int) -> None:
        """Every worker to ``nice``, as far as the system allows (a worker
        gone already, a priority we may not raise again, not POSIX: left as is)."""
        for p in self._processes():
            try:
                os.setpriority(os.PRIO_PROCESS, p.pid, nice)
            except (OSError, AttributeError):
                pass

    def cancel(self) -> None:
        """Stop now: queued kernels are dropped and the workers killed in
        the middle of a kernel (a process exiting must not wait seconds for
        one); kernels already done are in the kernel cache."""
        self._cancelled = True
        processes = self._processes()
        pool, self._pool, self._futures = self._pool, None, {}
        if pool is None:
            return
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.kill()
        for p in processes:
            p.join(timeout=5)

    def close(self) -> None:
        """Stop the workers (after ``finish``, or when the caller failed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._futures = {}
