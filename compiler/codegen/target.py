"""The host target: CPU name, features and the vector width we emit for.

The same LLVM IR becomes AVX-512, AVX2 or NEON code because the target
machine is built from the host's own name and feature string.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import llvmlite.binding as llvm


@functools.cache
def _init() -> None:
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

    def machine(self, opt: int = 3) -> "llvm.TargetMachine":
        _init()
        t = llvm.Target.from_triple(self.triple)
        return t.create_target_machine(cpu=self.cpu, features=self.features, opt=opt,
                                       reloc="pic", codemodel="default")


@functools.cache
def host_target() -> Target:
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
