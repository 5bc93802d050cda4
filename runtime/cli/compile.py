"""``lmc compile``: compile a model to a native artifact."""
from __future__ import annotations

import argparse
import json
import os

from ..errors import RunError
from .common import CliError, kv_type_arg, memory_args, model_args, native_options, thread_count


def add_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile a model to a native artifact")
    model_args(c)
    c.add_argument("-o", "--output", required=True, help="artifact file to write")
    kv_type_arg(c)
    memory_args(c)
    c.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    c.add_argument("-t", "--threads", type=thread_count, default=None,
                   help="threads its runs will use (a budget's plan counts scratch per thread; default: the cores)")
    c.add_argument("--dump-after", default=None, metavar="PASS|all",
                   help="write the text IR after this pass (and before it, to diff) or after every pass (all)")
    c.add_argument("--dump-dir", default=None, metavar="DIR",
                   help="where --dump-after writes, one folder per graph (default: OUTPUT.ir); alone, dumps all")


def run(args: argparse.Namespace) -> int:
    from compiler.driver import load_model
    from compiler.native import compile_native

    dump_dir = _dump_dir(args)
    m = load_model(args.model, args.tokenizer)
    if args.ctx is not None and not 0 < args.ctx <= m.config.seq_len:
        raise RunError(f"--ctx {args.ctx}: must be between 1 and the model's context {m.config.seq_len}")
    from ..loading import DEFAULT_CTX

    o = native_options(args, m, DEFAULT_CTX)
    from ..key_offsets import attach
    from ..loading import BuildOptions, f32_executor

    attach(m, o.kv_type, None, f32_executor(m, BuildOptions(threads=o.threads)))
    o.dump_dir, o.dump_after = dump_dir, (args.dump_after or "all") if dump_dir else None
    res = compile_native(m, o)
    res.artifact.write(args.output)
    from compiler.codegen.k_sampler import prepare

    prepare()   # what sampling compiles on first use, so the artifact's runs start no LLVM
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
