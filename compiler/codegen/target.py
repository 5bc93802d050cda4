"""The host target: CPU name, features and the vector width we emit for.

The same LLVM IR becomes AVX-512, AVX2 or NEON code because the target
machine is built from the host's own name and feature string.

Asking LLVM means loading llvmlite's shared library (~40 MB resident), which
a warm start must not pay for: what LLVM said is kept in the compile cache,
keyed by this CPU's identity in /proc/cpuinfo and the llvmlite version.

AMX (Intel's tile matrix unit, Sapphire Rapids on) is one more feature, but
a process may only use its tiles after asking the kernel for the state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); a process that
did not ask, a kernel that refuses, or ``LMC_AMX=0`` keep today's VNNI code:
``host_target`` drops the AMX features then (so the compile cache keys the
two apart) and ``amx_status`` says which and why.
"""
from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ir.digest import sha256
from ir.switches import switch

if TYPE_CHECKING:
    import llvmlite.binding as llvm


@functools.cache
def _init() -> None:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


@dataclass(frozen=True)
class Target:
    cpu: str
    features: str   # LLVM feature string, "+avx2,+fma,..."
    triple: str
    #: float32 lanes in one vector register we aim for
    vector_width: int

    def has(self, feature: str) -> bool:
        return f"+{feature}" in self.features.split(",")

    @property
    def int_dot(self) -> bool:
        """Int8 dot-product instructions (VNNI) that make the integer path
        (``passes/int_dot``) the faster decode matvec."""
        return self.triple.startswith("x86_64") and (self.has("avx512vnni") or self.has("avxvnni"))

    @property
    def has_fma(self) -> bool:
        """Fused multiply-adds in hardware (x86 FMA3; every AArch64 core)."""
        return self.has("fma") or not self.triple.startswith(("x86_64", "i386", "i686"))

    @property
    def amx(self) -> bool:
        """AMX int8 tiles (``tdpbsud``) in the code we emit: the host's, unless
        ``amx_status`` said no (``host_target`` drops the features then)."""
        return self.triple.startswith("x86_64") and self.has("amx-tile") and self.has("amx-int8")

    def variant(self, cpu: str, drop: tuple[str, ...] = ()) -> "Target":
        """This target's instructions, less every feature whose name starts
        with one of ``drop``, scheduled and tuned by LLVM for ``cpu``: code
        as LLVM would make it for another CPU, which this one still runs.
        Tests compile kernels for several such variants, so that code
        whose numbers must not depend on LLVM's choices is shown not to."""
        feats = []
        for f in self.features.split(","):
            if f[:1] in "+-" and f[1:].startswith(drop):
                f = "-" + f[1:]
            feats.append(f)
        flat = ",".join(feats)
        has = set(f[1:] for f in feats if f.startswith("+"))
        width = 16 if "avx512f" in has else 8 if ("avx" in has or "avx2" in has) else 4
        if not self.triple.startswith(("x86_64", "i386", "i686")):
            width = self.vector_width
        return Target(cpu=cpu, features=flat, triple=self.triple, vector_width=width)

    def machine(self, opt: int = 3) -> "llvm.TargetMachine":
        import llvmlite.binding as llvm

        _init()
        t = llvm.Target.from_triple(self.triple)
        return t.create_target_machine(cpu=self.cpu, features=self.features, opt=opt,
                                       reloc="pic", codemodel="default")


def vnni_width(vw: int, target: Target | None = None) -> int | None:
    """Output rows per tile of the integer GEMM and of repacked weights at
    vector width ``vw``: the int32 lanes of the target's (the host's by
    default) ``vpdpbusd`` at that width; None without it (no GEMM, nothing
    repacked)."""
    t = target or host_target()
    if not t.triple.startswith("x86_64"):
        return None
    if vw >= 16 and t.has("avx512vnni"):
        return 16
    if vw == 8 and ((t.has("avx512vnni") and t.has("avx512vl")) or t.has("avxvnni")):
        return 8
    return None


def _cpu_identity() -> str | None:
    """What tells this CPU apart for LLVM's host detection: vendor, family,
    model, stepping, model name and the flags the kernel enabled (first
    processor of /proc/cpuinfo), plus the machine and llvmlite's version.
    None where there is no /proc/cpuinfo."""
    keys = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "features",
            "cpu implementer", "cpu architecture", "cpu variant", "cpu part", "cpu revision", "isa")
    lines = [line.strip() for line in _first_processor() if line.split(":", 1)[0].strip().lower() in keys]
    if not lines:
        return None
    import llvmlite   # the package's version only (importlib.metadata costs a warm start ~7 ms)

    return "\n".join([platform.machine(), f"llvmlite {llvmlite.__version__}", *lines])


def _first_processor() -> list[str]:
    """The lines of /proc/cpuinfo's first processor (none without the file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return []
    return text.split("\n\n", 1)[0].splitlines()


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (``AMD EPYC ...``), else the
    platform's: benchmark figures say which CPU they came from (machines
    differ from run to run)."""
    for line in _first_processor():
        if line.split(":", 1)[0].strip().lower() == "model name":
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cache_file(identity: str) -> str:
    from ..cache import cache_dir

    key = sha256(identity.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "targets", f"host-{key}.json")


def _read_cached(path: str) -> Target | None:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        t = Target(cpu=d["cpu"], features=d["features"], triple=d["triple"], vector_width=d["vector_width"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = all(isinstance(v, str) and v for v in (t.cpu, t.triple)) and isinstance(t.features, str) \
        and type(t.vector_width) is int and t.vector_width in (4, 8, 16)
    return t if ok else None


def _write_cached(path: str, t: Target) -> None:
    """Best effort, atomic."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.part"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(t), f)
        os.replace(tmp, path)
    except OSError:
        pass


@functools.cache
def host_target() -> Target:
    """This machine's target: from the cache when this CPU was seen before
    (with this llvmlite), else from LLVM; without the AMX features where
    this process may not use them (``amx_status``)."""
    t = _detected_target()
    if t.amx and not amx_status(t)["used"]:
        t = without_amx(t)
    return t


def _detected_target() -> Target:
    identity = _cpu_identity()
    path = _cache_file(identity) if identity else None
    if path:
        t = _read_cached(path)
        if t is not None:
            return t
    t = llvm_host_target()
    if path:
        _write_cached(path, t)
    return t


def without_amx(t: Target) -> Target:
    """The same target with every AMX feature off (the VNNI kernels)."""
    feats = ["-" + f[1:] if f[:1] in "+-" and f[1:].startswith("amx") else f for f in t.features.split(",")]
    return replace(t, features=",".join(feats))


#: Linux's arch_prctl codes (asm/prctl.h) and the tile data's xstate component
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


@functools.cache
def amx_status(t: Target | None = None) -> dict:
    """Whether this process runs AMX tiles, and why (``lmc bench --json``
    reports it): the CPU must have them, ``LMC_AMX`` must not be 0, and
    the kernel must grant the tile state (once per process; granted, it
    holds for every thread, now and later)."""
    t = t or _detected_target()
    wanted = switch("LMC_AMX")    # read on every host: a bad value is an error on a CPU without AMX too
    if not t.amx:
        return {"used": False, "why": "this CPU has no AMX int8 tiles"}
    if not wanted:
        return {"used": False, "why": "LMC_AMX=0"}
    if platform.system() != "Linux":
        return {"used": False, "why": f"AMX permission is asked on Linux only, not {platform.system()}"}
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as e:
        return {"used": False, "why": f"cannot ask the kernel for the tile state: {e}"}
    if rc != 0:
        return {"used": False, "why": f"the kernel refused the tile state: {os.strerror(ctypes.get_errno())}"}
    return {"used": True, "why": "AMX int8 tiles granted to this process"}


def llvm_host_target() -> Target:
    """What LLVM itself detects (loads llvmlite's binding)."""
    import llvmlite.binding as llvm

    _init()
    cpu = llvm.get_host_cpu_name()
    feats = llvm.get_host_cpu_features()
    flat = feats.flatten()
    if feats.get("avx512f"):
        width = 16
    elif feats.get("avx") or feats.get("avx2"):
        width = 8
    else:
        width = 4  # SSE / NEON
    return Target(cpu=cpu, features=flat, triple=llvm.get_process_triple(), vector_width=width)
