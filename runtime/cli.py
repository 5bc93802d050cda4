"""The ``lmc`` command line.

It lives in ``runtime`` because its main commands run models, and the
compiler must not depend on the runtime (see the dependency rule in
DESIGN.md). Every user error ends as one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from compiler.artifact import ArtifactError
from frontends.arch import ModelError
from frontends.llama2c_tokenizer import TokenizerError
from ir.types import KV_TYPES
from ir.verify import VerifyError

from .model import RunError, load

#: Errors that are the user's input, not our bug: one line, exit 2.
USER_ERRORS = (ModelError, TokenizerError, RunError, VerifyError, ArtifactError, OSError)

from .models import BUNDLED_MODEL as DEFAULT_MODEL, BUNDLED_TOKENIZER as DEFAULT_TOKENIZER  # noqa: E402


class CliError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors also exit 2, one line
        raise CliError(message)


def _positive_or_zero(flag: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, not {s!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {v}")
        if v > 10_000_000:
            raise argparse.ArgumentTypeError(f"{flag} {v} is absurdly large")
        return v

    return conv


def _model_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:
        p.add_argument("model", nargs="?", default=None,
                       help="model file (.bin, .gguf) or compiled artifact; default: Gemma 3 270M with the demo "
                            "extra installed, else the bundled stories260K")
    else:
        p.add_argument("model", help="model file (.bin)")
    p.add_argument("-z", "--tokenizer", default=None, help="tokenizer file (llama2.c tokenizer.bin)")


from .memory_args import memory_args  # noqa: E402


def _threads(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"-t/--threads takes a whole number, not {s!r}") from None
    if not 1 <= v <= 256:
        raise argparse.ArgumentTypeError(f"-t/--threads must be between 1 and 256, got {v}")
    return v


def kv_type_arg(p: argparse.ArgumentParser) -> None:
    """``--kv-type``: how the KV cache stores keys and values."""
    p.add_argument("--kv-type", choices=list(KV_TYPES), default=None,
                   help="KV cache storage: f32 (default), f16 (half the memory) or q8 (blocks of 32 int8 with "
                        "an f16 scale, 34/128 of f32; needs head_dim a multiple of 32)")


def _exec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["llvm", "interp"], default="llvm",
                   help="llvm: compiled native code (default); interp: the numpy reference interpreter")
    p.add_argument("-t", "--threads", type=_threads, default=None, help="threads (default: the number of cores)")
    p.add_argument("--no-cache", action="store_true", help="do not use the compile cache")


def _resolve_model(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.model is None:
        from .models import default_model

        model, tok = default_model()
        return model, args.tokenizer or tok
    return args.model, args.tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lmc", description="Compile transformer models to CPU code and run them.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    r = sub.add_parser("run", help="generate text from a prompt")
    _model_args(r, optional=True)
    r.add_argument("-p", "--prompt", default="", help="prompt text")
    r.add_argument("-n", "--max-new-tokens", type=_positive_or_zero("-n"), default=256,
                   help="new tokens to generate at most (default 256)")
    r.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy (default 1.0, as run.c)")
    r.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling threshold (default 0.9)")
    r.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    r.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    r.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    r.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    r.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    kv_type_arg(r)
    memory_args(r)
    _exec_args(r)
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    c = sub.add_parser("compile", help="compile a model to a native artifact")
    _model_args(c)
    c.add_argument("-o", "--output", required=True, help="artifact file to write")
    kv_type_arg(c)
    memory_args(c)
    c.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    c.add_argument("--dump-after", default=None, metavar="PASS|all",
                   help="write the text IR after this pass (and before it, to diff) or after every pass (all)")
    c.add_argument("--dump-dir", default=None, metavar="DIR",
                   help="where --dump-after writes, one folder per graph (default: OUTPUT.ir); alone, dumps all")

    y = sub.add_parser("synth", help="write a model with random weights and a real model's shapes")
    y.add_argument("--shape", required=True, choices=["stories15M", "stories42M", "stories110M", "llama2-7b"])
    y.add_argument("--format", choices=["llama2c", "gguf"], default="llama2c")
    y.add_argument("--qtype", choices=["F32", "Q8_0", "Q4_0", "Q4_K"], default=None,
                   help="GGUF quant type of the matrices (default Q8_0; Q4_K rows that are not a multiple "
                        "of 256 fall back to Q5_0, as llama.cpp does)")
    y.add_argument("--version", type=int, choices=[0, 1, 2], default=0,
                   help="llama2.c checkpoint version (2 = Q8_0)")
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("-o", "--output", required=True)
    y.add_argument("--tokenizer", default=None,
                   help="where to write a matching synthetic tokenizer (default: tok{VOCAB}.bin beside the "
                        "model, unless one is there)")

    from . import bench
    bench.add_parser(sub)

    from . import inspect_model, perplexity
    perplexity.add_parser(sub)
    inspect_model.add_parser(sub)

    from . import convert_cmd
    convert_cmd.add_parser(sub)

    from . import kernel_lab
    kn = sub.add_parser("kernel", help="compile one kernel on its own: check it, time it, try variants")
    kernel_lab.add_arguments(kn)
    kn.add_argument("-t", "--threads", type=_threads, default=None, help="threads (default: the number of cores)")

    t = sub.add_parser("tokenize", help="print the token ids of a text as JSON")
    _model_args(t)
    t.add_argument("text")
    t.add_argument("--no-bos", action="store_true", help="do not prepend BOS")

    i = sub.add_parser("ir", help="print or draw a model's IR graph")
    _model_args(i)
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

    pl = sub.add_parser("plan", help="the memory map of a model under a budget")
    _model_args(pl)
    pl.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    pl.add_argument("-t", "--threads", type=_threads, default=None, help="threads (scratch is per thread)")
    kv_type_arg(pl)
    memory_args(pl)
    pl.add_argument("--format", choices=["text", "json", "svg"], default="text",
                    help="text: categories and totals; json: everything; svg: the decode arena plan")
    pl.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")

    f = sub.add_parser("profile", help="time every kernel of a decode step and a prefill")
    _model_args(f, optional=True)
    f.add_argument("-t", "--threads", type=_threads, default=None, help="threads (default: the number of cores)")
    f.add_argument("--steps", type=_positive_or_zero("--steps"), default=32, help="decode steps timed (default 32)")
    f.add_argument("--prompt-tokens", type=_positive_or_zero("--prompt-tokens"), default=64,
                   help="random prompt length of the timed prefill (default 64)")
    f.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    f.add_argument("--format", choices=["text", "json", "svg"], default="text",
                   help="text: tables per op kind and the slowest nodes; json: everything; svg: a chart")
    f.add_argument("--top", type=_positive_or_zero("--top"), default=15, help="nodes listed in the text (default 15)")
    f.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    f.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    return p


def cmd_run(args: argparse.Namespace) -> int:
    model_path, tok_path = _resolve_model(args)
    model = load(model_path, tok_path, backend=args.backend, ctx=args.ctx, threads=args.threads,
                 use_cache=not args.no_cache, kv_type=args.kv_type, mem_budget=args.mem_budget,
                 stream=args.stream, stream_io=args.stream_io)
    prompt_ids = model.encode(args.prompt, bos=True)
    gen = model.generate(prompt_ids, args.max_new_tokens, temperature=args.temp, top_p=args.top_p,
                         top_k=args.top_k, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                         seed=args.seed)
    tok = model.tokenizer
    out_ids: list[int] = []
    if args.json:
        out_ids = list(gen)
        text_ids = prompt_ids + [t for t in out_ids if t not in model.config.stop_ids]
        print(json.dumps({
            "model": os.path.basename(model_path),
            "prompt": args.prompt,
            "prompt_ids": prompt_ids,
            "generated_ids": out_ids,
            "text": tok.decode(text_ids),
            "stats": {**model.last_stats.as_dict(), **model.compile_info, "backend": model.backend,
                      "threads": getattr(model.executor, "threads", 1), "kv_type": model.kv_type,
                      "kv_bytes": model.kv_bytes},
        }))
        return 0
    dec = tok.stream_decoder()
    write = sys.stdout.write
    write(args.prompt)  # the prompt as typed (not every vocabulary starts with BOS)
    sys.stdout.flush()
    prev = prompt_ids[-1] if prompt_ids else None
    for t in gen:
        if t in model.config.stop_ids:
            break
        write(dec.feed(prev, t))
        sys.stdout.flush()
        prev = t
    write(dec.flush() + "\n")
    st = model.last_stats.as_dict()
    if sys.stderr.isatty():
        sys.stderr.write(f"[{st['prompt_tokens']} prompt tokens, {st['generated_tokens']} generated, "
                         f"{st['decode_tok_s']} tok/s decode]\n")
    return 0


def _native_options(args: argparse.Namespace, m, default_ctx: int):
    """NativeOptions from the flags of ``compile`` and ``plan``."""
    from compiler.native import NativeOptions

    o = NativeOptions(ctx=args.ctx or min(m.config.seq_len, default_ctx), kv_type=args.kv_type or "f32",
                      mem_budget=args.mem_budget, stream=args.stream, threads=getattr(args, "threads", None),
                      stream_io=args.stream_io)
    o.auto_ctx = args.ctx is None and args.mem_budget is not None
    o.auto_kv = args.kv_type is None and args.mem_budget is not None
    return o


def cmd_plan(args: argparse.Namespace) -> int:
    from compiler.driver import load_model

    from . import plan_report
    from .model import DEFAULT_CTX

    m = load_model(args.model, args.tokenizer)
    if args.ctx is not None and not 0 < args.ctx <= m.config.seq_len:
        raise RunError(f"--ctx {args.ctx}: must be between 1 and the model's context {m.config.seq_len}")
    r = plan_report.memory_report(m, _native_options(args, m, DEFAULT_CTX))
    text = {"text": plan_report.format_text, "json": plan_report.format_json,
            "svg": plan_report.format_svg}[args.format](r)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from compiler.driver import load_model
    from compiler.native import NativeOptions, compile_native

    dump_dir = _dump_dir(args)
    m = load_model(args.model, args.tokenizer)
    if args.ctx is not None and not 0 < args.ctx <= m.config.seq_len:
        raise RunError(f"--ctx {args.ctx}: must be between 1 and the model's context {m.config.seq_len}")
    from .model import DEFAULT_CTX

    o = _native_options(args, m, DEFAULT_CTX)
    o.dump_dir, o.dump_after = dump_dir, (args.dump_after or "all") if dump_dir else None
    res = compile_native(m, o)
    res.artifact.write(args.output)
    man = res.artifact.manifest
    print(json.dumps({"artifact": args.output, "bytes": os.path.getsize(args.output),
                      "compile_s": round(res.seconds, 3), "cache_hit": res.cached,
                      "cpu": man["target"]["cpu"], "arena_bytes": man["arena_bytes"],
                      "state_bytes": man["state_bytes"], "kv_type": man["kv_type"],
                      **({"ir_dump": dump_dir} if dump_dir else {})}))
    return 0


def _dump_dir(args: argparse.Namespace) -> str | None:
    """Where ``compile --dump-after`` writes; the pass name checked against
    the llvm pipeline before any work starts."""
    if args.dump_after is None and args.dump_dir is None:
        return None
    from compiler.pipeline import default_pipeline

    names = default_pipeline("llvm")
    if args.dump_after is not None and args.dump_after != "all" and args.dump_after not in names:
        raise CliError(f"--dump-after {args.dump_after}: not a pass of the llvm pipeline "
                       f"(its passes: {', '.join(names)}; or all)")
    return args.dump_dir or args.output + ".ir"


def cmd_synth(args: argparse.Namespace) -> int:
    from frontends.synth import SHAPES, synth_llama2c, synth_tensor, write_synth_tokenizer

    if args.format == "gguf":
        from frontends.gguf_writer import write_gguf

        if args.version:
            raise RunError("--version is for --format llama2c; GGUF files take --qtype")
        cfg = SHAPES[args.shape]
        qtype = args.qtype or "Q8_0"
        write_gguf(args.output, cfg, lambda n: synth_tensor(cfg, n, args.seed), qtype, name=args.shape)
        print(json.dumps({"model": args.output, "bytes": os.path.getsize(args.output), "shape": args.shape,
                          "format": "gguf", "qtype": qtype}))
        return 0
    if args.qtype is not None:
        raise RunError("--qtype is for --format gguf; llama2.c files take --version 2 for Q8_0")
    synth_llama2c(args.shape, args.output, seed=args.seed, version=args.version)
    vocab = SHAPES[args.shape].vocab_size
    tok = args.tokenizer or os.path.join(os.path.dirname(os.path.abspath(args.output)), f"tok{vocab}.bin")
    wrote_tok = False
    if args.tokenizer or not os.path.exists(tok):
        write_synth_tokenizer(tok, vocab)
        wrote_tok = True
    print(json.dumps({"model": args.output, "bytes": os.path.getsize(args.output), "shape": args.shape,
                      "version": args.version, "tokenizer": tok, "tokenizer_written": wrote_tok}))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from compiler.driver import load_model

    m = load_model(args.model, args.tokenizer)
    print(json.dumps(m.tokenizer.encode(args.text, bos=not args.no_bos)))
    return 0


def _layer_arg(s: str) -> int | str:
    if s == "all":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer takes a layer number or 'all', not {s!r}") from None


def cmd_ir(args: argparse.Namespace) -> int:
    """The graph as text, DOT, SVG or PNG, after any pass of the pipeline.
    Everything is produced in memory first: an error writes nothing."""
    from compiler.driver import CompileOptions, load_model, model_graph
    from compiler.pipeline import default_pipeline
    from ir.dot import to_dot
    from ir.printer import print_graph

    from . import ir_render
    from .model import DEFAULT_CTX

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
                          kv_type=args.kv_type or "f32")
    g = model_graph(m, args.mode, opts, stop_after=args.after, run_passes=not args.no_passes)
    if args.format == "text":
        data = print_graph(g).encode()
    else:
        ran = () if args.no_passes else names[:names.index(args.after) + 1] if args.after else names
        stage = f"after {', '.join(ran)} ({args.backend} pipeline)" if ran else "as the frontend built it, no passes"
        if isinstance(args.layer, int):
            view, where = "layer", f"layer {args.layer} of {n}"
        else:
            view, where = ("all", "all layers") if args.layer == "all" else ("overview", "overview")
        dot = to_dot(g, view, args.layer if view == "layer" else None, title=f"{g.name}: {where}, {stage}")
        data = dot.encode() if args.format == "dot" else ir_render.render(dot, args.format)
    if args.output:
        ir_render.write_atomic(args.output, data)
    else:
        sys.stdout.write(data.decode())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from . import profile

    model_path, tok_path = _resolve_model(args)
    report = profile.profile_model(model_path, tok_path, threads=args.threads, steps=args.steps,
                                   prompt_tokens=args.prompt_tokens, ctx=args.ctx, use_cache=not args.no_cache)
    out = profile.render(report, args.format, args.top)
    if args.output:
        profile.write_atomic(args.output, out)
    else:
        sys.stdout.write(out)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.cmd_bench(args)


def cmd_kernel(args: argparse.Namespace) -> int:
    from . import kernel_lab

    return kernel_lab.cmd_kernel(args)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from . import perplexity

    return perplexity.cmd_perplexity(args)


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import inspect_model

    return inspect_model.cmd_inspect(args)


COMMANDS = {"run": cmd_run, "compile": cmd_compile, "plan": cmd_plan, "synth": cmd_synth, "bench": cmd_bench,
            "tokenize": cmd_tokenize, "ir": cmd_ir, "profile": cmd_profile, "kernel": cmd_kernel}
COMMANDS.update(perplexity=cmd_perplexity, inspect=cmd_inspect)


def cmd_convert(args: argparse.Namespace) -> int:
    from . import convert_cmd

    return convert_cmd.cmd_convert(args)


COMMANDS["convert"] = cmd_convert


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return COMMANDS[args.cmd](args)
    except CliError as e:
        print(f"lmc: error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        msg = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror}"
        print(f"lmc: error: {msg}", file=sys.stderr)
        return 2
    except ValueError as e:  # sampler flag validation and the like
        print(f"lmc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
