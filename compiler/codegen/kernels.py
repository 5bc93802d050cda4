"""The kernel registry: one emitter per op (per op family module).

A kernel is specialised on its node's static signature (types and attrs),
so every constant shape is baked in; layers with the same shapes share one
kernel. Emitters split their rows between threads with ``kb.thread_share``
and must give the same numbers as the op's numpy reference (tests compare).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ir.digest import sha1
from ir.graph import Node
from ir.types import TensorType

from .emit import KernelBuilder
from .target import Target


@dataclass(frozen=True)
class KernelSig:
    """What a kernel is specialised on."""

    op: str
    in_types: tuple[TensorType, ...]
    out_type: TensorType
    attrs: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, node: Node) -> "KernelSig":
        """A node's signature: its types, attributes and kernel choices
        (``ir.kernel_choice``), which specialise the kernel alike."""
        return cls(node.op, tuple(v.type for v in node.inputs), node.output.type,
                   tuple(sorted(kernel_attrs(node.op, {**node.attrs, **node.kernel}).items())))

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def name(self) -> str:
        h = sha1(repr(self).encode()).hexdigest()[:10]
        return f"k_{self.op}_{h}"


def kernel_attrs(op: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes a kernel is specialised on: a node's, but where a row
    block of a split weight writes (``row0``), which is the output pointer
    the lowering passes, so the blocks of one weight share a kernel."""
    if op == "qmatmul_rows":
        return {k: v for k, v in attrs.items() if k != "row0"}
    return attrs


#: op name -> emitter(kb, sig) that writes the kernel body (kb.finish() is
#: called by the caller).
Emitter = Callable[[KernelBuilder, KernelSig], None]
EMITTERS: dict[str, Emitter] = {}


def kernel(*ops: str) -> Callable[[Emitter], Emitter]:
    def deco(fn: Emitter) -> Emitter:
        for op in ops:
            EMITTERS[op] = fn
        return fn

    return deco


def load_emitters() -> None:
    """Import the op family modules (``k_*`` and the ``matmul`` package;
    they register themselves)."""
    import importlib
    import pkgutil

    from . import __path__ as pkg_path

    for m in pkgutil.iter_modules(pkg_path):
        if m.name.startswith("k_") or m.name == "matmul":
            importlib.import_module(f"{__package__}.{m.name}")


def emit_kernel(module, sig: KernelSig, vector_width: int, tuning: dict[str, int] | None = None,
                target: Target | None = None):
    """Emit ``sig``'s kernel function into ``module`` (llvmlite ir.Module),
    for ``target`` (the host by default).
    ``tuning``, if given, receives the parameters the emitter chose
    (``KernelBuilder.tuning``: what ``lmc kernel`` reports and may override)."""
    load_emitters()
    if sig.op not in EMITTERS:
        raise NotImplementedError(f"no native kernel for op {sig.op!r}")
    kb = KernelBuilder(module, sig.name, vector_width, target)
    EMITTERS[sig.op](kb, sig)
    if tuning is not None:
        tuning.update(kb.tuning)
    return kb.finish()
