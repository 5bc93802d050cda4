"""LLVM IR -> optimised object code -> callable machine code.

Object code is what artifacts and the disk cache store; loading it back
links it (no optimisation or code generation runs on a warm start). Two
ways to link: the system linker makes a shared library, cached beside the
compiled artifacts and opened with ctypes, so the process never loads LLVM
(~40 MB resident for llvmlite's library alone); without a linker, or when
linking fails, LLVM's MCJIT links it in memory. The object code is
position independent (``Target.machine`` uses reloc="pic"), as a shared
library needs; its few C library calls (expf, syscall, pread ...) resolve
against libm and libc, which the library names as dependencies. The code
may be several objects packed together (``compiler.objpack``: glue and
kernels, compiled apart); both ways link them all.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

from ir.digest import sha256

from ..objpack import unpack
from .target import Target, host_target

if TYPE_CHECKING:
    import llvmlite.binding as llvm
    import llvmlite.ir as ir

#: set LMC_LINKER=mcjit to always link in memory with LLVM (as without a linker)
LINKER_ENV = "LMC_LINKER"


def optimize(mod: "llvm.ModuleRef", target: Target, level: int = 3) -> None:
    import llvmlite.binding as llvm

    tm = target.machine(level)
    pto = llvm.create_pipeline_tuning_options(speed_level=level)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(mod, pb)


def compile_ir(module: "ir.Module", target: Target | None = None, level: int = 3) -> "llvm.ModuleRef":
    import llvmlite.binding as llvm

    target = target or host_target()
    module.triple = target.triple
    mod = llvm.parse_assembly(str(module))
    mod.verify()
    optimize(mod, target, level)
    return mod


def emit_object(module: "ir.Module", target: Target | None = None, level: int = 3) -> bytes:
    target = target or host_target()
    mod = compile_ir(module, target, level)
    return target.machine(level).emit_object(mod)


def emit_assembly(module: "ir.Module", target: Target | None = None, level: int = 3) -> str:
    target = target or host_target()
    mod = compile_ir(module, target, level)
    return target.machine(level).emit_assembly(mod)


class LoadedCode:
    """Machine code linked into this process; keep it alive while in use.

    ``shared=True``: as a shared library from the system linker (cached by
    the object code's hash), falling back to MCJIT; ``self.how`` says which
    ("shared" or "mcjit"). Kernel harnesses (``lmc kernel``, the tests) link
    this way too: MCJIT places each object's sections where mmap puts them,
    and in a process that has mapped a few GB (models, weight images) a
    32-bit relative relocation between them can overflow, which LLVM answers
    with abort() (seen after hundreds of kernels in one test process).
    ``shared=False``: MCJIT."""

    def __init__(self, obj: bytes, target: Target | None = None, shared: bool = False) -> None:
        self.lib: ctypes.CDLL | None = None
        self.engine = None
        if shared and os.environ.get(LINKER_ENV, "").lower() != "mcjit":
            for attempt in range(2):
                path = shared_library(obj)
                if path is None:
                    break
                try:
                    self.lib = ctypes.CDLL(path)
                    self.how = "shared"
                    return
                except OSError as e:
                    if attempt == 0:   # a damaged cache entry: link it again
                        _remove(path)
                    else:
                        print(f"lmc: warning: cannot load {path} ({e}); linking with LLVM instead",
                              file=sys.stderr)
        import llvmlite.binding as llvm

        target = target or host_target()
        tm = target.machine()
        empty = llvm.parse_assembly(f'target triple = "{target.triple}"\n')
        self.engine = llvm.create_mcjit_compiler(empty, tm)
        for one in unpack(obj):
            self.engine.add_object_file(llvm.ObjectFileRef.from_data(one))
        self.engine.finalize_object()
        self.how = "mcjit"

    def address(self, name: str) -> int:
        if self.lib is not None:
            try:
                addr = ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value
            except AttributeError:
                addr = None
        else:
            addr = self.engine.get_function_address(name)
        if not addr:
            raise KeyError(f"symbol {name} not found in compiled code")
        return addr


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _linkers() -> list[list[str]]:
    """Commands that turn one PIC object into a shared library, best first:
    the C compiler's driver (it adds libgcc, should LLVM have called one of
    its helpers), else the bare linker; libm and libc are dependencies."""
    out = []
    for cc in ("cc", "gcc", "clang"):
        exe = shutil.which(cc)
        if exe:
            out.append([exe, "-shared", "{obj}", "-o", "{so}", "-lm"])
            break
    exe = shutil.which("ld")
    if exe:
        out.append([exe, "-shared", "-z", "noexecstack", "{obj}", "-o", "{so}", "-lm", "-lc"])
    return out


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return sha256(f.read()).hexdigest()
    except OSError:
        return None


def _intact(path: str) -> bool:
    """The library matches the checksum written beside it when it was linked."""
    try:
        with open(path + ".sha256", encoding="ascii") as f:
            want = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return want == _file_sha256(path)


def shared_library(obj: bytes) -> str | None:
    """Path of a shared library made of ``obj``: from the compile cache, or
    linked now with the system linker and stored there (with its checksum,
    so a damaged file is linked again, never loaded); None when there is no
    linker or linking fails (the caller falls back to MCJIT)."""
    from ..cache import cache_dir

    digest = sha256(obj).hexdigest()[:32]
    folder = os.path.join(cache_dir(), "native")
    path = os.path.join(folder, f"{digest}.so")
    if os.path.exists(path):
        if _intact(path):
            return path
        _remove(path)
    cmds = _linkers()
    if not cmds:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        work = tempfile.mkdtemp(prefix=f".{digest}.", dir=folder)
    except OSError:
        return None
    try:
        objs = []
        for i, one in enumerate(unpack(obj)):
            objs.append(os.path.join(work, f"{i}.o"))
            with open(objs[-1], "wb") as f:
                f.write(one)
        so = os.path.join(work, "code.so")
        for cmd in cmds:
            argv = [a for c in cmd for a in (objs if c == "{obj}" else [c.format(so=so)])]
            try:
                r = subprocess.run(argv, capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                continue
            sha = _file_sha256(so) if r.returncode == 0 else None
            if sha:
                with open(os.path.join(work, "sum"), "w", encoding="ascii") as f:
                    f.write(sha)
                # atomic renames: a concurrent process sees all or nothing
                os.replace(os.path.join(work, "sum"), path + ".sha256")
                os.replace(so, path)
                return path
        return None
    except (OSError, ValueError):   # ValueError: a pack that does not hold together
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)
