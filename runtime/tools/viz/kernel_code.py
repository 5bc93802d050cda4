"""A node's kernel as code: its LLVM IR as emitted and as optimised, the
assembly for this CPU, and ``llvm-mca``'s analysis of that assembly.

The kernel is the one ``compile`` builds for the node: the same signature
(``KernelSig.of``), emitter, target and vector width, optimised at O3 as
``compiler.codegen.objects.kernel_object`` does, with the function made
external so the optimiser keeps it. Each kernel is parsed in a private LLVM
context freed afterwards (a viewer may look at hundreds), one at a time.

``llvm-mca`` (LLVM's machine code analyser; not part of llvmlite) is run
when a binary is on PATH: ``llvm-mca`` or a versioned ``llvm-mca-N`` as
Debian installs them. An older LLVM may not know this CPU's name; the
analysis then uses the nearest older CPU it knows, and says so.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import threading
from typing import Any

import llvmlite.ir as ir

from compiler.codegen.jit import optimize
from compiler.codegen.kernels import KernelSig, emit_kernel
from compiler.codegen.target import Target, host_target

#: an LLVM CPU name -> older names with a similar core, for an llvm-mca that lacks it
OLDER_CPUS = {
    "graniterapids": ("sapphirerapids", "icelake-server"),
    "emeraldrapids": ("sapphirerapids", "icelake-server"),
    "sapphirerapids": ("icelake-server",),
    "arrowlake": ("alderlake",), "lunarlake": ("alderlake",), "meteorlake": ("alderlake",),
    "raptorlake": ("alderlake",), "alderlake": ("skylake",),
    "znver5": ("znver4", "znver3"), "znver4": ("znver3",),
}
#: seconds llvm-mca may take on one kernel
MCA_TIMEOUT = 60

_llvm_lock = threading.Lock()


def _compile(text: str, target: Target) -> tuple[str, str]:
    """(optimised IR, assembly) of one module's text."""
    import llvmlite.binding as llvm

    with _llvm_lock:
        ctx = llvm.create_context()
        try:
            mod = llvm.parse_assembly(text, context=ctx)
            try:
                mod.verify()
                optimize(mod, target, 3)
                return str(mod), target.machine(3).emit_assembly(mod)
            finally:
                mod.close()
        finally:
            ctx.close()


def kernel_code(sig: KernelSig, target: Target | None = None, vector_width: int | None = None
                ) -> dict[str, Any]:
    """The kernel of ``sig`` as IR, optimised IR, assembly and llvm-mca
    text; ``available`` False (and ``reason``) for an op with no native kernel."""
    target = target or host_target()
    vw = vector_width or target.vector_width
    module = ir.Module(name=sig.name)
    module.triple = target.triple
    tuning: dict[str, int] = {}
    try:
        fn = emit_kernel(module, sig, vw, tuning=tuning, target=target)
    except NotImplementedError as e:
        return {"name": sig.name, "available": False, "reason": str(e)}
    fn.linkage = "external"
    text = str(module)
    optimised, asm = _compile(text, target)
    return {"name": sig.name, "available": True, "cpu": target.cpu, "triple": target.triple,
            "vector_width": vw, "tuning": tuning, "ir": text, "ir_optimized": optimised, "asm": asm,
            "mca": run_mca(asm, target)}


def find_mca() -> str | None:
    """An llvm-mca on PATH: the unversioned name, else the newest ``llvm-mca-N``."""
    exe = shutil.which("llvm-mca")
    if exe:
        return exe
    found: list[tuple[int, str]] = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            m = re.fullmatch(r"llvm-mca-(\d+)", name)
            path = os.path.join(folder, name)
            if m and os.access(path, os.X_OK):
                found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


@functools.cache
def _mca_cpus(exe: str, triple: str) -> frozenset[str]:
    """The CPU names this llvm-mca knows for ``triple`` (it lists them on stderr)."""
    try:
        r = subprocess.run([exe, f"-mtriple={triple}", "-mcpu=help"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=MCA_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(m.group(1) for m in re.finditer(r"^\s+([\w.-]+)\s+- Select", r.stdout + r.stderr, re.M))


def mca_cpus(exe: str, target: Target) -> list[tuple[str, str | None]]:
    """The CPUs to model, in order, each with why it is not this one (None:
    it is): this one if llvm-mca knows it, its older relatives it knows, then
    a model that reads AVX-512 where the code has it, then a generic CPU.
    (llvm-mca 14 models Zen 4 as Zen 3, which refuses AVX-512 instructions.)"""
    known = _mca_cpus(exe, target.triple)
    if not known or target.cpu in known:
        out: list[tuple[str, str | None]] = [(target.cpu, None)]
    else:
        out = [(older, f"this llvm-mca does not know {target.cpu}: modelled as {older}")
               for older in OLDER_CPUS.get(target.cpu, ()) if older in known]
    if "+avx512f" in target.features and "icelake-server" in known:
        out.append(("icelake-server", f"this llvm-mca cannot read {target.cpu}'s AVX-512 code as "
                                      f"{out[0][0] if out else target.cpu}: modelled as icelake-server"))
    out.append(("generic", f"this llvm-mca cannot model {target.cpu}: modelled as a generic CPU"))
    return list(dict.fromkeys(out))


def run_mca(asm: str, target: Target) -> dict[str, Any]:
    """llvm-mca's report on the whole kernel (each instruction once, in
    order, as one block run 100 times: loops are not followed, so read it
    for the instruction mix and port pressure, not for a time). The first
    CPU model (``mca_cpus``) that reads every instruction."""
    exe = find_mca()
    if exe is None:
        return {"available": False,
                "reason": "llvm-mca is not installed (not on PATH): apt-get install llvm, or LLVM's release "
                          "binaries, to see the machine code analysis"}
    out: dict[str, Any] = {}
    for cpu, note in mca_cpus(exe, target):
        cmd = [exe, f"-mtriple={target.triple}", f"-mcpu={cpu}"]
        try:
            r = subprocess.run(cmd, input=asm, capture_output=True, text=True, timeout=MCA_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            return {"available": False, "tool": exe, "reason": f"llvm-mca took more than {MCA_TIMEOUT} s"}
        except OSError as e:
            return {"available": False, "tool": exe, "reason": f"llvm-mca did not run: {e.strerror}"}
        out = {"available": r.returncode == 0, "tool": exe, "cpu": cpu, "command": " ".join(cmd),
               "text": r.stdout, "stderr": r.stderr.strip()}
        if note:
            out["note"] = note
        if r.returncode == 0:
            return out
        # an older llvm-mca may not parse every instruction a newer LLVM emits: the next model may
        out["reason"] = f"llvm-mca failed (exit {r.returncode}): " + (r.stderr.strip().splitlines() or ["?"])[0]
    return out
