"""The ``lmc`` command line: one module per command.

It lives in ``runtime`` because its main commands run models, and the
compiler must not depend on the runtime (see the dependency rule in
DESIGN.md). Every command module has ``add_parser(sub)``, which adds its
sub-command, and ``run(args) -> int``, its exit status; the shared argument
helpers are in ``common``. Every user error ends as one line on stderr and
exit code 2.

The command modules are attributes of this package once imported
(``compile``, ``inspect``, ``ir``, ``profile``, ``run``, ``tokenize`` ...),
so this module uses none of those names for anything else.
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

from compiler.artifact import ArtifactError
from frontends.arch import ModelError
from frontends.llama2c_tokenizer import TokenizerError
from ir.switches import check_switches
from ir.verify import VerifyError

from ..errors import RunError
from .common import CliError, Parser

#: Errors that are the user's input, not our bug: one line, exit 2.
USER_ERRORS = (ModelError, TokenizerError, RunError, VerifyError, ArtifactError, OSError)

from ..models import BUNDLED_MODEL as DEFAULT_MODEL, BUNDLED_TOKENIZER as DEFAULT_TOKENIZER  # noqa: E402

#: the sub-commands in the order ``lmc --help`` lists them; each is a module of this package
COMMAND_NAMES = ("run", "chat", "serve", "loadtest", "compile", "synth", "bench", "perplexity", "inspect",
                 "convert", "kernel", "tokenize", "ir", "viz", "plan", "profile")


def _command(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(only: str | None = None):
    """The parser of every command, or of ``only`` that one (importing every
    command module, the server's among them, costs a warm start ~60 ms)."""
    p = Parser(prog="lmc", description="Compile transformer models to CPU code and run them.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for name in COMMAND_NAMES if only is None else (only,):
        _command(name).add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(args_in[0] if args_in and args_in[0] in COMMAND_NAMES else None)
    try:
        args = parser.parse_args(argv)
        check_switches()
        return _command(args.cmd).run(args)
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
