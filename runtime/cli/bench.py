"""``lmc bench``: compile time, prefill and decode speed, memory and the
roofline of one stream (``runtime.tools.bench``); ``--serve`` measures
serving instead: ``lmc serve`` under 1, 4, 8, 16 concurrent streams
(``runtime.tools.serve_bench``). Parsing and printing only."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from compiler.host_cores import usable_cores
from ir.types import KV_TYPES

from ..tools import cold_start, serve_bench
from ..tools.bench import compare_with, run_bench
from .common import CliError, memory_args, speculation_args, speculation_of, thread_count, whole_number

#: fields in the order the table prints them, with their labels and formats
_TABLE = [
    ("model", "model", "{}"),
    ("backend", "backend", "{}"),
    ("threads", "threads", "{}"),
    ("cpu_model", "CPU", "{}"),
    ("cpu", "CPU to LLVM", "{}"),
    ("kv_type", "KV cache", "{}"),
    ("kv_bytes", "KV cache bytes", "{:,} B"),
    ("prompt_tokens", "prompt tokens", "{}"),
    ("gen_tokens", "generated tokens", "{}"),
    ("compile_s_cold", "compile, cold", "{:.3f} s"),
    ("compile_s_warm", "compile, cached", "{:.4f} s"),
    ("cold_start_first_token_s", "lmc run from an empty cache, first token", "{:.2f} s"),
    ("warm_start_first_token_s", "lmc run again, first token", "{:.2f} s"),
    ("prefill_tok_s", "prefill", "{:.1f} tok/s"),
    ("int8_unit", "int8 unit", "{}"),
    ("int8_peak_gops", "int8 peak (probe)", "{:.0f} GOPS"),
    ("prefill_int8_gops", "prefill matmuls", "{:.0f} GOPS"),
    ("prefill_int8_fraction", "prefill / int8 peak", "{:.1%}"),
    ("decode_tok_s", "decode", "{:.1f} tok/s"),
    ("long_prompt_tokens", "long prompt", "{} tokens"),
    ("long_prefill_tok_s", "  prefill", "{:.1f} tok/s"),
    ("long_prefill_fraction", "  against the prompt's, in turns", "{:.1%}"),
    ("long_decode_tok_s", "  decode after it", "{:.1f} tok/s"),
    ("long_decode_fraction", "  against the decode after the prompt", "{:.1%}"),
    ("speculative", "speculative decoding", "{}"),
    ("plain_loop_tok_s", "plain, decode + sampling", "{:.1f} tok/s"),
    ("speculative_loop_tok_s", "speculative, same", "{:.1f} tok/s"),
    ("speculative_speedup", "speed-up", "{:.2f}x"),
    ("drafted", "drafted tokens", "{}"),
    ("accepted", "accepted", "{}"),
    ("acceptance_rate", "acceptance rate", "{:.1%}"),
    ("speculative_identical", "greedy output identical", "{}"),
    ("constrained_loop_tok_s", "decode loop under the JSON schema", "{:.1f} tok/s"),
    ("constrained_vs_plain", "  against the plain loop", "{:.2f}x"),
    ("constrained_sample_ms_per_token", "  sampling with the mask", "{:.3f} ms/token"),
    ("peak_rss_mb", "peak RSS", "{:.1f} MB"),
    ("weight_bytes_per_token", "weights read per token", "{:,} B"),
    ("read_bandwidth_gb_s", "read bandwidth", "{:.1f} GB/s"),
    ("roofline_tok_s", "roofline (bandwidth / bytes)", "{:.1f} tok/s"),
    ("roofline_fraction", "decode / roofline", "{:.1%}"),
]
#: peers measured beside us: (result key, label)
_PEERS = [("llamacpp", "llama.cpp"), ("openvino", "OpenVINO GenAI")]


def format_table(r: dict[str, Any]) -> str:
    rows = []
    spec_rows = {"speculative", "plain_loop_tok_s", "speculative_loop_tok_s", "speculative_speedup", "drafted",
                 "accepted", "acceptance_rate", "speculative_identical"}
    for key, label, fmt in _TABLE:
        v = r.get(key)
        if key in spec_rows and r.get("speculative") is None and not (key == "plain_loop_tok_s" and
                                                                        r.get("constraint")):
            continue
        if key.startswith("constrained") and r.get("constraint") is None:
            continue
        if key.startswith("long_") and r.get("long_prompt_tokens") is None:
            continue
        rows.append((label, "-" if v is None else fmt.format(v)))
        if key == "speculative_identical" and r.get("verify_cost_steps"):
            rows.append(("a decode step, beside the checks", f"{r['decode_step_ms']:.2f} ms"))
            for n, cost in r["verify_cost_steps"].items():
                rows.append((f"  a check of {n} rows", f"{cost:.2f} decode steps"))
        if key == "int8_unit" and r.get("amx") and not r["amx"]["used"]:
            rows.append(("  (AMX)", r["amx"]["why"]))
        if key.endswith("_fraction") and r.get(key + "_spread"):
            lo, hi = r[key + "_spread"]
            rows.append(("  spread over runs", f"{lo:.1%} .. {hi:.1%}"))
    for key, name in _PEERS:
        peer = r.get(key)
        if peer is None:
            continue
        if "error" in peer:
            rows.append((name, peer["error"]))
            continue
        rows.append((f"{name} prefill / decode", f"{peer['prefill_tok_s']:.1f} / {peer['decode_tok_s']:.1f} tok/s"))
        rows.append((f"  lmc / {name}", f"prefill {r['prefill_vs_' + key]:.2f}x, decode {r['decode_vs_' + key]:.2f}x"))
        if "long_prefill_tok_s" in peer:
            rows.append((f"  {name}, long prompt", f"{peer['long_prefill_tok_s']:.1f} / {peer['long_decode_tok_s']:.1f} "
                         f"tok/s ({peer['long_prefill_fraction']:.1%} / {peer['long_decode_fraction']:.1%})"))
        elif "long_error" in peer:
            rows.append((f"  {name}, long prompt", peer["long_error"]))
        if "constrained_decode_tok_s" in peer:
            rows.append((f"  {name} under the JSON schema", f"{peer['constrained_decode_tok_s']:.1f} tok/s, "
                         f"{peer['constrained_vs_plain']:.2f}x its plain loop"))
            if r.get("constrained_vs_" + key):
                rows.append((f"  lmc / {name}, both under it", f"{r['constrained_vs_' + key]:.2f}x"))
    w = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{w}}  {val}" for label, val in rows)


def stream_counts(text: str) -> list[int]:
    """argparse type of ``--streams``: ``1,4,8,16`` -> [1, 4, 8, 16] (distinct, in order)."""
    out: list[int] = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--streams takes whole numbers separated by commas, not {text!r}"
                                             ) from None
        if not 1 <= n <= 1024:
            raise argparse.ArgumentTypeError(f"--streams: {n} is not between 1 and 1024")
        if n not in out:
            out.append(n)
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``lmc`` sub-commands."""
    b = subparsers.add_parser("bench", help="measure compile time, prefill/decode speed and the roofline")
    b.add_argument("model", help="model file (.bin, .gguf)")
    b.add_argument("-z", "--tokenizer", default=None, help="tokenizer file (llama2.c tokenizer.bin)")
    b.add_argument("-t", "--threads", type=thread_count, default=None,
                   help="threads (default: the cores this process may use: its affinity mask and CPU quota)")
    b.add_argument("--prompt-tokens", type=whole_number("--prompt-tokens", 1), default=None,
                   help="random prompt length for prefill (default 128; clipped to the context); with --serve, "
                        "words of each synthetic prompt (default 64)")
    b.add_argument("--gen-tokens", type=whole_number("--gen-tokens", 1), default=None,
                   help="greedy decode steps timed (default 128); with --serve, tokens of each reply (default 64)")
    b.add_argument("--long-prompt", type=whole_number("--long-prompt", 1), default=None, metavar="N",
                   help="also generate after N random prompt tokens, in turns with the prompt: prefill and the "
                        "decode after it, each against the prompt's (medians of the pairs), peers too")
    b.add_argument("--runs", type=whole_number("--runs", 1), default=5,
                   help="repetitions; medians are reported (default 5)")
    b.add_argument("--backend", choices=["llvm", "interp"], default="llvm")
    b.add_argument("--kv-type", choices=list(KV_TYPES), default=None,
                   help="KV cache storage: f16 (default), f32, q8, q4, q2 (rotated) or q4-plain, q2-plain")
    b.add_argument("--probe-mb", type=whole_number("--probe-mb", 16), default=1024,
                   help="buffer of the bandwidth probe in MiB (default 1024; keep it >> the L3 cache)")
    b.add_argument("--compare-llamacpp", action="store_true",
                   help="also measure llama.cpp (the xllamacpp package) on the same file, same threads; with "
                        "--serve, llama.cpp's server with as many slots, after ours")
    b.add_argument("--compare-openvino", action="store_true",
                   help="also measure OpenVINO GenAI (the openvino-genai package) on the same GGUF, same threads, "
                        "where its reader takes the file (one line saying why where not)")
    b.add_argument("--serve", action="store_true",
                   help="measure serving: start lmc serve on the model and load it with 1, 4, 8, 16 concurrent "
                        "streaming clients (lmc loadtest); aggregate tok/s, time to first token, inter-token "
                        "latency; prints JSON, then a table unless --json")
    b.add_argument("--streams", type=stream_counts, default=None, metavar="N,N,...",
                   help="with --serve: the stream counts (default 1,4,8,16); each client sends two requests")
    b.add_argument("--replicas", type=whole_number("--replicas", 1), default=None, metavar="N",
                   help="with --serve: lmc serve --replicas N (engine replicas on Ray Serve, -t threads each)")
    b.add_argument("--parallel", type=whole_number("--parallel", 1), default=None, metavar="P",
                   help="with --serve: lmc serve --parallel, llama.cpp's slots (default: the largest of --streams)")
    b.add_argument("--cold-start", action="store_true",
                   help="also time lmc run from an empty compile cache to its first token and exit, then warm "
                        "(--runs rounds, each with a fresh cache)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="the prompt: this file's text (control tokens such as <|im_start|> recognised) instead of "
                        "random token ids")

    b.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also decode under this JSON schema (structured output), each run right after a plain "
                        "one: both loops' tok/s (decode and sampling) and their ratio; give a --prompt-file "
                        "that asks for the JSON")
    memory_args(b)
    speculation_args(b)
    return b


def _jsonable(r: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in r.items()}


def run(args: argparse.Namespace) -> int:
    args.threads = args.threads or usable_cores()   # here, not as the parser's default: read only when run
    if args.serve:
        return _run_serve(args)
    for flag, value in (("--streams", args.streams), ("--parallel", args.parallel), ("--replicas", args.replicas)):
        if value is not None:
            raise CliError(f"{flag} is a flag of lmc bench --serve")
    if args.cold_start and args.backend != "llvm":   # refused before the bench runs
        raise CliError("--cold-start times the native compile; not with --backend interp")
    spec = speculation_of(args)
    constraint = schema = None
    if args.json_schema is not None:
        from ..grammar import ConstraintError, json_schema

        try:
            with open(args.json_schema, encoding="utf-8") as f:
                text = f.read()
            constraint = json_schema(text)
            constraint.grammar()
            schema = json.loads(text)
        except OSError as e:
            raise CliError(f"--json-schema {args.json_schema}: {e.strerror}") from None
        except ConstraintError as e:
            raise CliError(f"--json-schema: {e}") from None
    prompt_text = None
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt_text = f.read()
        except UnicodeDecodeError as e:
            raise CliError(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start})") from None
    r = run_bench(args.model, args.tokenizer, args.threads, prompt_tokens=args.prompt_tokens or 128,
                  gen_tokens=args.gen_tokens or 128, runs=args.runs, backend=args.backend,
                  probe_bytes=args.probe_mb << 20, kv_type=args.kv_type, mem_budget=args.mem_budget,
                  stream=args.stream, stream_io=args.stream_io, speculation=spec, prompt_text=prompt_text,
                  constraint=constraint, long_prompt=args.long_prompt)
    if args.compare_llamacpp:
        compare_with(r, "llamacpp", args.model, args.threads, args.runs, prompt_text=prompt_text, json_schema=schema)
    if args.compare_openvino:
        compare_with(r, "openvino", args.model, args.threads, args.runs)
    if args.cold_start:
        r.update(cold_start.measure(args.model, args.tokenizer, args.threads, args.runs))
    if args.json:
        print(json.dumps(_jsonable(r)))
    else:
        print(format_table(r))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    """``lmc bench --serve``, from the bench's parsed flags."""
    if args.stream is not None:
        raise CliError("--stream: lmc serve keeps its weights in memory; not with --serve")
    if args.compare_openvino:
        raise CliError("--compare-openvino measures one stream; not with --serve")
    if args.cold_start:
        raise CliError("--cold-start times lmc run; not with --serve")
    if args.long_prompt is not None:
        raise CliError("--long-prompt measures one stream; not with --serve")
    extra = ["--backend", args.backend]
    if args.kv_type:
        extra += ["--kv-type", args.kv_type]
    if args.mem_budget is not None:
        extra += ["--mem-budget", str(args.mem_budget)]
    if args.replicas is not None:
        extra += ["--replicas", str(args.replicas)]
    try:
        r = serve_bench.run_serve_bench(args.model, args.tokenizer, args.threads, args.streams or list(serve_bench.DEFAULT_STREAMS),
                            parallel=args.parallel, gen_tokens=args.gen_tokens or serve_bench.DEFAULT_TOKENS,
                            prompt_tokens=args.prompt_tokens or serve_bench.DEFAULT_TOKENS,
                            compare_llamacpp=args.compare_llamacpp, serve_args=extra,
                            say=lambda s: print(f"lmc bench: {s}", file=sys.stderr, flush=True))
    except serve_bench.BenchServerError as e:
        raise CliError(str(e)) from None
    print(json.dumps(serve_bench.rounded(r)), flush=True)
    if not args.json:
        print()
        print(serve_bench.format_table(r))
    return 0
