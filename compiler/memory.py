"""The memory plan of a compiled model: sizes gathered from its graphs and
arena plans, handed to ``passes.memory_budget``; the result picks the KV
cache, the graphs' head split and the stream schedule (``compile_native``)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from frontends.arch import layer_window
from frontends.loader import LoadedModel
from ir.graph import Graph
from passes.memory_budget import MemoryPlan, ModelSizes, WeightInfo
from passes.plan_arena import ArenaPlan
from passes.split_rows import row_bytes
from passes.stream_schedule import StreamSchedule, layer_of, staging_bytes


def model_sizes(model: LoadedModel, graphs: dict[str, Graph], plans: dict[str, ArenaPlan],
                scratch_floats: int, code_bytes: int, max_ctx: int) -> ModelSizes:
    """What the budget planner needs, from the graphs a run uses (decode and
    the last-row prefill; ``prefill_all``'s wide logits are only touched by
    ``logits()``/perplexity)."""
    cfg = model.config
    g = graphs["decode"]
    lookups = {n.inputs[0].name for n in g.nodes if n.op == "embedding"}
    others = {v.name for n in g.nodes if n.op != "embedding" for v in n.inputs if v.kind == "weight"}
    matmuls = {n.inputs[1].name for n in g.nodes if n.op in ("matmul", "qmatmul", "qmatmul_rows", "qmatmul_add")}
    infos = []
    for name, v in g.weights.items():
        infos.append(WeightInfo(name, v.ref.nbytes, layer_of(name), lookup_only=name not in others,
                                looked_up=name in lookups, splittable=row_bytes(v.type) is not None,
                                matmul=name in matmuls))
    run = [p for n, p in plans.items() if n != "prefill_all"] or list(plans.values())
    head_dim = cfg.dim // cfg.n_heads if not getattr(cfg, "head_dim", None) else cfg.head_dim
    # compressed layers are staged before decompression; repacked ones are read as they are
    packed = [v.ref.packed.stored for name, v in g.weights.items()
              if v.ref.packed is not None and v.ref.packed.codec != "repack" and layer_of(name) is not None]
    slack = g.meta.get("ring_slack")
    windows = [layer_window(cfg, i)[1] for i in range(cfg.n_layers)]
    rings = tuple(w + slack if w else 0 for w in windows) if slack else ()
    exact = next((n.attrs.get("xring") or 0 for n in g.nodes if n.op == "attention" and n.attrs.get("recent")), None)
    return ModelSizes(infos, cfg.n_layers, cfg.kv_dim, head_dim, cfg.vocab_size, max_ctx,
                      max(p.size for p in run), max(p.lower_bound for p in run), 4, 4 * scratch_floats,
                      code_bytes, max(packed, default=0), rings, exact)


def plan_manifest(mp: MemoryPlan, sched: StreamSchedule | None) -> dict[str, Any]:
    """The plan as the artifact's manifest (and ``lmc plan --format json``) records it."""
    out: dict[str, Any] = {k: v for k, v in asdict(mp).items() if k != "categories"}
    out["categories"] = dict(mp.categories)
    out["total"] = mp.total
    out["describe"] = mp.describe()
    if sched is not None:
        out["stream"] = {
            "buffer_bytes": sched.buffer_bytes,
            "io": sched.io,
            "segments": [{"name": s.name, "bytes": s.nbytes, "reads": len(s.ranges)} for s in sched.segments],
            "read_bytes_per_step": sched.read_bytes(),
            "staging_bytes": staging_bytes(sched),
            # compressed regions the reader decompresses (the runtime leaves them out of the image)
            "packed_image_offsets": [s.image_offset for s in sched.segments if s.image_offset is not None],
            # some weights are read from the repacked weights' file (``compiler.repack_cache``)
            "reads_repacked": sched.repack_lo is not None,
        }
    return out
