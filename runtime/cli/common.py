"""What several ``lmc`` commands share: the parser class, the error of a bad
command line, and the argument helpers (model and tokenizer, threads, the KV
cache type, the execution flags, and the memory flags shared by ``run``,
``compile``, ``bench`` and ``plan``)."""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Callable, Iterator

from ir.types import DEFAULT_KV_TYPE, KV_TYPES
from passes.memory_budget import BudgetError, parse_size

from ..errors import ConstraintError


class CliError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors also exit 2, one line
        raise CliError(message)


def port_number(flag: str = "--port"):
    """An argparse type: a TCP port, 0 (pick a free one) to 65535."""
    def conv(s: str) -> int:
        v = whole_number(flag)(s)
        if v > 65535:
            raise argparse.ArgumentTypeError(f"{flag} {v}: a port is 0 to 65535")
        return v

    return conv


def server_url(s: str) -> str:
    """An argparse type: an http(s) URL with a host and a valid port."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(s)
        u.port   # raises for a port that is not a number or out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"URL {s!r}: {e}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise argparse.ArgumentTypeError(f"URL {s!r}: give http://HOST[:PORT] or https://...")
    return s


def number_in(flag: str, ok: Callable[[float], bool], want: str, unit: str = "a number"):
    """An argparse type: a float for which ``ok`` holds (NaN never does);
    else "{flag} must be {want}, got ..."."""
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {unit}, not {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{flag} must be {want}, got {s}")
        return v

    return conv


def whole_number(flag: str, minimum: int = 0):
    """An argparse type: a whole number >= ``minimum`` and not absurdly large."""
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, not {s!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum}, got {v}")
        if v > 10_000_000:
            raise argparse.ArgumentTypeError(f"{flag} {v} is absurdly large")
        return v

    return conv


def positive_or_zero(flag: str):
    return whole_number(flag, 0)


def model_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:
        p.add_argument("model", nargs="?", default=None,
                       help="model file (.bin, .gguf) or compiled artifact; default: Gemma 3 270M with the demo "
                            "extra installed, else the bundled stories260K")
    else:
        p.add_argument("model", help="model file (.bin)")
    p.add_argument("-z", "--tokenizer", default=None, help="tokenizer file (llama2.c tokenizer.bin)")


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mem-budget", type=size_arg, default=None, metavar="SIZE",
                   help="peak resident memory for the whole process (200M, 1.5G ...): weights that do not fit "
                        "stream from disk, the KV cache shrinks to fit")
    p.add_argument("--stream", choices=["layers", "all"], default=None,
                   help="stream at least the layers (or the layers and the output head) from disk, "
                        "whether or not they would fit")
    p.add_argument("--stream-io", choices=["pread", "mmap"], default="pread",
                   help="how streamed weights come in: pread copies each layer into one of two buffers "
                        "(default); mmap maps its pages in place and unmaps them after use (no copy)")


def thread_count(s: str) -> int:
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
                   help="KV cache storage: f16 (default), f32 (twice the memory), q8 (blocks of 32 int8 with "
                        "an f16 scale, 34/64 of f16; needs head_dim a multiple of 32), q4 / q2 (groups of 32 "
                        "codes of 4 / 2 bits with an f16 step and minimum, each head rotated by a Walsh-Hadamard "
                        "transform first; needs head_dim a power of two >= 32) or q4-plain / q2-plain (the same "
                        "without the rotation)")


def exec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["llvm", "interp"], default="llvm",
                   help="llvm: compiled native code (default); interp: the numpy reference interpreter")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="threads (default: the cores this process may use: its affinity mask and CPU quota)")
    p.add_argument("--no-cache", action="store_true", help="do not use the compile cache")


def resolve_model(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.model is None:
        from ..models import default_model

        model, tok = default_model()
        return model, args.tokenizer or tok
    return args.model, args.tokenizer


def native_options(args: argparse.Namespace, m, default_ctx: int):
    """NativeOptions from the flags of ``compile`` and ``plan``."""
    from compiler.native import NativeOptions

    o = NativeOptions(ctx=args.ctx or min(m.config.seq_len, default_ctx), kv_type=args.kv_type or DEFAULT_KV_TYPE,
                      mem_budget=args.mem_budget, stream=args.stream, threads=getattr(args, "threads", None),
                      stream_io=args.stream_io)
    o.auto_ctx = args.ctx is None and args.mem_budget is not None
    o.auto_kv = args.kv_type is None and args.mem_budget is not None
    return o


def context_shift_args(p: argparse.ArgumentParser, keep_default: str) -> None:
    """``--context-shift`` and ``--keep N`` (``runtime.context_shift``), as llama.cpp's."""
    p.add_argument("--context-shift", action="store_true",
                   help="go on past the context: keep the first --keep tokens, drop the oldest half of the rest "
                        "and recompute the kept ones at their new positions (default: off, a reply ends at the "
                        "end of the context)")
    p.add_argument("--keep", type=whole_number("--keep", 0), default=None, metavar="N",
                   help=f"with --context-shift: tokens at the start that every shift keeps (default: {keep_default})")


def check_context_shift(args: argparse.Namespace) -> None:
    """--keep is a setting of --context-shift (it must be smaller than the
    context, which the model checks once it knows it)."""
    if args.keep is not None and not args.context_shift:
        raise CliError("--keep goes with --context-shift")
    if args.keep is not None and args.ctx is not None and args.keep >= args.ctx - 1:
        raise CliError(f"--keep {args.keep}: must be smaller than the context -c {args.ctx} minus 1")


def sampling_args(p: argparse.ArgumentParser, temp: float, top_p: float, top_k: int, min_p: float) -> None:
    """The sampler's flags, with the command's defaults."""
    p.add_argument("--temp", type=float, default=temp, help=f"temperature; 0 = greedy (default {temp:g})")
    p.add_argument("--top-p", type=float, default=top_p, help=f"nucleus sampling threshold (default {top_p:g})")
    p.add_argument("--top-k", type=int, default=top_k, help=f"keep the k most likely tokens (0 = off; default {top_k})")
    p.add_argument("--min-p", type=float, default=min_p,
                   help=f"drop tokens below min-p x the top probability (default {min_p:g})")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")


def sampling_of(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, seed=args.seed)


def constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output's flags (``runtime.grammar``): at most one."""
    g = p.add_argument_group("structured output (the text follows it, enforced token by token)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", default=None, metavar="FILE", help="a JSON schema the output must satisfy")
    x.add_argument("--grammar", default=None, metavar="FILE", help="a Lark grammar (llguidance's dialect)")
    x.add_argument("--regex", default=None, metavar="RE", help="a regular expression the whole output matches")


def constraint_of(args: argparse.Namespace):
    """The constraint the flags ask for (checked now: a bad schema, grammar
    or regex is one line and exit 2), or None."""
    if args.json_schema is None and args.grammar is None and args.regex is None:
        return None   # without importing llguidance: 25 ms of every start
    from ..grammar import json_schema, lark, regex

    try:
        if args.json_schema is not None:
            c = json_schema(_read_text(args.json_schema, "--json-schema"))
        elif args.grammar is not None:
            c = lark(_read_text(args.grammar, "--grammar"))
        elif args.regex is not None:
            c = regex(args.regex)
        else:
            return None
        c.grammar()
    except ConstraintError as e:
        raise CliError(f"{constraint_flag(args)}: {e}") from None
    return c


@contextmanager
def grammar_kept(flag: str | None, generated: Callable[[], int],
                 before: Callable[[], object] = lambda: None) -> Iterator[None]:
    """A grammar its parser cannot follow further (an ambiguous grammar's
    rows grow with the output) raised within: a CliError naming ``flag``
    (the one that asked for it; None: no grammar, nothing caught) and
    the ``generated()`` tokens it let through, after ``before`` (the text
    so far ends its line)."""
    try:
        yield
    except ConstraintError as e:
        if flag is None:
            raise
        before()
        raise CliError(f"{flag}: cannot be enforced past {generated()} generated tokens ({e})") from None


def constraint_flag(args: argparse.Namespace) -> str | None:
    """The flag whose grammar the output follows (tools: a call's), or None."""
    for flag in ("json_schema", "grammar", "regex", "tools"):
        if getattr(args, flag, None) is not None:
            return "--" + flag.replace("_", "-")
    return None


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}") from None


def speculation_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (``runtime.speculative``): one drafter and its length."""
    from ..speculative import DEFAULT_DRAFT_MAX, MAX_DRAFT_MAX

    g = p.add_argument_group("speculative decoding (greedy output stays plain decoding's, token for token)")
    g.add_argument("--lookup", type=whole_number("--lookup", 1), default=None, metavar="N",
                   help="draft by prompt lookup: continue the latest earlier match of the last N tokens or fewer "
                        "in the prompt and output")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft with a smaller model of the same vocabulary (its own KV cache)")
    g.add_argument("--draft-tokenizer", default=None, metavar="FILE",
                   help="with --draft: the draft's tokenizer file (llama2.c models)")
    g.add_argument("--draft-layers", type=whole_number("--draft-layers", 1), default=None, metavar="K",
                   help="draft with the model's own first K layers, final norm and head (sharing its weights and "
                        "KV cache)")
    g.add_argument("--draft-max", type=whole_number("--draft-max", 1), default=None, metavar="N",
                   help=f"tokens drafted per step at most (default {DEFAULT_DRAFT_MAX}, at most {MAX_DRAFT_MAX}); "
                        "fewer while drafts get rejected")


def speculation_of(args: argparse.Namespace):
    """The ``Speculation`` the flags ask for, or None (plain decoding)."""
    from ..speculative import DEFAULT_DRAFT_MAX, Speculation

    chosen = [f for f, v in (("--lookup", args.lookup), ("--draft", args.draft),
                             ("--draft-layers", args.draft_layers)) if v is not None]
    if not chosen:
        for f, v in (("--draft-max", args.draft_max), ("--draft-tokenizer", args.draft_tokenizer)):
            if v is not None:
                raise CliError(f"{f} goes with a drafter: --lookup N, --draft MODEL or --draft-layers K")
        return None
    if len(chosen) > 1:
        raise CliError(f"one drafter at a time: {' and '.join(chosen)}")
    if args.draft_tokenizer is not None and args.draft is None:
        raise CliError("--draft-tokenizer goes with --draft MODEL")
    return Speculation(lookup=args.lookup or 0, draft=args.draft, draft_layers=args.draft_layers or 0,
                       draft_max=args.draft_max or DEFAULT_DRAFT_MAX, draft_tokenizer=args.draft_tokenizer)


def finish_compiling(model, status) -> None:
    """Before a command that started on its decode step exits: wait for
    the background compile, so the next run starts warm (Ctrl-C skips it)."""
    if model.compiling:
        status("compiling the prompt kernels for the next run (Ctrl-C skips)")
    model.finish_compiling()
    status.clear()
