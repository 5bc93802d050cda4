"""``lmc loadtest URL``: N streaming clients against an OpenAI-compatible
server, one JSON object out (the load generator: ``runtime.tools.loadtest``).

Exit status: 0 when at least one request completed, 1 when none did (all
failed, or the time ran out first); 2 for a bad command line or a server
that cannot be reached at all (one line on stderr).
"""
from __future__ import annotations

import argparse
import json

from ..tools.loadtest import DEFAULT_PROMPT_WORDS, ServerUnreachable, run_load_test
from .common import CliError, number_in, server_url, whole_number


#: --timeout and --temperature
_seconds = number_in("--timeout", lambda v: 0 < v < 1e7, "a positive number of seconds", "seconds")
_temperature = number_in("--temperature", lambda v: 0 <= v <= 100, "between 0 and 100")


def add_parser(sub) -> None:
    p = sub.add_parser("loadtest", help="load an OpenAI-compatible server with streaming clients; JSON report",
                       description="N streaming clients send M requests in all to an OpenAI-compatible server "
                                   "(lmc serve, llama.cpp's server ...) and one JSON object reports time to first "
                                   "token, inter-token latency and throughput. Exit 0 if at least one request "
                                   "completed, 1 if none did.")
    p.add_argument("url", type=server_url, help="the server, e.g. http://127.0.0.1:8080 (a trailing /v1 is fine)")
    p.add_argument("--clients", type=whole_number("--clients", 1), default=4, metavar="N",
                   help="concurrent clients, each streaming one request after another (default 4)")
    p.add_argument("--requests", type=whole_number("--requests", 1), default=None, metavar="M",
                   help="requests in all (default: one per client)")
    p.add_argument("--max-tokens", type=whole_number("--max-tokens", 1), default=64, metavar="K",
                   help="max_tokens of every request (default 64)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=None, metavar="TEXT", help="the same prompt text for every request")
    g.add_argument("--prompt-tokens", type=whole_number("--prompt-tokens", 1), default=None, metavar="P",
                   help=f"a synthetic prompt of about P words, different per request so that no prefix cache "
                        f"skips prefill (the default, {DEFAULT_PROMPT_WORDS} words)")
    e = p.add_mutually_exclusive_group()
    e.add_argument("--chat", dest="endpoint", action="store_const", const="chat", default="chat",
                   help="POST /v1/chat/completions, the prompt as one user message (default)")
    e.add_argument("--completions", dest="endpoint", action="store_const", const="completions",
                   help="POST /v1/completions with the prompt as is")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="the model field (default: the first id of GET /v1/models)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="sent as Authorization: Bearer KEY")
    p.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                   help="sampling temperature (default 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate max_tokens for every request whatever comes (the "
                        "ignore_eos field of llama.cpp, vLLM and lmc serve): equal work per request, for "
                        "throughput comparisons")
    p.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                   help="bound on the whole run in seconds; what is unfinished then is cancelled (default 600)")


def run(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise CliError("lmc loadtest needs httpx (pip install httpx)") from None
    try:
        report = run_load_test(args.url, args.clients, args.requests, args.max_tokens, prompt=args.prompt,
                               prompt_tokens=args.prompt_tokens, endpoint=args.endpoint, model=args.model,
                               api_key=args.api_key, temperature=args.temperature, timeout=args.timeout,
                               ignore_eos=args.ignore_eos)
    except ServerUnreachable as e:
        raise CliError(str(e)) from None
    print(json.dumps(report, indent=1))
    return 0 if report["completed"] else 1
