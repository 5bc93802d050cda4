"""Everything one ``lmc viz`` run shows, computed once at start (the steps,
the memory plan, the profile) or on first request and then kept (pictures,
diffs, kernels): the server's handlers only look things up here.

Lookups raise ``NotFound`` for a step or node that does not exist, which
the app answers with a JSON 404.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from compiler.codegen.kernels import KernelSig
from compiler.codegen.target import host_target
from compiler.driver import CompileOptions, LoadedModel, repack_width
from compiler.native import NativeOptions
from ir.dot import to_dot
from ir.graph import Node
from passes.memory_budget import fmt_size

from .. import ir_render, plan_report
from .diff import step_diff
from .kernel_code import find_mca, kernel_code
from .nodes import GraphIndex
from .steps import Step, record_steps

#: the picture views (``ir.dot.to_dot``)
VIEWS = ("overview", "layer", "all")


class NotFound(LookupError):
    """A step, node or view the request names does not exist."""


@dataclass
class VizOptions:
    """What ``lmc viz`` was asked for."""

    model_path: str
    tokenizer: str | None
    mode: str
    native: NativeOptions
    profile: bool = False
    threads: int | None = None


class Session:
    """The recorded steps of one model and what the viewer derives from them."""

    def __init__(self, model: LoadedModel, options: VizOptions, steps: list[Step], plan: dict[str, Any],
                 profile: dict[str, Any] | None) -> None:
        self.model, self.options, self.steps = model, options, steps
        self.plan_report = plan
        self.profile_report = profile
        self._index: dict[int, GraphIndex] = {}
        self._diff: dict[Any, dict[str, Any]] = {}
        self._svg: dict[tuple[int, str, int | None], bytes] = {}
        self._kernels: dict[KernelSig, dict[str, Any]] = {}
        self._locks: dict[Any, threading.Lock] = {}
        self._guard = threading.Lock()

    # --- lookups ------------------------------------------------------------------------
    def step(self, key: str) -> Step:
        """A step by its number or its pass's name."""
        if key.isdigit() and int(key) < len(self.steps):
            return self.steps[int(key)]
        for s in self.steps:
            if s.name == key:
                return s
        raise NotFound(f"no step {key!r}: steps are 0-{len(self.steps) - 1} "
                       f"({', '.join(s.name for s in self.steps)})")

    def index(self, step: Step) -> GraphIndex:
        gi = self._index.get(step.index)
        if gi is None:
            gi = self._index[step.index] = GraphIndex(step.graph)
        return gi

    def node(self, step: Step, name: str) -> Node:
        node = self.index(step).by_name.get(name.removeprefix("%"))
        if node is None:
            raise NotFound(f"no node %{name.removeprefix('%')} in step {step.index} ({step.name})")
        return node

    def _once(self, key: Any, make: Callable[[], Any], cache: dict) -> Any:
        """``cache[key]``, made by one thread while others asking for it wait."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in cache:
                cache[key] = make()
            return cache[key]

    # --- what the API returns ----------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        g = self.steps[-1].graph
        t = host_target()
        return {"model": self.model.name, "path": self.options.model_path, "mode": self.options.mode,
                "graph": g.name, "n_layers": self.index(self.steps[-1]).n_layers, "cpu": t.cpu,
                "vector_width": self.options.native.vector_width or t.vector_width,
                "ctx": g.meta.get("ctx"), "kv_type": g.meta.get("kv_type"), "profile": self.profile_report is not None,
                "llvm_mca": find_mca(), "steps": len(self.steps)}

    def passes(self) -> list[dict[str, Any]]:
        return [{"index": s.index, "name": s.name, "doc": s.doc, "nodes": len(s.graph.nodes),
                 "ms": round(s.seconds * 1e3, 3), "summary": self.diff(s)["summary"]} for s in self.steps]

    def diff(self, step: Step) -> dict[str, Any]:
        prev = self.steps[step.index - 1].graph if step.index else None
        return self._once(("diff", step.index), lambda: step_diff(prev, step.graph, step.name), self._diff)

    def step_json(self, step: Step) -> dict[str, Any]:
        gi = self.index(step)
        return {"index": step.index, "name": step.name, "doc": step.doc, "graph": step.graph.name,
                "n_layers": gi.n_layers, "nodes": [gi.summary(n) for n in step.graph.nodes],
                "overview_peers": gi.overview_peers(), "diff": self.diff(step),
                "last": step.index == len(self.steps) - 1}

    def node_json(self, step: Step, name: str) -> dict[str, Any]:
        node = self.node(step, name)
        out = self.index(step).describe(node)
        out["in_diff"] = self._in_diff(step, node.output.name)
        sched = self.plan_report.get("_schedule")
        if sched is not None:
            segs = sorted({s for v in node.inputs if v.kind == "weight"
                           for s in [sched.segment_of(v.name)] if s is not None})
            out["stream_segments"] = [sched.segments[s].name for s in segs]
        return out

    def _in_diff(self, step: Step, name: str) -> dict[str, Any] | None:
        """How this step's pass changed the node: fused, changed or added (None: not at all)."""
        d = self.diff(step)
        for kind in ("fused", "changed", "added"):
            for e in d[kind]:
                if e["name"] == name:
                    return {"kind": kind, **e}
        return None

    def kernel(self, step: Step, name: str) -> dict[str, Any]:
        sig = KernelSig.of(self.node(step, name))
        return self._once(sig, lambda: kernel_code(sig, vector_width=self.options.native.vector_width),
                          self._kernels)

    def svg(self, step: Step, view: str, layer: int | None) -> bytes:
        gi = self.index(step)
        if view not in VIEWS:
            raise NotFound(f"no view {view!r} (one of {', '.join(VIEWS)})")
        if view == "layer":
            if layer is None or not 0 <= layer < gi.n_layers:
                raise NotFound(f"no layer {layer}: {self.model.name} has {gi.n_layers} layers (0-{gi.n_layers - 1})")
        else:
            layer = None
        where = f"layer {layer}" if view == "layer" else "overview" if view == "overview" else "all layers"
        title = f"{step.graph.name}: {where}, step {step.index} " + (
            "(as the frontend built it)" if step.index == 0 else f"(after {step.name})")
        return self._once((step.index, view, layer),
                          lambda: ir_render.render(to_dot(step.graph, view, layer, title=title), "svg"), self._svg)

    def plan(self) -> dict[str, Any]:
        r = self.plan_report
        out: dict[str, Any] = {"text": plan_report.format_text(r), "arena_svg": plan_report.format_svg(r),
                               "report": {k: v for k, v in r.items() if not k.startswith("_")}, "stream": None}
        sched = r.get("_schedule")
        if sched is not None:
            last = self.steps[-1].graph
            readers: dict[int, list[str]] = {}
            for n in last.nodes:
                for s in {sched.segment_of(v.name) for v in n.inputs if v.kind == "weight"} - {None}:
                    readers.setdefault(s, []).append(n.output.name)
            out["stream"] = {"io": sched.io, "buffer_bytes": sched.buffer_bytes, "buffer": fmt_size(sched.buffer_bytes),
                             "read_bytes_per_step": sched.read_bytes(),
                             "segments": [{"index": i, "name": s.name, "bytes": s.nbytes, "size": fmt_size(s.nbytes),
                                           "buffer": i % 2, "reads": len(s.ranges), "weights": list(s.weights),
                                           "nodes": readers.get(i, [])}
                                          for i, s in enumerate(sched.segments)]}
        return out

    def profile(self) -> dict[str, Any]:
        """The measured section of this mode: per node of the last step, and the slowest."""
        if self.profile_report is None:
            raise NotFound("no profile: start lmc viz with --profile to time every node")
        rep = self.profile_report
        sec = rep[self.options.mode]
        last = self.steps[-1]
        names = self.index(last).by_name
        nodes = {n["name"].removeprefix("%"): {k: n[k] for k in ("index", "op", "layer", "us", "share", "gb_s",
                                                                    "gflop_s", "bytes_read")}
                 for n in sec["nodes"]}
        matched = sum(1 for k in nodes if k in names)
        note = None
        if matched < len(nodes) or len(nodes) != len(names):
            note = (f"the profiled graph has {len(nodes)} nodes, {matched} of them in this view's last step "
                    f"({len(names)} nodes): it was compiled without the memory plan's changes")
        top = sorted(sec["nodes"], key=lambda n: -n["us"])[:25]
        return {"model": rep["model"], "threads": rep["threads"], "cpu": rep["cpu"], "entry": sec["entry"],
                "steps": sec["steps"], "measured_us": sec["measured_us"], "kernels_us": sec["kernels_us"],
                "overhead_us": sec["overhead_us"], "step": last.index, "nodes": nodes, "note": note,
                "kinds": sec["kinds"], "top": [{**n, "name": n["name"].removeprefix("%")} for n in top]}


def build_session(model: LoadedModel, options: VizOptions, progress: Callable[[str], None] = lambda s: None
                  ) -> Session:
    """Plan the model's memory, record every pass's graph under that plan
    (its KV cache, context and head split), and profile it if asked."""
    o = options.native
    progress("planning memory")
    plan = plan_report.memory_report(model, o)
    split = {name: plan["head_rows"] for name in plan.get("stream_head") or []}
    copts = CompileOptions(backend="llvm", ctx=plan["ctx"], kv_type=plan["kv_type"],
                           repack_width=repack_width(o.vector_width))
    progress(f"running the passes on the {options.mode} graph")
    steps = record_steps(model, options.mode, copts, split or None)
    profile = None
    if options.profile:
        from .. import profile_report

        progress("profiling (a profiling build, one prefill and 32 decode steps)")
        profile = profile_report.profile_model(options.model_path, options.tokenizer, threads=options.threads,
                                               ctx=plan["ctx"], use_cache=o.use_cache)
    return Session(model, options, steps, plan, profile)

