"""What one step of a graph costs in calls (``lmc ir --stats``)."""
from __future__ import annotations

from collections import Counter

from compiler.native import DEFAULT_PREFILL_CHUNK
from ir.graph import Graph
from ir.printer import layout_label
from passes.barriers import barrier_count
from passes.plan_arena import plan_arena


def graph_stats(g: Graph, title: str) -> str:
    """What one step of ``g`` costs in calls: a kernel per op, a barrier
    before each op that touches what the ops since the last one touched
    (``passes.barriers``) and one at the end; ops by kind; the arena (a
    prefill chunk at the native default length)."""
    symbols = {"T": DEFAULT_PREFILL_CHUNK}
    plan = plan_arena(g, symbols)
    kinds = Counter(n.op + (f"[{layout_label(n)}]" if n.attrs.get("layout") else "") for n in g.nodes)
    lines = [title,
             f"kernel calls per step  {len(g.nodes)}",
             f"barriers per step      {barrier_count(g, plan)}  (one after every op: {len(g.nodes)})",
             f"arena                  {plan.size / 2**20:.2f} MiB" + (" (T = %d)" % symbols["T"] if g.meta.get("mode") != "decode" else ""),
             "ops by kind            " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))]
    return "\n".join(lines) + "\n"
