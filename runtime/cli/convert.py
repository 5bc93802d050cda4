"""``lmc convert INPUT OUTPUT.qsf``: write a model as QSF (``frontends/convert.py``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from compiler.host_cores import usable_cores
from frontends.convert import QTYPES, convert
from frontends.qsf_codecs import CODECS


def add_parser(sub) -> None:
    c = sub.add_parser("convert", help="convert a llama2.c or GGUF model to QSF (quantized streaming format)")
    c.add_argument("input", help="model file (.bin, .gguf, .qsf)")
    c.add_argument("output", help="the .qsf file to write")
    c.add_argument("-z", "--tokenizer", default=None, help="tokenizer file (llama2.c tokenizer.bin)")
    c.add_argument("--qtype", choices=list(QTYPES), default="q8",
                   help="q8, q4, q2 (asymmetric 2-bit), ternary, or mixed (attention and FFN up/gate 4-bit, "
                        "FFN down 8-bit; per tensor from measurements with --calibration)")
    c.add_argument("--compress", choices=list(CODECS), default="none",
                   help="per-layer compression: none (default), lz4 or zstd; kept only where it makes a layer smaller")
    c.add_argument("--level", type=int, default=None, help="compression level (lz4: 1-12 selects HC; zstd: 1-22)")
    c.add_argument("--calibration", default=None, metavar="TEXTFILE",
                   help="text to measure sensitivities on (--qtype mixed): chooses bit widths per tensor and "
                        "fills the layers' importance scores")
    c.add_argument("--json", action="store_true", help="print a JSON report")


class _Bar:
    """tqdm on a terminal, nothing when piped."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="section", file=sys.stderr, leave=False)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    if args.output.endswith(os.sep) or os.path.isdir(args.output):
        raise ValueError(f"{args.output}: is a directory; give the .qsf file to write")
    if args.level is not None and args.compress == "none":
        raise ValueError("--level: needs --compress lz4 or zstd")
    span = {"lz4": (0, 12), "zstd": (1, 22)}.get(args.compress)   # lz4: 0 is its fast mode, 1-12 HC
    if args.level is not None and span is not None and not span[0] <= args.level <= span[1]:
        raise ValueError(f"--level {args.level}: {args.compress} takes {span[0]} to {span[1]}")
    t0 = time.perf_counter()
    r = convert(args.input, args.output, args.qtype, args.tokenizer, args.compress, args.calibration, args.level,
                progress=_Bar, jobs=usable_cores())
    secs = time.perf_counter() - t0
    types: dict[str, int] = {}
    for t in r.tensors.values():
        types[t] = types.get(t, 0) + 1
    out = {"output": r.output, "source_format": r.source_format, "qtype": r.qtype, "compression": r.compression,
           "source_bytes": r.source_bytes, "output_bytes": r.output_bytes,
           "layer_bytes": r.layer_bytes, "stored_layer_bytes": r.stored_layer_bytes,
           "tensor_types": types, "f16_fallbacks": r.fallbacks, "seconds": round(secs, 2)}
    if r.sensitivity:
        out["importance"] = [round(v, 4) for v in r.importance]
        out["chosen"] = {n: r.tensors[n] for n in sorted(r.sensitivity)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"wrote {r.output}: {r.output_bytes:,} bytes from {r.source_bytes:,} ({r.source_format}), "
          f"{r.qtype}, {secs:.1f} s")
    print("tensors: " + ", ".join(f"{n} {t}" for t, n in sorted(types.items())))
    if r.compression != "none":
        print(f"layers: {r.stored_layer_bytes:,} bytes stored of {r.layer_bytes:,} "
              f"({r.compression}, ratio {r.layer_bytes / max(r.stored_layer_bytes, 1):.3f})")
    if r.fallbacks:
        print(f"stored as F16 (rows not a multiple of 64): {', '.join(r.fallbacks)}")
    if r.sensitivity:
        print("importance per layer: " + " ".join(f"{v:.2f}" for v in r.importance))
    return 0
