"""Object code in pieces: one object per kernel, one for the glue.

Compiled apart, a kernel's object depends only on its signature and the
target, so the kernel cache can share it between models, and kernels can
be compiled in parallel. The glue (step functions, barrier, workers) holds
a model's constants and is compiled for each artifact. Its step functions
are long straight lists of calls that only pass addresses to kernels, so
they skip the optimiser (``optnone``) and the glue's machine code comes
from LLVM's fast instruction selector: the whole-module O3 code generator
spent seconds on them (Gemma 3: 2.6 s of glue; now ~0.06 s).

Kernel symbols are hidden: they resolve inside the shared library a model
is linked into, without PLT calls and without being exported.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import llvmlite.ir as ir

from .kernels import KernelSig, emit_kernel
from .target import Target

if TYPE_CHECKING:
    import llvmlite.binding as llvm


def kernel_object(sig: KernelSig, target: Target, vector_width: int, level: int = 3) -> bytes:
    """The object code of ``sig``'s kernel alone, its symbol ``sig.name``."""
    m = ir.Module(name=sig.name)
    m.triple = target.triple
    fn = emit_kernel(m, sig, vector_width, target=target)
    fn.linkage = "external"

    def prepare(mod: "llvm.ModuleRef") -> None:
        mod.get_function(sig.name).visibility = "hidden"

    return _compile(str(m), prepare, target, level, level)


def timed_kernel_object(sig: KernelSig, target: Target, vector_width: int, level: int = 3
                        ) -> tuple[bytes, float]:
    """``kernel_object`` and its seconds (what a worker process sends back)."""
    t0 = time.perf_counter()
    obj = kernel_object(sig, target, vector_width, level)
    return obj, time.perf_counter() - t0


def glue_object(module: ir.Module, kernel_names: list[str], target: Target, level: int = 3) -> bytes:
    """The object code of a module whose kernels and barrier are
    declarations only (``lower_graphs(external_kernels=True)``)."""
    module.triple = target.triple

    from .lower import BARRIER

    def prepare(mod: "llvm.ModuleRef") -> None:
        for name in [*kernel_names, BARRIER]:
            mod.get_function(name).visibility = "hidden"
        for fn in mod.functions:
            if fn.name.startswith("step_"):   # straight-line calls: nothing for the optimiser to gain
                fn.add_function_attribute("noinline")
                fn.add_function_attribute("optnone")

    return _compile(str(module), prepare, target, level, 0)


def barrier_object(target: Target, level: int = 3) -> bytes:
    """The barrier's object code (see ``lower.barrier_module``): full code
    generation, as the kernels get; with the glue's fast instruction
    selection it cost decode 3-4 % (Gemma 3, 2 threads)."""
    from .lower import BARRIER, barrier_module

    def prepare(mod: "llvm.ModuleRef") -> None:
        mod.get_function(BARRIER).visibility = "hidden"

    return _compile(str(barrier_module(target)), prepare, target, level, level)


def _compile(text: str, prepare: Callable[["llvm.ModuleRef"], None], target: Target, level: int,
             codegen_level: int) -> bytes:
    """Parse, optimise at ``level`` and emit at ``codegen_level``, in a
    private LLVM context freed afterwards, so one module's constants and
    types do not stay in LLVM's global context for the life of the process
    (resident-set gains were within noise when measured: most of a compile's
    peak is LLVM's own code pages and allocator)."""
    import llvmlite.binding as llvm

    from .jit import optimize

    ctx = llvm.create_context()
    try:
        mod = llvm.parse_assembly(text, context=ctx)
        try:
            prepare(mod)
            mod.verify()
            optimize(mod, target, level)
            return target.machine(codegen_level).emit_object(mod)
        finally:
            mod.close()
    finally:
        ctx.close()
