"""Compile a model to native code: graphs -> plans -> LLVM -> an Artifact.

The artifact holds object code for a decode step, a prefill chunk and a
prefill that keeps every row's logits, and the manifest that says where
everything lives (arena offsets, state layout, outputs).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import llvmlite
import llvmlite.binding as llvm

from frontends.loader import LoadedModel
from ir.ops import get_op
from ir.printer import print_graph
from passes.plan_arena import plan_arena

from . import cache
from .artifact import FORMAT_VERSION, Artifact, ArtifactError, file_fingerprint
from .codegen.jit import emit_object
from .codegen.lower import lower_graphs
from .codegen.target import Target, host_target
from .driver import CompileOptions, build_graphs

LMC_VERSION = "0.1.0"
DEFAULT_PREFILL_CHUNK = 128


@dataclass
class NativeOptions:
    ctx: int | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    vector_width: int | None = None
    opt_level: int = 3
    use_cache: bool = True
    dump_dir: str | None = None
    passes: tuple[str, ...] | None = None   # default: default_pipeline("llvm")


@dataclass
class CompileResult:
    artifact: Artifact
    cached: bool
    seconds: float
    cache_path: str | None = None


def _scratch_floats(graphs: dict, ctx: int) -> int:
    """Per-thread scratch (float32 elements): attention scores over the whole
    context at least, and whatever any kernel's own rule asks for (attention
    scores per head, the integer path's quantized activations)."""
    from .codegen import k_attention, k_matmul_int
    from .codegen.kernels import KernelSig

    need = ctx + 64
    for g in graphs.values():
        for n in g.nodes:
            if n.op == "attention":
                need = max(need, int(k_attention.scratch_floats(KernelSig.of(n))))
            elif n.attrs.get("act"):
                need = max(need, int(k_matmul_int.scratch_floats(KernelSig.of(n))))
    return (need + 15) // 16 * 16


@functools.cache
def codegen_fingerprint() -> str:
    """Hash of the code generator's own source: a changed kernel or lowering
    must never be served stale object code from the cache."""
    import hashlib
    import pathlib

    h = hashlib.sha256()
    here = pathlib.Path(__file__).resolve().parent
    for f in sorted([*here.glob("*.py"), *(here / "codegen").glob("*.py"), *(here.parent / "ir").glob("*.py"),
                     *(here.parent / "passes").glob("*.py")]):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _target_info(t: Target) -> dict[str, Any]:
    return {"cpu": t.cpu, "features": t.features, "triple": t.triple}


def compile_native(model: LoadedModel, options: NativeOptions | None = None) -> CompileResult:
    """Build (or fetch from the cache) the native code for ``model``."""
    o = options or NativeOptions()
    t0 = time.perf_counter()
    target = host_target()
    ctx = o.ctx or model.config.seq_len
    chunk = max(1, min(o.prefill_chunk, ctx))
    graphs = build_graphs(model, CompileOptions(backend="llvm", ctx=ctx, dump_dir=o.dump_dir, passes=o.passes))
    symbols = {"T": chunk}
    plans = {name: plan_arena(g, symbols) for name, g in graphs.items()}
    key = cache.cache_key({
        "graphs": {n: print_graph(g) for n, g in graphs.items()},
        "chunk": chunk, "vw": o.vector_width, "opt": o.opt_level,
        "target": _target_info(target), "lmc": LMC_VERSION, "format": FORMAT_VERSION,
        "codegen": codegen_fingerprint(),
        "llvm": list(llvm.llvm_version_info), "llvmlite": llvmlite.__version__,
    })
    if o.use_cache:
        hit = cache.lookup(key)
        if hit is not None and hit.manifest.get("model", {}).get("size") == os.path.getsize(model.path):
            hit.manifest["model"]["path"] = os.path.abspath(model.path)
            hit.manifest["tokenizer"] = getattr(model.tokenizer, "path", None)
            return CompileResult(hit, True, time.perf_counter() - t0, cache.cache_path(key))
    module, entries, state_offsets, state_bytes = lower_graphs(graphs, plans, target, o.vector_width)
    obj = emit_object(module, target, o.opt_level)
    manifest = {
        "format_version": FORMAT_VERSION,
        "lmc_version": LMC_VERSION,
        "llvm": ".".join(map(str, llvm.llvm_version_info)),
        "target": _target_info(target),
        "vector_width": o.vector_width or target.vector_width,
        "cache_key": key,
        "model": {"path": os.path.abspath(model.path), "format": model.format, **file_fingerprint(model.path)},
        "tokenizer": getattr(model.tokenizer, "path", None),
        "config": dataclasses.asdict(model.config),
        "ctx": ctx,
        "prefill_chunk": chunk,
        "entries": {n: {"index": e.index, "output_offset": e.output_offset,
                        "output_shape": list(e.output_shape)} for n, e in entries.items()},
        "arena_bytes": max(p.size for p in plans.values()),
        "plans": {n: {"size": p.size, "lower_bound": p.lower_bound, "no_sharing": p.no_sharing,
                      "strategy": p.strategy} for n, p in plans.items()},
        "state_offsets": state_offsets,
        "state_bytes": state_bytes,
        "scratch_floats": _scratch_floats(graphs, ctx),
        "kernels": sorted({n.op for g in graphs.values() for n in g.nodes}),
        "updates_state": sorted({n.op for g in graphs.values() for n in g.nodes if get_op(n.op).updates_state}),
    }
    art = Artifact(manifest, obj)
    path = cache.store(key, art) if o.use_cache else None
    return CompileResult(art, False, time.perf_counter() - t0, path)


def check_artifact(art: Artifact, name: str, model_path: str | None = None) -> None:
    """Refuse an artifact built for another CPU or another model file."""
    t = host_target()
    want = art.manifest.get("target", {})
    if want.get("cpu") != t.cpu or want.get("features") != t.features:
        raise ArtifactError(f"{name}: built for CPU {want.get('cpu')} with other features; this machine is "
                            f"{t.cpu}: recompile it here")
    m = art.manifest.get("model", {})
    path = model_path or m.get("path")
    if not path or not os.path.exists(path):
        raise ArtifactError(f"{name}: its model file {path} is missing")
    fp = file_fingerprint(path)
    if any(fp.get(k) != m.get(k) for k in fp):
        raise ArtifactError(f"{name}: built for another model file than {path} (size or hash differ)")
