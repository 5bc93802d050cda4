"""``lmc run``: generate text from a prompt."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..api import load
from ..status import StatusLine
from .common import (constraint_args, constraint_flag, constraint_of, exec_args, finish_compiling, grammar_kept,
                     kv_type_arg, memory_args, model_args, positive_or_zero, resolve_model, sampling_args, sampling_of,
                     speculation_args, speculation_of)


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="generate text from a prompt")
    model_args(r, optional=True)
    r.add_argument("-p", "--prompt", default="", help="prompt text")
    r.add_argument("-n", "--max-new-tokens", type=positive_or_zero("-n"), default=256,
                   help="new tokens to generate at most (default 256)")
    sampling_args(r, temp=1.0, top_p=0.9, top_k=0, min_p=0.0)   # run.c's defaults
    r.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    kv_type_arg(r)
    memory_args(r)
    exec_args(r)
    r.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop when the text contains STR (not printed); repeatable")
    r.add_argument("--special", action="store_true",
                   help="recognise control tokens written in the prompt (<|im_start|> becomes one token)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    speculation_args(r)
    constraint_args(r)


def run(args: argparse.Namespace) -> int:
    status = StatusLine()
    try:
        return _run(args, status)
    finally:
        status.clear()


def _finished(model, status: StatusLine, code: int) -> int:
    finish_compiling(model, status)
    return code


def _run(args: argparse.Namespace, status: StatusLine) -> int:
    model_path, tok_path = resolve_model(args)
    spec = speculation_of(args)
    grammar = constraint_of(args)
    model = load(model_path, tok_path, backend=args.backend, ctx=args.ctx, threads=args.threads,
                 use_cache=not args.no_cache, kv_type=args.kv_type, mem_budget=args.mem_budget,
                 stream=args.stream, stream_io=args.stream_io, status=status, speculation=spec, decode_first=True)
    prompt_ids = model.encode(args.prompt, bos=True, special=args.special)
    text = model.complete(prompt_ids, args.max_new_tokens, stream=True, stop=args.stop, reuse_cache=False,
                          grammar=grammar, **sampling_of(args))
    comp = text.completion
    tok = model.tokenizer
    if args.json:
        with grammar_kept(constraint_flag(args), lambda: len(comp.generated_ids)):
            generated = "".join(text)
        print(json.dumps({
            "model": os.path.basename(model_path),
            "prompt": args.prompt,
            "prompt_ids": prompt_ids,
            "generated_ids": comp.generated_ids,
            "text": tok.decode(prompt_ids) + generated,
            "stop_reason": comp.stop_reason,
            "stats": {**model.last_stats.as_dict(), **model.compile_info, "backend": model.backend,
                      "threads": getattr(model.executor, "threads", 1), "kv_type": model.kv_type,
                      "kv_bytes": model.kv_bytes},
        }))
        return _finished(model, status, 0)
    write = sys.stdout.write
    first = True
    with grammar_kept(constraint_flag(args), lambda: len(comp.generated_ids), lambda: write("\n")):
        for piece in text:
            if first:   # the status line goes when the first token is there
                status.clear()
                write(args.prompt)  # the prompt as typed (not every vocabulary starts with BOS)
                first = False
            write(piece)
            sys.stdout.flush()
    status.clear()
    if first:
        write(args.prompt)
    write("\n")
    st = model.last_stats.as_dict()
    if sys.stderr.isatty():
        spec = (f", {st['accepted']} of {st['drafted']} drafted tokens accepted" if st.get("speculative")
                else "")
        sys.stderr.write(f"[{st['prompt_tokens']} prompt tokens, {st['generated_tokens']} generated, "
                         f"{st['decode_tok_s']} tok/s decode{spec}, stopped: {comp.stop_reason}]\n")
    return _finished(model, status, 0)
