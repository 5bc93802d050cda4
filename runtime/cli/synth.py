"""``lmc synth``: write a model with random weights and a real model's shapes
(the work is ``frontends.synth``)."""
from __future__ import annotations

import argparse
import json
import os

from frontends.output_file import check_output

from ..errors import RunError


def add_parser(sub) -> None:
    from frontends.gguf_writer import K_FALLBACK, QTYPES

    y = sub.add_parser("synth", help="write a model with random weights and a real model's shapes")
    y.add_argument("--shape", required=True, choices=["stories15M", "stories42M", "stories110M", "llama2-7b"])
    y.add_argument("--format", choices=["llama2c", "gguf"], default="llama2c")
    y.add_argument("--qtype", choices=QTYPES, default=None,
                   help="GGUF quant type of the matrices (default Q8_0; rows a type cannot hold fall back as "
                        "llama.cpp's quantizer does: " + ", ".join(f"{a} to {b}" for a, b in K_FALLBACK.items()) + ")")
    y.add_argument("--version", type=int, choices=[0, 1, 2], default=0,
                   help="llama2.c checkpoint version (2 = Q8_0)")
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("-o", "--output", required=True)
    y.add_argument("--tokenizer", default=None,
                   help="where to write a matching synthetic tokenizer (default: tok{VOCAB}.bin beside the "
                        "model, unless one is there)")


def run(args: argparse.Namespace) -> int:
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
    vocab = SHAPES[args.shape].vocab_size
    tok = args.tokenizer or os.path.join(os.path.dirname(os.path.abspath(args.output)), f"tok{vocab}.bin")
    wrote_tok = bool(args.tokenizer) or not os.path.exists(tok)
    if wrote_tok:   # both files or neither: the tokenizer's place is checked before the model is written
        check_output(tok)
    synth_llama2c(args.shape, args.output, seed=args.seed, version=args.version)
    if wrote_tok:
        try:
            write_synth_tokenizer(tok, vocab)
        except BaseException:
            os.remove(args.output)
            raise
    print(json.dumps({"model": args.output, "bytes": os.path.getsize(args.output), "shape": args.shape,
                      "version": args.version, "tokenizer": tok, "tokenizer_written": wrote_tok}))
    return 0
