"""The host target: CPU name, features and the vector width we emit for.

The same LLVM IR becomes AVX-512, AVX2 or NEON code because the target
machine is built from the host's own name and feature string.

Asking LLVM means loading llvmlite's shared library (~40 MB resident), which
a warm start must not pay for: what LLVM said is kept in the compile cache,
keyed by this CPU's identity in /proc/cpuinfo and the llvmlite version.
"""
from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ir.digest import sha256

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
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return None
    keys = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "features",
            "cpu implementer", "cpu architecture", "cpu variant", "cpu part", "cpu revision", "isa")
    lines = []
    for line in text.split("\n\n", 1)[0].splitlines():
        k = line.split(":", 1)[0].strip().lower()
        if k in keys:
            lines.append(line.strip())
    if not lines:
        return None
    import llvmlite   # the package's version only (importlib.metadata costs a warm start ~7 ms)

    return "\n".join([platform.machine(), f"llvmlite {llvmlite.__version__}", *lines])


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
    (with this llvmlite), else from LLVM."""
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
