"""``lmc ir``: print or draw a model's IR graph (pictures: ``runtime.tools.ir_render``; ``--stats``:
``runtime.tools.graph_stats``)."""
from __future__ import annotations

import argparse
import sys

from frontends.output_file import write_atomic
from ir.types import DEFAULT_KV_TYPE

from ..errors import RunError
from .common import CliError, kv_type_arg, model_args


def _layer_arg(s: str) -> int | str:
    if s == "all":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer takes a layer number or 'all', not {s!r}") from None


def add_parser(sub) -> None:
    i = sub.add_parser("ir", help="print or draw a model's IR graph")
    model_args(i)
    i.add_argument("--format", choices=["text", "dot", "svg", "png"], default="text",
                   help="text: the stable one-line-a-node form; dot: Graphviz text; svg/png: the picture "
                        "(needs Graphviz's dot program)")
    i.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    i.add_argument("--backend", choices=["llvm", "interp"], default="llvm",
                   help="whose pass pipeline to run (default llvm: what the compiler runs)")
    i.add_argument("--after", default=None, metavar="PASS",
                   help="show the graph after this pass of the pipeline (default: after all of them)")
    i.add_argument("--no-passes", action="store_true", help="show the graph as the frontend built it")
    view = i.add_mutually_exclusive_group()
    view.add_argument("--overview", action="store_true",
                      help="pictures: one block drawn once, 'x N layers', with embedding and head (default)")
    view.add_argument("--layer", type=_layer_arg, default=None, metavar="N|all",
                      help="pictures: block N in full, with stubs for its inputs and outputs; all: every layer")
    i.add_argument("-c", "--ctx", type=int, default=None,
                   help="KV cache length drawn (default: the model's, at most 4096, as compile)")
    kv_type_arg(i)
    i.add_argument("-o", "--output", default=None, help="write to this file (required for png)")
    i.add_argument("--stats", action="store_true",
                   help="instead of the graph: kernel calls and barriers per step, ops by kind, arena size")


def run(args: argparse.Namespace) -> int:
    """The graph as text, DOT, SVG or PNG, after any pass of the pipeline.
    Everything is produced in memory first: an error writes nothing."""
    from compiler.driver import CompileOptions, load_model, model_graph, repack_width
    from compiler.pipeline import default_pipeline
    from ir.dot import to_dot
    from ir.printer import print_graph

    from ..loading import DEFAULT_CTX
    from ..tools import ir_render
    from ..tools.graph_stats import graph_stats

    if args.stats and (args.format != "text" or args.layer is not None or args.overview):
        raise CliError("--stats prints a text summary: it takes no --format, --layer or --overview")
    if args.format == "png" and not args.output:
        raise CliError("--format png writes binary data: give -o FILE")
    if args.format == "text" and (args.layer is not None or args.overview):
        raise CliError("--layer and --overview choose what a picture shows (--format dot, svg or png); "
                       "--format text prints the whole graph")
    names = default_pipeline(args.backend)
    if args.after is not None:
        if args.no_passes:
            raise CliError("give --after PASS or --no-passes, not both")
        if args.after not in names:
            raise CliError(f"--after {args.after}: not a pass of the {args.backend} pipeline "
                           f"(its passes: {', '.join(names) or 'none'})")
    m = load_model(args.model, args.tokenizer)
    if args.ctx is not None and not 0 < args.ctx <= m.config.seq_len:
        raise RunError(f"--ctx {args.ctx}: must be between 1 and the model's context {m.config.seq_len}")
    n = m.config.n_layers
    if isinstance(args.layer, int) and not 0 <= args.layer < n:
        raise CliError(f"--layer {args.layer}: {m.name} has {n} layers (0-{n - 1})")
    opts = CompileOptions(backend=args.backend, ctx=args.ctx or min(m.config.seq_len, DEFAULT_CTX),
                          kv_type=args.kv_type or DEFAULT_KV_TYPE,
                          repack_width=repack_width() if args.backend == "llvm" else None)
    g = model_graph(m, args.mode, opts, stop_after=args.after, run_passes=not args.no_passes)
    ran = () if args.no_passes else names[:names.index(args.after) + 1] if args.after else names
    stage = f"after {', '.join(ran)} ({args.backend} pipeline)" if ran else "as the frontend built it, no passes"
    if args.stats:
        data = graph_stats(g, f"{g.name}, {stage}").encode()
    elif args.format == "text":
        data = print_graph(g).encode()
    else:
        if isinstance(args.layer, int):
            view, where = "layer", f"layer {args.layer} of {n}"
        else:
            view, where = ("all", "all layers") if args.layer == "all" else ("overview", "overview")
        dot = to_dot(g, view, args.layer if view == "layer" else None, title=f"{g.name}: {where}, {stage}")
        data = dot.encode() if args.format == "dot" else ir_render.render(dot, args.format)
    if args.output:
        write_atomic(args.output, data)
    else:
        sys.stdout.write(data.decode())
    return 0
