"""LLVM IR -> optimised object code -> callable machine code.

Object code is what artifacts and the disk cache store; loading it back
links it in memory (no optimisation or code generation runs on a warm
start).
"""
from __future__ import annotations

import llvmlite.binding as llvm
import llvmlite.ir as ir

from .target import Target, host_target


def optimize(mod: "llvm.ModuleRef", target: Target, level: int = 3) -> None:
    tm = target.machine(level)
    pto = llvm.create_pipeline_tuning_options(speed_level=level)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(mod, pb)


def compile_ir(module: ir.Module, target: Target | None = None, level: int = 3) -> "llvm.ModuleRef":
    target = target or host_target()
    module.triple = target.triple
    mod = llvm.parse_assembly(str(module))
    mod.verify()
    optimize(mod, target, level)
    return mod


def emit_object(module: ir.Module, target: Target | None = None, level: int = 3) -> bytes:
    target = target or host_target()
    mod = compile_ir(module, target, level)
    return target.machine(level).emit_object(mod)


def emit_assembly(module: ir.Module, target: Target | None = None, level: int = 3) -> str:
    target = target or host_target()
    mod = compile_ir(module, target, level)
    return target.machine(level).emit_assembly(mod)


class LoadedCode:
    """Machine code linked into this process; keep it alive while in use."""

    def __init__(self, obj: bytes, target: Target | None = None) -> None:
        target = target or host_target()
        tm = target.machine()
        empty = llvm.parse_assembly(f'target triple = "{target.triple}"\n')
        self.engine = llvm.create_mcjit_compiler(empty, tm)
        self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self.engine.finalize_object()

    def address(self, name: str) -> int:
        addr = self.engine.get_function_address(name)
        if not addr:
            raise KeyError(f"symbol {name} not found in compiled code")
        return addr
