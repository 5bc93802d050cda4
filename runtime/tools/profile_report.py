"""``lmc profile``: where a token step's time goes, kernel by kernel.

A profiling build (``NativeOptions(profile=True)``) has thread 0 read the
clock after every op's barrier and add the time since its previous mark to
that op, so an op's time includes waiting for the slowest thread and the
ops' times add up to the native step. The step also times ``lmc_run`` waking
the workers until all are in the step (dispatch) and, after the last op,
waiting until all are done (exit). What none of these cover -- mostly the
ctypes call -- is the gap to the wall time Python measures around each
native call, reported as overhead.

Bytes and FLOPs come from the graph's static types: a weight costs its
stored (quantized) size, an activation its f32 size, a KV cache the rows
attention reads; FLOPs are 2 per multiply-add for matmuls and attention and
a small estimate per element for the rest. GB/s and GFLOP/s are those
counts over the measured time.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any
from xml.sax.saxutils import escape

import numpy as np

from compiler.artifact import is_artifact
from compiler.driver import load_model
from ir.graph import Graph, Node
from ir.printer import layout_label

from ..errors import RunError
from ..loading import DEFAULT_CTX
from ..model import Model

DEFAULT_STEPS = 32
DEFAULT_PROMPT_TOKENS = 64
TOP_NODES = 15
#: the per-op times must explain the step to within this fraction
MAX_GAP = 0.10

_MATMULS = {"matmul", "qmatmul", "qmatmul_rows", "qmatmul_add"}
#: estimated FLOPs per output element of the ops that are not dot products
_ELEMENT_FLOPS = {"add": 1, "mul": 1, "scale": 1, "bias_add": 1, "silu": 4, "gelu_tanh": 8, "rmsnorm": 4,
                  "rope": 3, "rope_kv_write": 3, "rope_kv_write_paged": 3, "embedding": 0, "kv_write": 0,
                  "take_last": 0}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.|_(?:cache|recent)\.(\d+)$")


# --- what each node costs -------------------------------------------------------------
def node_label(node: Node) -> str:
    """The op as the IR text prints it: ``qmatmul[Q4_K]``."""
    layout = layout_label(node)
    return node.op + (f"[{layout}]" if layout else "")


def node_layers(graph: Graph) -> list[int | None]:
    """Each node's transformer block: from its weights' or cache's names,
    else from its inputs' producers; None for the embedding and the head."""
    layer_of: dict[int, int | None] = {}
    out: list[int | None] = []
    for n in graph.nodes:
        layer, model_level = None, False
        for v in n.inputs:
            if v.kind in ("weight", "state"):
                m = _LAYER_NAME.search(v.name)
                if m:
                    layer = int(m.group(1) or m.group(2))
                    break
                model_level = True
        if layer is None and not model_level:
            known = [layer_of[id(v)] for v in n.inputs if layer_of.get(id(v)) is not None]
            layer = max(known) if known else None
        layer_of[id(n.output)] = layer
        out.append(layer)
    return out


def _keys(node: Node, pos: int) -> int:
    window = int(node.attrs.get("window") or 0)
    return min(pos + 1, window) if window else pos + 1


def node_cost(node: Node, positions: range) -> tuple[int, int, int]:
    """Bytes read, bytes written and FLOPs of one run of ``node`` over the
    tokens at ``positions`` (one for decode, a chunk for prefill)."""
    T = len(positions)
    sym = {"T": T}
    op = node.op
    if op in _MATMULS:
        x, w = node.inputs[:2]
        rows, cols = w.type.shape[-2:]
        n = x.type.numel(sym) // cols  # tokens: 1 after take_last, whatever T is
        res = node.inputs[2].type.nbytes(sym) if op == "qmatmul_add" else 0   # the residual its epilogue adds
        # a fused RMSNorm (passes/fuse_norm): its weight, and per token a sum of squares and a scale
        norm = node.inputs[-1].type.nbytes() if "norm_eps" in node.attrs else 0
        flops = 2 * rows * cols * n + res // 4 + (4 * cols * n if norm else 0)
        return w.type.nbytes() + x.type.nbytes(sym) + res + norm, n * rows * 4, flops
    if op == "attention":
        q, k = node.inputs[:2]
        hd, heads = int(node.attrs["head_dim"]), int(node.attrs["n_heads"])
        row = k.type.nbytes() // int(k.type.shape[0])  # one cached position, as stored (f32, f16, q8)
        window = int(node.attrs.get("window") or 0)
        first = max(0, positions[0] + 1 - window) if window else 0
        rows = positions[-1] + 1 - first  # K and V rows any token of the chunk reads
        flops = heads * (4 * hd + 5) * sum(_keys(node, p) for p in positions)
        return q.type.nbytes(sym) + 2 * rows * row, node.output.type.nbytes(sym), flops
    if op in ("kv_write", "rope_kv_write"):
        cache, x = node.inputs[:2]
        return x.type.nbytes(sym), cache.type.nbytes() // int(cache.type.shape[0]) * T, \
            _ELEMENT_FLOPS[op] * x.type.numel(sym)
    if op == "embedding":
        table, ids = node.inputs[:2]
        return table.type.nbytes() // int(table.type.shape[0]) * T + ids.type.nbytes(sym), \
            node.output.type.nbytes(sym), 0
    out = node.output.type
    if op == "take_last":
        return out.nbytes(sym), out.nbytes(sym), 0
    read = sum(v.type.nbytes(sym) for v in node.inputs if v.kind != "state")
    return read, out.nbytes(sym), _ELEMENT_FLOPS.get(op, 1) * out.numel(sym)


# --- measuring ----------------------------------------------------------------------------
def profile_model(model_path: str, tokenizer: str | None = None, threads: int | None = None,
                  steps: int = DEFAULT_STEPS, prompt_tokens: int = DEFAULT_PROMPT_TOKENS, ctx: int | None = None,
                  use_cache: bool = True, seed: int = 0) -> dict[str, Any]:
    """Compile ``model_path`` for profiling, run one prefill of a random
    prompt and ``steps`` greedy decode steps after it, and report per node,
    per op kind and per layer. An untimed prefill and decode step first fault
    in the weights and the code."""
    from compiler.native import NativeOptions, compile_native

    if steps < 1:
        raise RunError(f"--steps {steps}: must be >= 1")
    if prompt_tokens < 1:
        raise RunError(f"--prompt-tokens {prompt_tokens}: must be >= 1")
    if is_artifact(model_path):
        raise RunError(f"{model_path}: lmc profile builds its own profiling code; give it the model file")
    loaded = load_model(model_path, tokenizer)
    cfg = loaded.config
    if ctx is not None and not 0 < ctx <= cfg.seq_len:
        raise RunError(f"--ctx {ctx}: must be between 1 and the model's context {cfg.seq_len}")
    ctx = ctx or min(cfg.seq_len, DEFAULT_CTX)
    if ctx < steps + 1:
        raise RunError(f"--steps {steps}: a prompt and {steps} decode steps do not fit the context of {ctx}")
    prompt_tokens = min(prompt_tokens, ctx - steps)
    res = compile_native(loaded, NativeOptions(ctx=ctx, use_cache=use_cache, profile=True))
    graphs = res.graphs
    model = Model(loaded, "llvm", threads=threads, artifact=res.artifact)
    ex = model.executor
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(min(3, cfg.vocab_size - 1), cfg.vocab_size, prompt_tokens)]
    try:
        ex.reset()
        ex.decode(int(np.argmax(ex.prefill(ids, 0))), len(ids))  # warm-up
        ex.reset_profile()
        wall = ex.time_steps()
        ex.reset()
        logits = ex.prefill(ids, 0)
        pre_wall = sum(wall)
        _, *pre_sync, pre_ns = ex.profile_times("prefill")
        del wall[:]
        samples, sync = [], []
        prev_ns, prev_sync = np.zeros_like(ex.profile_times("decode")[3]), np.zeros(2)
        for s in range(steps):
            logits = ex.decode(int(np.argmax(logits)), len(ids) + s)
            _, d, e, ns = ex.profile_times("decode")
            samples.append(ns - prev_ns)
            sync.append(np.array([d, e]) - prev_sync)
            prev_ns, prev_sync = ns, np.array([d, e])
        dec_wall = list(wall)
    finally:
        ex.close()
    chunk = ex.chunk
    pre_runs = [range(a, min(a + chunk, len(ids))) for a in range(0, len(ids), chunk)]
    from compiler.codegen.probe import int8_unit, measure_int8_peak

    unit = int8_unit()   # the integer matmuls' unit, and its peak right after the runs it judges
    return {
        "model": os.path.basename(os.fspath(model_path)),
        "threads": ex.threads,
        "int8_unit": unit,
        "int8_peak_gops": measure_int8_peak(ex.threads) if unit else None,
        "cpu": res.artifact.manifest["target"]["cpu"],
        "ctx": ctx,
        "cache_hit": res.cached,
        "decode": _section(graphs["decode"], np.array(samples), np.array(sync), np.array(dec_wall),
                           [[range(len(ids) + s, len(ids) + s + 1)] for s in range(steps)]),
        "prefill": _section(graphs["prefill"], pre_ns[None, :], np.array([pre_sync]), np.array([pre_wall]),
                            [pre_runs]),
    }


def _section(graph: Graph, samples: np.ndarray, sync_ns: np.ndarray, wall_s: np.ndarray,
             runs: list[list[range]]) -> dict[str, Any]:
    """One entry's report. ``samples``: ns per node, one row per step;
    ``sync_ns``: dispatch and exit ns, one row per step; ``runs``: the
    native runs (token positions) making up each step."""
    steps = samples.shape[0]
    if samples.shape[1] != len(graph.nodes):
        raise RuntimeError(f"profile of {graph.name}: {samples.shape[1]} timers for {len(graph.nodes)} nodes")
    total_ns = samples.sum(axis=0).astype(np.float64)
    step_us = float(wall_s.mean()) * 1e6
    layers = node_layers(graph)
    first_layer = next((i for i, l in enumerate(layers) if l is not None), len(layers))
    nodes = []
    for i, node in enumerate(graph.nodes):
        read = written = flops = 0
        for step_runs in runs:
            for positions in step_runs:
                r, w, f = node_cost(node, positions)
                read, written, flops = read + r, written + w, flops + f
        t = total_ns[i]
        layer = layers[i] if layers[i] is not None else ("embed" if i < first_layer else "head")
        nodes.append({
            "index": i, "name": "%" + node.output.name, "op": node_label(node), "layer": layer,
            "shape": [str(d) if isinstance(d, str) else int(d) for d in node.output.type.shape],
            "us": t / steps / 1e3, "us_median": float(np.median(samples[:, i])) / 1e3,
            "us_total": t / 1e3,
            "bytes_read": round(read / steps), "bytes_written": round(written / steps),
            "flops": round(flops / steps),
            "int8": node.attrs.get("act") is not None,   # an integer-path matmul: judged against the int8 peak
            "gb_s": (read + written) / t if t else 0.0, "gflop_s": flops / t if t else 0.0,
            "share": t / steps / 1e3 / step_us if step_us else 0.0,
        })
    kernels_us = float(total_ns.sum()) / steps / 1e3
    dispatch_us, exit_us = (float(x) / 1e3 for x in sync_ns.mean(axis=0))
    overhead_us = step_us - kernels_us - dispatch_us - exit_us
    # per step too: one preemption outside the native step moves the mean, not the median
    step_over = 1 - (samples.sum(axis=1) + sync_ns.sum(axis=1)) / 1e9 / wall_s
    return {
        "entry": graph.name.rsplit(".", 1)[-1],
        "steps": steps,
        "tokens_per_step": sum(len(p) for p in runs[0]),
        "positions": [runs[0][0][0], runs[-1][-1][-1]],
        "measured_us": step_us,
        "measured_us_median": float(np.median(wall_s)) * 1e6,
        "kernels_us": kernels_us,
        "dispatch_us": dispatch_us,
        "exit_us": exit_us,
        "overhead_us": overhead_us,
        "kernels_pct": 100 * kernels_us / step_us if step_us else 0.0,
        "overhead_pct": 100 * overhead_us / step_us if step_us else 0.0,
        "overhead_pct_median": 100 * float(np.median(step_over)),
        "within_10pct": abs(overhead_us) <= MAX_GAP * step_us,
        "kinds": _group(nodes, "op", step_us),
        "layers": _layers(nodes),
        "nodes": nodes,
    }


def _group(nodes: list[dict], key: str, step_us: float) -> list[dict]:
    groups: dict[Any, list[dict]] = defaultdict(list)
    for n in nodes:
        groups[n[key]].append(n)
    out = []
    for k, ns in groups.items():
        us = sum(n["us"] for n in ns)
        read, written, flops = (sum(n[f] for n in ns) for f in ("bytes_read", "bytes_written", "flops"))
        out.append({"kind": k, "nodes": len(ns), "us": us, "share": us / step_us if step_us else 0.0,
                    "int8": all(n.get("int8") for n in ns),
                    "bytes_read": read, "bytes_written": written, "flops": flops,
                    "gb_s": (read + written) / (us * 1e3) if us else 0.0,
                    "gflop_s": flops / (us * 1e3) if us else 0.0})
    return sorted(out, key=lambda g: -g["us"])


def _layers(nodes: list[dict]) -> list[dict]:
    order: list[Any] = []
    by: dict[Any, dict[str, float]] = {}
    for n in nodes:
        if n["layer"] not in by:
            order.append(n["layer"])
            by[n["layer"]] = defaultdict(float)
        by[n["layer"]][n["op"]] += n["us"]
    return [{"layer": l, "us": sum(by[l].values()), "by_kind": dict(by[l])} for l in order]


# --- text ---------------------------------------------------------------------------------
def _table(head: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i < left else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return [fmt(head), *(fmt(r) for r in rows)]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f}"


def format_section(sec: dict, top: int = TOP_NODES, peak: float | None = None) -> str:
    steps, tokens = sec["steps"], sec["tokens_per_step"]
    what = (f"decode step (mean of {steps}, positions {sec['positions'][0]}..{sec['positions'][1]})"
            if sec["entry"] == "decode" else f"{sec['entry']} of {tokens} tokens (one run)")
    m = sec["measured_us"]
    verdict = "within 10%" if sec["within_10pct"] else "NOT within 10%"
    lines = [f"{what}: measured {m:,.1f} us (median {sec['measured_us_median']:,.1f} us)",
             f"  sum of kernel times  {sec['kernels_us']:>12,.1f} us  {sec['kernels_pct']:6.1f}%",
             f"  dispatch             {sec['dispatch_us']:>12,.1f} us  {100 * sec['dispatch_us'] / m:6.1f}%"
             "  (lmc_run waking the workers until all are in the step)",
             f"  exit                 {sec['exit_us']:>12,.1f} us  {100 * sec['exit_us'] / m:6.1f}%"
             "  (after the last op, until every thread is done)",
             f"  overhead             {sec['overhead_us']:>12,.1f} us  {sec['overhead_pct']:6.1f}%"
             f"  (ctypes call; median step {sec['overhead_pct_median']:.1f}%)",
             f"  kernels + dispatch + exit explain the measured step time {verdict}", ""]
    def of_peak(k: dict) -> str:
        """An integer-path matmul's operations per second against the int8 peak."""
        return f"{100 * k['gflop_s'] / peak:.1f}%" if peak and k.get("int8") else ""

    rows = [[k["kind"], str(k["nodes"]), f"{k['us']:,.1f}", f"{100 * k['share']:.1f}%", _mb(k["bytes_read"]),
             _mb(k["bytes_written"]), f"{k['gb_s']:.1f}", f"{k['gflop_s']:.2f}", of_peak(k)] for k in sec["kinds"]]
    for what in ("dispatch", "exit"):
        rows.append([f"({what})", "", f"{sec[what + '_us']:,.1f}", f"{100 * sec[what + '_us'] / m:.1f}%",
                     "", "", "", "", ""])
    rows.append(["(overhead)", "", f"{sec['overhead_us']:,.1f}", f"{sec['overhead_pct']:.1f}%", "", "", "", "", ""])
    rows.append(["total (measured)", str(len(sec["nodes"])), f"{m:,.1f}", "100.0%",
                 _mb(sum(k["bytes_read"] for k in sec["kinds"])), _mb(sum(k["bytes_written"] for k in sec["kinds"])),
                 "", "", ""])
    lines += _table(["op kind", "nodes", "us/step", "share", "MB read", "MB written", "GB/s", "GFLOP/s",
                     "int8 peak"], rows)
    ranked = sorted(sec["nodes"], key=lambda n: -n["us"])[:top]
    if ranked:
        lines += ["", f"top {len(ranked)} of {len(sec['nodes'])} nodes"]
        rows = [[str(n["index"]), n["name"], n["op"], str(n["layer"]), "x".join(map(str, n["shape"])) or "scalar",
                 f"{n['us']:,.1f}", f"{100 * n['share']:.1f}%", _mb(n["bytes_read"]), _mb(n["bytes_written"]),
                 f"{n['gb_s']:.1f}", f"{n['gflop_s']:.2f}"] for n in ranked]
        lines += _table(["#", "node", "op", "layer", "shape", "us/step", "share", "MB read", "MB written", "GB/s",
                         "GFLOP/s"], rows, left=5)
    return "\n".join(lines)


def format_text(report: dict, top: int = TOP_NODES) -> str:
    head = (f"lmc profile: {report['model']}, {report['threads']} thread(s), CPU {report['cpu']}, "
            f"context {report['ctx']}")
    peak = report.get("int8_peak_gops")
    if peak:
        head += (f"\nint8 peak ({report['int8_unit']}, probed with {report['threads']} thread(s) after the runs): "
                 f"{peak:,.0f} GOPS; an integer-path matmul's GFLOP/s (2 per multiply-add) against it in 'int8 peak'")
    return "\n\n".join([head, format_section(report["decode"], top, peak),
                         format_section(report["prefill"], top, peak)]) + "\n"


# --- svg ----------------------------------------------------------------------------------
#: Tableau 10: distinct hues for the op kinds; grey is for time outside kernels
_PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
            "#17becf", "#bcbd22", "#8c564b", "#1f77b4", "#d62728"]
_GREY = "#bab0ac"
_W, _LABEL, _ROW = 960, 190, 22


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 12, weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}">{escape(s)}</text>')


def _kind_panel(sec: dict, colours: dict[str, str], y: float, gid: str) -> tuple[list[str], float]:
    """Horizontal bars: time per op kind, then dispatch, exit and overhead (grey)."""
    m = sec["measured_us"]
    rows = [(k["kind"], k["us"], colours[k["kind"]], "bar") for k in sec["kinds"]]
    rows += [(f"({w})", sec[f"{w}_us"], _GREY, "other") for w in ("dispatch", "exit", "overhead")]
    top = max([u for _, u, _, _ in rows] + [1e-9])
    span = _W - _LABEL - 200
    title = (f"{sec['entry']}: time per op kind, {m:,.1f} us per step measured; kernels "
             f"{sec['kernels_pct']:.1f}%, overhead {sec['overhead_pct']:.1f}%")
    out = [f'<g id="{gid}">', _text(10, y + 16, title, size=14, weight="bold")]
    y += 28
    for label, us, colour, cls in rows:
        w = max(0.0, us) / top * span
        out.append(_text(_LABEL - 8, y + 15, label, anchor="end"))
        out.append(f'<rect class="{cls}" data-kind="{escape(label)}" x="{_LABEL}" y="{y + 3:.1f}" '
                   f'width="{w:.1f}" height="{_ROW - 6}" fill="{colour}"><title>{escape(label)}: {us:,.1f} us'
                   f'</title></rect>')
        out.append(_text(_LABEL + w + 6, y + 15, f"{us:,.1f} us  {100 * us / m:.1f}%" if m else f"{us:,.1f} us"))
        y += _ROW
    out.append("</g>")
    return out, y + 12


def _layer_panel(sec: dict, colours: dict[str, str], y: float) -> tuple[list[str], float]:
    """One stacked bar per layer (and the embedding and head), coloured by op
    kind, so a slow block or a lopsided split within blocks stands out."""
    layers = sec["layers"]
    top = max([l["us"] for l in layers] + [1e-9])
    span = _W - _LABEL - 120
    out = ['<g id="layers">', _text(10, y + 16, f"{sec['entry']}: time per layer, by op kind", size=14,
                                    weight="bold")]
    y += 28
    h = 14
    for l in layers:
        name = f"layer {l['layer']}" if isinstance(l["layer"], int) else str(l["layer"])
        out.append(_text(_LABEL - 8, y + 11, name, anchor="end", size=11))
        x = float(_LABEL)
        for kind, us in l["by_kind"].items():
            w = us / top * span
            out.append(f'<rect class="seg" data-kind="{escape(kind)}" x="{x:.1f}" y="{y + 1:.1f}" width="{w:.1f}" '
                       f'height="{h - 2}" fill="{colours[kind]}"><title>{escape(name)} {escape(kind)}: '
                       f'{us:,.1f} us</title></rect>')
            x += w
        out.append(_text(x + 6, y + 11, f"{l['us']:,.1f} us", size=11))
        y += h
    y += 8
    x = 10.0  # legend: which colour is which kind
    for kind in colours:
        if x > _W - 150:
            x, y = 10.0, y + 18
        out.append(f'<rect class="legend" x="{x:.1f}" y="{y + 4:.1f}" width="12" height="12" fill="{colours[kind]}"/>')
        out.append(_text(x + 16, y + 15, kind, size=11))
        x += 22 + 7 * len(kind)
    out.append("</g>")
    return out, y + 30


def format_svg(report: dict) -> str:
    """The breakdown as a standalone SVG: decode time per op kind, decode
    time per layer (stacked by kind), prefill time per op kind."""
    dec, pre = report["decode"], report["prefill"]
    colours: dict[str, str] = {}
    for k in [*dec["kinds"], *pre["kinds"]]:
        colours.setdefault(k["kind"], _PALETTE[len(colours) % len(_PALETTE)])
    body = [_text(10, 22, f"lmc profile: {report['model']}, {report['threads']} thread(s), CPU {report['cpu']}",
                  size=16, weight="bold")]
    y = 34.0
    for part in (lambda y: _kind_panel(dec, colours, y, "decode-kinds"), lambda y: _layer_panel(dec, colours, y),
                 lambda y: _kind_panel(pre, colours, y, "prefill-kinds")):
        lines, y = part(y)
        body += lines
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{int(y) + 10}" '
            f'viewBox="0 0 {_W} {int(y) + 10}" font-family="sans-serif">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")


# --- output --------------------------------------------------------------------------------
def render(report: dict, fmt: str, top: int = TOP_NODES) -> str:
    if fmt == "json":
        import json

        return json.dumps(report, indent=1) + "\n"
    if fmt == "svg":
        return format_svg(report)
    return format_text(report, top)
