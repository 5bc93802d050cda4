"""``lmc plan``: the memory map of a model as compiled under a budget.

Category by category (resident weights, stream buffers, KV cache,
activation arena, scratch, runtime), with the total against the budget and
the arena's size next to its lower bound; ``svg`` draws the decode step's
arena plan (offset against step, one box per buffer).
"""
from __future__ import annotations

import json
from typing import Any

from compiler.compile_memory import compile_peak_estimate, resident_bytes
from compiler.driver import LoadedModel
from compiler.memory import model_sizes, plan_manifest
from compiler.native import NativeOptions, scratch_floats, plan_native
from passes.memory_budget import fmt_size, plan_memory


def memory_report(model: LoadedModel, opts: NativeOptions) -> dict[str, Any]:
    planned = plan_native(model, opts)
    mp = planned.memory
    if mp is None:  # no budget: everything resident, described by the same arithmetic
        sizes = model_sizes(model, planned.graphs, planned.plans, scratch_floats(planned.graphs, 0), 2 << 20,
                            planned.ctx)
        mp = plan_memory(sizes, None, opts.threads or 1, ctx=planned.ctx, kv_type=opts.kv_type)
    out = plan_manifest(mp, planned.schedule)
    out["model"] = model.path
    out["arenas"] = {n: {"size": p.size, "lower_bound": p.lower_bound, "no_sharing": p.no_sharing,
                         "ratio": round(p.ratio(), 4), "strategy": p.strategy}
                     for n, p in planned.plans.items()}
    out["_decode_plan"] = planned.plans["decode"]
    out["_schedule"] = planned.schedule   # the stream schedule itself (None: nothing streams), for lmc viz
    loaded = resident_bytes()
    if loaded is not None:   # this process has loaded the model as the compile child will
        need = compile_peak_estimate(loaded)
        out["compile_peak_estimate"] = need
        b = out.get("budget")
        if b and need > b:
            out.setdefault("notes", []).append(
                f"the one-time compile (LLVM, in a child process) needs about {fmt_size(need)}, more than the "
                f"budget; it runs once per model and CPU, later runs load the cached code")
    return out


def format_text(r: dict[str, Any]) -> str:
    lines = [f"memory plan for {r['model']}"]
    b = r.get("budget")
    lines.append(f"budget: {fmt_size(b) if b else 'none'}; plan: {r['describe']}")
    w = max(len(k) for k in r["categories"])
    for k, v in r["categories"].items():
        lines.append(f"  {k:<{w}}  {fmt_size(v):>12}")
    lines.append(f"  {'total':<{w}}  {fmt_size(r['total']):>12}" + (f"   (budget {fmt_size(b)})" if b else ""))
    lines.append("activation arenas (bytes: plan / lower bound / without sharing):")
    for n, a in r["arenas"].items():
        lines.append(f"  {n:<12} {a['size']:>12,} / {a['lower_bound']:>12,} / {a['no_sharing']:>12,}"
                     f"  ({a['ratio']:.3f} x bound, {a['strategy']})")
    if r.get("compile_peak_estimate"):
        lines.append(f"one-time compile (in a child process, cached after): about "
                     f"{fmt_size(r['compile_peak_estimate'])} peak")
    st = r.get("stream")
    if st:
        lines.append(f"streaming: {len(st['segments'])} segments, two buffers of {fmt_size(st['buffer_bytes'])}, "
                     f"{fmt_size(st['read_bytes_per_step'])} read per token")
    for note in r.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def format_json(r: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in r.items() if not k.startswith("_")}, indent=1) + "\n"


def format_svg(r: dict[str, Any]) -> str:
    """The decode step's arena: x = step (node index), y = offset; a box per
    buffer from its definition to its last use."""
    plan = r["_decode_plan"]
    ivs = plan.intervals
    steps = max((iv.end for iv in ivs), default=0) + 1
    size = max(plan.size, 1)
    W, H, L, T = 900, 420, 70, 40
    sx, sy = (W - L - 20) / max(steps, 1), (H - T - 40) / size
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="Helvetica" '
           f'font-size="11">',
           f'<text x="{L}" y="18" font-size="14">Decode arena: {plan.size:,} bytes (lower bound '
           f'{plan.lower_bound:,}, {len(ivs)} buffers)</text>',
           f'<rect x="{L}" y="{T}" width="{W - L - 20}" height="{H - T - 40}" fill="none" stroke="#999"/>']
    for iv in ivs:
        off = plan.offsets[iv.name]
        x, y = L + iv.start * sx, T + off * sy
        w, h = max(1.0, (iv.end - iv.start + 1) * sx), max(1.0, iv.size * sy)
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="#7aa6d6" '
                   f'stroke="#24527a" stroke-width="0.5"><title>%{iv.name}: {iv.size} bytes at {off}, '
                   f'steps {iv.start}-{iv.end}</title></rect>')
    out.append(f'<text x="{L}" y="{H - 12}">step (node index, 0 .. {steps - 1})</text>')
    out.append(f'<text x="12" y="{T + 12}">offset 0</text>')
    out.append(f'<text x="12" y="{H - 40}">{plan.size:,}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
