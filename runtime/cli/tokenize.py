"""``lmc tokenize``: print the token ids of a text as JSON."""
from __future__ import annotations

import argparse
import json

from .common import model_args


def add_parser(sub) -> None:
    t = sub.add_parser("tokenize", help="print the token ids of a text as JSON")
    model_args(t)
    t.add_argument("text")
    t.add_argument("--no-bos", action="store_true", help="do not prepend BOS")


def run(args: argparse.Namespace) -> int:
    from compiler.driver import load_model

    m = load_model(args.model, args.tokenizer)
    print(json.dumps(m.tokenizer.encode(args.text, bos=not args.no_bos)))
    return 0
