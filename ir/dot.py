"""DOT export: pictures of the graph that explain what the compiler did.

Ops are boxes labelled with op, quant layout and output type; weights are
notes (layout, shape, bytes), KV cache state is a cylinder, inputs/outputs
are ovals, so what is data and what is computation reads at a glance. Colour
says what kind of kernel a box is (matmul-like, attention, norm/rope,
elementwise, memory) and how a weight is stored; a legend in the picture
says which. A fused kernel (``qmatmul`` after ``fuse_dequant``: dequant and
matmul in one loop) is a cluster holding the op and the weight it reads.

Views: ``all`` (every node, one cluster a layer), ``overview`` (one block
drawn once in a cluster "x N layers" between embedding and head, so a 7B
model stays readable) and ``layer`` (one block in full, with stubs for what
flows in and out). This module writes DOT text only; rendering to SVG/PNG
needs Graphviz and lives on the runtime side (``runtime/cli/ir_render.py``).
"""
from __future__ import annotations

from collections import Counter
import networkx as nx

from .graph import Graph, Node, Value
from .layers import EMBED, count_layers, layer_variation, node_sections, section_nodes
from .ops import OPS
from .printer import layout_label, ref


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_networkx(graph: Graph) -> nx.DiGraph:
    """Values and nodes as one directed graph (edges follow data)."""
    g = nx.DiGraph()
    for v in graph.inputs:
        g.add_node(ref(v), kind="input", label=f"{v.name}\n{v.type}")
    for v in graph.weights.values():
        g.add_node(ref(v), kind="weight", label=f"{v.name}\n{v.type}")
    for v in graph.states.values():
        g.add_node(ref(v), kind="state", label=f"{v.name}\n{v.type}")
    for node in graph.nodes:
        label = node.op + (f"[{layout_label(node)}]" if "layout" in node.attrs else "")
        g.add_node(ref(node.output), kind="op", label=f"{label}\n{node.output.type}")
        for v in node.inputs:
            g.add_edge(ref(v), ref(node.output))
    for v in graph.outputs:
        g.add_node("out:" + v.name, kind="output", label=f"output {v.name}")
        g.add_edge(ref(v), "out:" + v.name)
    return g


#: op kind -> (what the legend says, fill colour). The kinds follow what a
#: kernel costs: matmuls read weight matrices, attention reads the KV cache,
#: memory ops move rows, elementwise ops are one cheap pass.
OP_KINDS: dict[str, tuple[str, str]] = {
    "matmul": ("matmul / qmatmul: reads a weight matrix", "#f7b267"),
    "attention": ("attention over the KV cache", "#c7a4e8"),
    "norm": ("rmsnorm / rope", "#9fd89a"),
    "elementwise": ("elementwise: add, mul, activation, scale", "#ffffff"),
    "memory": ("memory: embedding row, kv_write, rope_kv_write, take_last", "#8ec5f0"),
    "dequant": ("dequant: a float copy of a weight (fuse_dequant removes it)", "#f28b82"),
    "other": ("other op", "#d9d9d9"),
}
_OP_KIND = {"matmul": "matmul", "qmatmul": "matmul", "qmatmul_rows": "matmul", "qmatmul_add": "matmul",
            "attention": "attention",
            "attention_paged": "attention", "softmax": "attention", "rmsnorm": "norm", "rope": "norm",
            "embedding": "memory", "kv_write": "memory", "kv_write_paged": "memory",
            "rope_kv_write": "memory", "rope_kv_write_paged": "memory", "take_last": "memory",
            "dequant": "dequant", "bias_add": "elementwise"}

#: weight storage by bits a weight (its layout's bytes for a row x 8 / row length)
#: -> (legend text, fill colour): darker = fewer bits a weight
WEIGHT_FAMILIES: dict[str, tuple[str, str]] = {
    "float": ("weight, float (F32, F16, BF16)", "#e6e6e6"),
    "8bit": ("weight, 8-bit blocks (Q8_0, llama2.c Q8 ...)", "#fff3b0"),
    "4bit": ("weight, 4 to 7 bits (Q4_0, Q4_K, IQ4_NL, Q6_K ...)", "#ffd95a"),
    "lowbit": ("weight, under 4 bits (Q2_K, Q3_K, TQ1_0 ...)", "#d9a521"),
    "other": ("weight, a layout lmc does not know", "#b08d57"),
}
STATE_COLOUR = "#7fd1c7"
FUSED_COLOUR, FUSED_BORDER = "#fff4e6", "#e07b00"
BLOCK_COLOUR, BLOCK_BORDER = "#f3f7fc", "#4a6fa5"
STUB_COLOUR = "#888888"


def op_kind(op: str) -> str:
    """The legend's kind of an op."""
    if op in _OP_KIND:
        return _OP_KIND[op]
    return "elementwise" if op in OPS and OPS[op].elementwise else "other"


def layout_family(layout: str | None) -> str:
    """The legend's storage family of a weight layout (``Q4_0x16``: its base
    type's), by the bits a weight its layout stores."""
    from .quant import get_layout, split_stored

    if layout is None:
        return "float"
    try:
        lay = get_layout(split_stored(layout)[0])
    except (KeyError, ValueError):
        return "other"
    k = 4096   # a row length every block size divides
    bits = lay.nbytes((1, k)) * 8 / k
    return "float" if bits >= 16 else "8bit" if bits >= 8 else "4bit" if bits >= 4 else "lowbit"


def is_fused(node: Node) -> bool:
    """A quantized matmul is one kernel that dequantizes in registers."""
    return node.op in ("qmatmul", "qmatmul_rows", "qmatmul_add")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def op_label(node: Node) -> str:
    """``qmatmul[Q4_K] act=q8`` over the output type, plus the attribute that
    tells layers apart (sliding window, RoPE base), if any."""
    head = node.op + (f"[{node.attrs['layout']}]" if "layout" in node.attrs else "")
    if node.attrs.get("act"):
        head += f" act={node.attrs['act']}"
    if node.op == "glu":
        head += f" {node.attrs['activation']}"
    lines = [head, str(node.output.type)]
    if node.op in ("attention", "attention_paged") and node.attrs.get("window"):
        lines.append(f"sliding window {node.attrs['window']}")
    elif node.op in ("rope", "rope_kv_write", "rope_kv_write_paged") and "theta" in node.attrs:
        a = node.attrs
        scaling = ("yarn " if a.get("ext_factor") else "") + (f"x{1 / a['freq_scale']:g}" if "freq_scale" in a else "")
        lines.append(f"theta={a['theta']:g}" + (f", scaled {scaling}" if scaling else ""))
    return "\n".join(lines)


def fused_label(node: Node) -> str:
    layout = node.attrs.get("layout", "?")
    if node.attrs.get("act"):
        return f"fused: dequant {layout} + int8 dot (act={node.attrs['act']})"
    return f"fused: dequant {layout} + matmul"


def _section_name(s: int, n_layers: int) -> str:
    return "embedding" if s == EMBED else "head" if s == n_layers else f"layer {s}"


def _vid(v: Value) -> str:
    """DOT id of a value. Graphviz renames ids that start with ``%`` (its own
    anonymous names), so activations and inputs get a word in front."""
    return {"node": "node ", "input": "input "}.get(v.kind, "") + ref(v)


class _Picture:
    """Collects DOT statements: declarations inside clusters, edges last."""

    def __init__(self, graph: Graph, overview: bool) -> None:
        self.graph, self.overview = graph, overview
        self.lines: list[str] = []
        self.edges: list[str] = []
        self.kinds: set[str] = set()
        self.families: set[str] = set()
        self.has_state = self.has_fused = self.has_int = False
        self._clusters = 0
        self.n_uses = Counter(id(v) for n in graph.nodes for v in n.inputs)
        self.n_layers = count_layers(graph)

    def open(self, name: str, label: str, attrs: str, ind: str) -> None:
        self._clusters += 1
        self.lines.append(f"{ind}subgraph {_q(f'cluster_{name}')} {{")
        self.lines.append(f"{ind}  label={_q(label)}; {attrs}")

    def const_id(self, v: Value, user: Node) -> str:
        """Weights read by several ops are drawn once per use (a tied
        embedding is both the first lookup and the last matmul)."""
        return ref(v) if self.n_uses[id(v)] <= 1 else f"{ref(v)}#{ref(user.output)}"

    def const(self, v: Value, user: Node, ind: str) -> None:
        if v.kind == "state":
            self.has_state = True
            label = f"{v.name}\nKV cache {v.type}\n{human_bytes(v.type.nbytes())}"
            style = f'shape=cylinder, style=filled, fillcolor="{STATE_COLOUR}"'
        else:
            fam = layout_family(v.type.stored)
            self.families.add(fam)
            label = self._weight_label(v)
            style = f'shape=note, style=filled, fillcolor="{WEIGHT_FAMILIES[fam][1]}", fontsize=9'
        self.lines.append(f"{ind}{_q(self.const_id(v, user))} [label={_q(label)}, {style}];")
        self.edges.append(f"{_q(self.const_id(v, user))} -> {_q(_vid(user.output))};")

    def _weight_label(self, v: Value) -> str:
        dims = ", ".join(str(d) for d in v.type.shape)
        nbytes = v.ref.nbytes if v.ref is not None else v.type.nbytes()
        lines = [v.name, f"{v.type.stored or v.type.dtype} [{dims}]", human_bytes(nbytes)]
        if self.n_uses[id(v)] > 1:
            lines.append(f"one tensor, read by {self.n_uses[id(v)]} ops")
        if self.overview and v.name.startswith("blk.0."):
            same = [self.graph.weights.get(f"blk.{i}.{v.name[6:]}") for i in range(self.n_layers)]
            same = [w for w in same if w is not None]
            total = sum(w.ref.nbytes if w.ref is not None else w.type.nbytes() for w in same)
            lines[-1] += f" (x{len(same)}: {human_bytes(total)})"
            kinds = Counter(w.type.stored or w.type.dtype for w in same)
            if len(kinds) > 1:
                lines.append(", ".join(f"{k} in {c}" for k, c in kinds.most_common()))
        return "\n".join(lines)

    def op(self, node: Node, ind: str) -> None:
        kind = op_kind(node.op)
        self.kinds.add(kind)
        extra = ""
        if node.attrs.get("act"):
            self.has_int = True
            extra = ", penwidth=3"
        self.lines.append(f"{ind}{_q(_vid(node.output))} [label={_q(op_label(node))}, shape=box, "
                          f'style="rounded,filled", fillcolor="{OP_KINDS[kind][1]}"{extra}];')

    def nodes(self, nodes: list[Node], ind: str) -> None:
        for node in nodes:
            consts = [v for v in node.inputs if v.kind in ("weight", "state")]
            if is_fused(node):
                self.has_fused = True
                self.open(f"fused_{self._clusters}", fused_label(node),
                          f'style="rounded,dashed,filled"; fillcolor="{FUSED_COLOUR}"; color="{FUSED_BORDER}"; '
                          'fontsize=9;', ind)
                w = node.inputs[1]
                self.const(w, node, ind + "  ")
                self.op(node, ind + "  ")
                self.lines.append(ind + "}")
                consts = [v for v in consts if v is not w]
            else:
                self.op(node, ind)
            for v in consts:
                self.const(v, node, ind)

    def legend(self) -> None:
        """The colours and shapes this picture uses: one sample node per row,
        drawn in its own shape and colour (plain labels, so every Graphviz
        build draws it, the WebAssembly one too, which has no HTML labels)."""
        rows = [(OP_KINDS[k][1], "box", "rounded,filled", OP_KINDS[k][0]) for k in OP_KINDS if k in self.kinds]
        rows += [(WEIGHT_FAMILIES[f][1], "note", "filled", WEIGHT_FAMILIES[f][0]) for f in WEIGHT_FAMILIES
                 if f in self.families]
        if self.has_state:
            rows.append((STATE_COLOUR, "cylinder", "filled", "KV cache state (persists between steps)"))
        rows.append(("#ffffff", "oval", "filled", "graph input / output"))
        if self.has_fused:
            rows.append((FUSED_COLOUR, "box", "dashed,filled", "fused kernel: dequantizes in registers, no float copy"))
        if self.has_int:
            rows.append(("#ffffff", "box", "rounded,bold", "integer path: activations quantized to 8 bits (act=q8)"))
        if self.overview:
            rows.append((BLOCK_COLOUR, "box", "rounded,filled", "one block, drawn once for all N layers"))
        self.lines.append('  subgraph "cluster_legend" {')
        self.lines.append('    label="legend"; style="rounded"; color="#999999";')
        self.lines.append('    "legend" [shape=plaintext, fontsize=9, label="shape and colour: what it is"];')
        prev = "legend"
        for i, (colour, shape, style, text) in enumerate(rows):
            name = f"legend.{i}"
            self.lines.append(f'    "{name}" [shape={shape}, style="{style}", fillcolor="{colour}", fontsize=9, '
                              f'label={_q(text)}];')
            self.lines.append(f'    "{prev}" -> "{name}" [style=invis];')
            prev = name
        self.lines.append("  }")


def to_dot(graph: Graph, view: str = "all", layer: int | None = None, title: str | None = None) -> str:
    """DOT text of ``graph``. ``view``: ``all``, ``overview`` or ``layer``
    (then ``layer`` is the block to draw). Raises ValueError on a bad view."""
    n_layers = count_layers(graph)
    sections = node_sections(graph)
    by = section_nodes(graph, sections)
    overview = view == "overview" and n_layers > 0
    if view == "layer":
        if layer is None or not 0 <= layer < n_layers:
            raise ValueError(f"--layer {layer}: the model has {n_layers} layers (0-{n_layers - 1})")
        shown = [layer]
    elif view == "overview":
        shown = [EMBED, 0, n_layers] if n_layers else [EMBED]
    elif view == "all":
        shown = [EMBED, *range(n_layers), n_layers]
    else:
        raise ValueError(f"unknown view {view!r} (all, overview, layer)")
    visible = {id(n) for s in shown for n in by.get(s, [])}

    pic = _Picture(graph, overview)
    head = title or graph.name
    pic.lines += [f"digraph {_q(graph.name)} {{", "  rankdir=TB;",
                  f"  graph [fontname=\"Helvetica\", label={_q(head)}, labelloc=t, fontsize=14];",
                  '  node [fontname="Helvetica", fontsize=10];', '  edge [color="#555555", arrowsize=0.6];']
    used_inputs = {id(v) for n in graph.nodes if id(n) in visible for v in n.inputs if v.kind == "input"}
    for v in graph.inputs:
        if id(v) in used_inputs:
            pic.lines.append(f"  {_q(_vid(v))} [label={_q(f'{v.name}' + chr(10) + str(v.type))}, shape=oval, "
                             "penwidth=1.5];")
    for s in shown:
        nodes = by.get(s, [])
        if not nodes:
            continue
        if overview and s == 0:
            pic.open("block", _block_label(graph, sections, n_layers),
                     f'style="rounded,filled"; fillcolor="{BLOCK_COLOUR}"; color="{BLOCK_BORDER}"; penwidth=2; '
                     "fontsize=13;", "  ")
        else:
            name = "embed" if s == EMBED else "head" if s == n_layers else f"layer_{s}"
            label = {EMBED: "embedding", n_layers: "head: final norm + output"}.get(s, f"layer {s}")
            pic.open(name, label, 'style="rounded"; color="#bbbbbb";', "  ")
        pic.nodes(nodes, "    ")
        pic.lines.append("  }")
    _data_edges(pic, graph, sections, by, visible, overview)
    pic.legend()
    pic.lines += ["  " + e for e in pic.edges]
    pic.lines.append("}")
    return "\n".join(pic.lines) + "\n"


def _block_label(graph: Graph, sections: dict[int, int], n_layers: int) -> str:
    """``x N layers``, and how the other layers differ from the one drawn."""
    lines = [f"x {n_layers} layers"]
    var = layer_variation(graph, sections, shown=0)
    if var.attrs or var.structure:
        lines.append("(layer 0 shown)")
    for key, layers in sorted(var.attrs.items()):
        lines.append(f"{key} differs in layers {_ranges(layers)}")
    if var.structure:
        lines.append(f"other ops in layers {_ranges(var.structure)}")
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    for x in sorted(xs):
        if out and out[-1][1] == x - 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))  # type: ignore[arg-type]
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)  # type: ignore[misc]


def _data_edges(pic: _Picture, graph: Graph, sections: dict[int, int], by: dict[int, list[Node]],
                visible: set[int], overview: bool) -> None:
    """Edges between activations. A value from a block that is not drawn is
    shown, in the overview, as coming from the drawn block (same position in
    the layer), else as a stub saying where it comes from / goes to."""
    n_layers = pic.n_layers
    pos = {id(n): i for nodes in by.values() for i, n in enumerate(nodes)}
    rep = by.get(0, [])

    def stand_in(v: Value) -> str | None:
        s = sections[id(v.producer)]
        if overview and 0 < s < n_layers and len(by.get(s, [])) == len(rep):
            return _vid(rep[pos[id(v.producer)]].output)
        return None

    stubs: set[str] = set()

    def stub(sid: str, label: str) -> None:
        if sid not in stubs:
            stubs.add(sid)
            pic.lines.append(f"  {_q(sid)} [label={_q(label)}, shape=box, style=dashed, color=\"{STUB_COLOUR}\", "
                             f"fontcolor=\"{STUB_COLOUR}\", fontsize=9];")

    users = graph.users()
    for node in graph.nodes:
        if id(node) not in visible:
            continue
        for v in node.inputs:
            if v.kind == "input":
                pic.edges.append(f"{_q(_vid(v))} -> {_q(_vid(node.output))};")
            elif v.kind == "node":
                if id(v.producer) in visible:
                    src = _vid(v)
                else:
                    src = stand_in(v)
                    if src is None:
                        src = "from " + ref(v)
                        where = _section_name(sections[id(v.producer)], n_layers)
                        stub(src, f"from {where}\n{ref(v)} : {v.type}")
                pic.edges.append(f"{_q(src)} -> {_q(_vid(node.output))};")
        outside = {sections[id(u)] for u in users.get(id(node.output), []) if id(u) not in visible}
        if outside and not overview:
            sid = "to " + ref(node.output)
            stub(sid, "to " + ", ".join(_section_name(s, n_layers) for s in sorted(outside)))
            pic.edges.append(f"{_q(_vid(node.output))} -> {_q(sid)} [style=dashed];")
    if overview and n_layers > 1 and len(by.get(1, [])) == len(rep):
        for node in by[1]:  # what block 1 reads from block 0 is the loop back into the block
            for v in node.inputs:
                if v.kind == "node" and sections[id(v.producer)] == 0:
                    pic.edges.append(f"{_q(_vid(rep[pos[id(v.producer)]].output))} -> "
                                     f"{_q(_vid(rep[pos[id(node)]].output))} [style=dashed, "
                                     f"color=\"{BLOCK_BORDER}\", constraint=false, label=\"next layer\", "
                                     f"fontsize=8, fontcolor=\"{BLOCK_BORDER}\"];")
    for v in graph.outputs:
        if v.producer is not None and id(v.producer) in visible:
            pic.lines.append(f"  {_q('output ' + v.name)} [label={_q(f'{v.name}' + chr(10) + str(v.type))}, "
                             "shape=oval, penwidth=1.5];")
            pic.edges.append(f"{_q(_vid(v))} -> {_q('output ' + v.name)};")
