"""What one pass changed: nodes removed, added, fused, changed and moved.

Nodes are matched across steps by the name of the value they define: the
passes keep a rewritten node's output (``fuse_dequant`` turns
``%5 = matmul(%4, %3)`` into ``%5 = qmatmul[Q4_K](%4, @w)`` and drops the
dequant ``%3``), so a name in both graphs is the same node. A node is
*fused* when it changed and read, before the pass, a node the pass removed
(the dequant, the activation of a glu, the RMSNorm of ``fuse_norm``); it is
*changed* when only its op, operands, attributes or types differ (``int_dot``
adds ``act``, ``repack`` retypes the weights), and *moved* when the pass
reordered it (``schedule``): the fewest nodes whose moves explain the new
order (those off a longest run of nodes kept in their old order).
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from ir.graph import Graph, Node
from ir.printer import print_node


def _key(node: Node) -> tuple[str, tuple[str, ...]]:
    """What must stay equal for a node to be unchanged: its text form and its operand types."""
    return print_node(node), tuple(str(v.type) for v in node.inputs)


def _changes(before: Node, after: Node) -> list[str]:
    """What differs, in words short enough for a list."""
    out = []
    if before.op != after.op:
        out.append(f"op {before.op} -> {after.op}")
    if [v.name for v in before.inputs] != [v.name for v in after.inputs]:
        out.append("operands " + ", ".join(v.sigil + v.name for v in before.inputs) + " -> "
                   + ", ".join(v.sigil + v.name for v in after.inputs))
    a, b = {**before.attrs, **before.kernel}, {**after.attrs, **after.kernel}
    for k in sorted(set(a) | set(b)):
        if k not in a:
            out.append(f"+{k}={b[k]}")
        elif k not in b:
            out.append(f"-{k}")
        elif a[k] != b[k]:
            out.append(f"{k} {a[k]} -> {b[k]}")
    old_types = {v.sigil + v.name: str(v.type) for v in before.inputs}
    for v in after.inputs:
        was = old_types.get(v.sigil + v.name)
        if was is not None and was != str(v.type):
            out.append(f"{v.sigil}{v.name}: {was} -> {v.type}")
    if str(before.output.type) != str(after.output.type):
        out.append(f"type {before.output.type} -> {after.output.type}")
    return out


def _moved(before: list[str], after: list[str]) -> set[str]:
    """Names in ``after`` off one longest subsequence that keeps ``before``'s order."""
    pos = {n: i for i, n in enumerate(before)}
    seq = [n for n in after if n in pos]
    tails: list[int] = []                 # smallest last position of an increasing run of each length
    tail_at: list[int] = []               # index in seq of that last element
    parent = [-1] * len(seq)
    for i, n in enumerate(seq):
        p = pos[n]
        j = bisect.bisect_left(tails, p)
        if j == len(tails):
            tails.append(p)
            tail_at.append(i)
        else:
            tails[j], tail_at[j] = p, i
        parent[i] = tail_at[j - 1] if j else -1
    keep, i = set(), tail_at[-1] if tail_at else -1
    while i >= 0:
        keep.add(seq[i])
        i = parent[i]
    return {n for n in seq if n not in keep}


def _counts(ops: list[str]) -> str:
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in Counter(ops).most_common())


def step_diff(before: Graph | None, after: Graph, name: str) -> dict[str, Any]:
    """The changes from ``before`` to ``after`` (the graph after pass
    ``name``), with a one-line summary; ``before`` None: the first step."""
    if before is None:
        return {"summary": f"{name}: {len(after.nodes)} nodes as built", "added": [], "removed": [], "fused": [],
                "changed": [], "moved": [], "nodes_before": None, "nodes_after": len(after.nodes)}
    old = {n.output.name: n for n in before.nodes}
    new = {n.output.name: n for n in after.nodes}
    removed = [n for k, n in old.items() if k not in new]
    gone = {n.output.name for n in removed}
    added = [n for k, n in new.items() if k not in old]
    fused, changed = [], []
    for k, n in new.items():
        was = old.get(k)
        if was is None or _key(was) == _key(n):
            continue
        absorbed = [v for v in was.inputs if v.kind == "node" and v.name in gone]
        entry = {"name": k, "op": n.op, "was": was.op, "changes": _changes(was, n)}
        if absorbed:
            ops = sorted({v.producer.op for v in absorbed if v.producer is not None})
            fused.append({**entry, "absorbed": [v.name for v in absorbed], "absorbed_ops": ops,
                          "what": f"{was.op} + {' + '.join(ops)} -> {n.op}"})
        else:
            changed.append(entry)
    order = {k: i for i, k in enumerate(new)}
    moved = sorted(_moved(list(old), list(new)), key=order.__getitem__)
    parts = [f"{len(before.nodes)} -> {len(after.nodes)} nodes"]
    if removed:
        parts.append(f"removed {len(removed)} ({_counts([n.op for n in removed])})")
    if added:
        parts.append(f"added {len(added)} ({_counts([n.op for n in added])})")
    if fused:
        parts.append(f"fused {len(fused)} ({_counts([f['what'] for f in fused])})")
    if changed:
        parts.append(f"changed {len(changed)} ({_counts([c['op'] for c in changed])})")
    if moved:
        parts.append(f"moved {len(moved)}")
    if len(parts) == 1:
        parts.append("no change")
    return {
        "summary": f"{name}: " + "; ".join(parts),
        "removed": [{"name": n.output.name, "op": n.op, "text": print_node(n)} for n in removed],
        "added": [{"name": n.output.name, "op": n.op, "text": print_node(n)} for n in added],
        "fused": fused,
        "changed": changed,
        "moved": moved,
        "nodes_before": len(before.nodes),
        "nodes_after": len(after.nodes),
    }
