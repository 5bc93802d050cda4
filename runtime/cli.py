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

from frontends.arch import ModelError
from frontends.llama2c_tokenizer import TokenizerError
from ir.verify import VerifyError

from .model import RunError, load

#: Errors that are the user's input, not our bug: one line, exit 2.
USER_ERRORS = (ModelError, TokenizerError, RunError, VerifyError, OSError)

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(_HERE, "default_model", "stories260K.bin")
DEFAULT_TOKENIZER = os.path.join(_HERE, "default_model", "tok512.bin")


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
                       help="model file (.bin); default: the bundled stories260K")
    else:
        p.add_argument("model", help="model file (.bin)")
    p.add_argument("-z", "--tokenizer", default=None, help="tokenizer file (llama2.c tokenizer.bin)")


def _resolve_model(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.model is None:
        return DEFAULT_MODEL, args.tokenizer or DEFAULT_TOKENIZER
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
    r.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's)")
    r.add_argument("--backend", choices=["interp"], default="interp", help="executor")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    t = sub.add_parser("tokenize", help="print the token ids of a text as JSON")
    _model_args(t)
    t.add_argument("text")
    t.add_argument("--no-bos", action="store_true", help="do not prepend BOS")

    i = sub.add_parser("ir", help="print a model's IR graph")
    _model_args(i)
    i.add_argument("--format", choices=["text", "dot"], default="text")
    i.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    i.add_argument("--after", default=None, help="show the graph after this pass (default: all passes)")
    i.add_argument("--no-passes", action="store_true", help="show the graph as the frontend built it")
    return p


def cmd_run(args: argparse.Namespace) -> int:
    model_path, tok_path = _resolve_model(args)
    model = load(model_path, tok_path, backend=args.backend, ctx=args.ctx)
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
            "stats": model.last_stats.as_dict(),
        }))
        return 0
    dec = tok.stream_decoder()
    write = sys.stdout.write
    prev = prompt_ids[0]
    for t in prompt_ids[1:]:
        write(dec.feed(prev, t))
        prev = t
    sys.stdout.flush()
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


def cmd_tokenize(args: argparse.Namespace) -> int:
    from compiler.driver import load_model

    m = load_model(args.model, args.tokenizer)
    print(json.dumps(m.tokenizer.encode(args.text, bos=not args.no_bos)))
    return 0


def cmd_ir(args: argparse.Namespace) -> int:
    from compiler.driver import load_model, model_graph
    from ir.dot import to_dot
    from ir.printer import print_graph

    m = load_model(args.model, args.tokenizer)
    g = model_graph(m, args.mode, stop_after=args.after, run_passes=not args.no_passes)
    sys.stdout.write(print_graph(g) if args.format == "text" else to_dot(g))
    return 0


COMMANDS = {"run": cmd_run, "tokenize": cmd_tokenize, "ir": cmd_ir}


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
