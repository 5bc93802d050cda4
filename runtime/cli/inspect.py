"""``lmc inspect``: what is inside a model file, as text or JSON (the report:
``runtime.tools.inspect_report``). Exit status 1 when a check fails."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable

import numpy as np

from ..tools.inspect_report import inspect_file
from .common import CliError


# --- text ------------------------------------------------------------------------

def human_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError


def _table(headers: list[str], rows: list[list[Any]], right: set[int]) -> list[str]:
    cells = [[str(c) for c in r] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(r: list[str]) -> str:
        return "  " + "  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i]) for i, c in enumerate(r)).rstrip()

    return [line(headers)] + [line(r) for r in cells]


def _short(v: Any) -> str:
    """A float32 value read as float64 (1e-5 as 9.99999974e-06) in its shortest form."""
    if isinstance(v, float) and math.isfinite(v) and float(np.float32(v)) == v:
        return f"{v:.7g}"
    return str(v)


def _pairs(d: dict) -> list[str]:
    w = max((len(str(k)) for k in d), default=0)
    return [f"  {str(k).rjust(w)}: {_short(v)}" for k, v in d.items()]


#: layer table columns, in order: (key, heading, formatter)
_LAYER_COLS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("index", "layer", str), ("offset", "offset", str), ("stored", "stored", human_size),
    ("decompressed", "decompressed", human_size), ("ratio", "ratio", lambda r: f"{r:.3f}"),
    ("qtype", "qtype", str), ("compression", "compression", str),
    ("tensors", "tensors", lambda t: str(len(t)) if isinstance(t, (list, tuple, dict)) else str(t)),
    ("crc", "crc32", lambda c: f"{c:08x}" if isinstance(c, int) else str(c)),
    ("crc_ok", "crc ok", lambda ok: "-" if ok is None else "OK" if ok else "BAD"),
    ("importance", "importance", lambda v: f"{v:.4g}" if isinstance(v, float) else str(v))]


def render_text(r: dict, show_tensors: bool = False) -> str:
    """Any report of the schema above as readable text."""
    out = [f"{r['path']}: {r['format']}, {human_size(r['size'])} ({r['size']:,} bytes)"]
    if r.get("header"):
        out += ["", "header"] + _pairs(r["header"])
    if r.get("config"):
        cfg = {k: v for k, v in r["config"].items() if v not in ({}, None)}
        out += ["", "config (as lmc derives it)"] + _pairs(cfg)
    if r.get("tokenizer"):
        out += ["", "tokenizer"] + _pairs(r["tokenizer"])
    if r.get("sections"):
        rows = [[s["name"], s["offset"], s["offset"] + s["size"], human_size(s["size"]), f"{s['size']:,}"]
                for s in r["sections"]]
        out += ["", "sections"] + _table(["name", "offset", "end", "size", "bytes"], rows, {1, 2, 3, 4})
    if r.get("layers"):
        layers = [dict(l) for l in r["layers"]]
        for l in layers:
            if l.get("stored") and l.get("decompressed"):
                l["ratio"] = l["stored"] / l["decompressed"]
        cols = [c for c in _LAYER_COLS if any(l.get(c[0]) is not None for l in layers)]
        rows = [[fmt(l[k]) if l.get(k) is not None else "-" for k, _, fmt in cols] for l in layers]
        right = {i for i, (k, _, _) in enumerate(cols) if k not in ("qtype", "compression", "crc_ok")}
        out += ["", "layers"] + _table([h for _, h, _ in cols], rows, right)
    s = r.get("summary")
    if s and s.get("types"):
        total = s.get("total_weight_bytes") or 0
        rows = [[t, d["count"], f"{d.get('parameters', ''):,}" if "parameters" in d else "-",
                 human_size(d["bytes"]), f"{d['bytes']:,}", f"{100 * d['bytes'] / total:.1f}%" if total else "-"]
                for t, d in s["types"].items()]
        out += ["", "weights by type"] + _table(["type", "tensors", "parameters", "size", "bytes", "share"], rows,
                                                {1, 2, 3, 4, 5})
        tail = [f"{human_size(total)} ({total:,} bytes) of weights"]
        if s.get("parameters"):
            tail.append(f"{s['parameters']:,} parameters")
        if s.get("bits_per_weight") is not None:
            tail.append(f"{s['bits_per_weight']:.3f} bits per weight")
        out.append("  total: " + ", ".join(tail))
    if r.get("checks"):
        out += ["", "checks"] + [f"  {'OK  ' if c['ok'] else 'FAIL'}  {c['what']}"
                                 + (f": {c['detail']}" if c.get("detail") else "") for c in r["checks"]]
    if show_tensors and r.get("tensors"):
        rows = [[t["name"], t["type"], "x".join(map(str, t["shape"])), t["offset"], f"{t['nbytes']:,}"]
                for t in r["tensors"]]
        out += ["", "tensors"] + _table(["name", "type", "shape", "offset", "bytes"], rows, {3, 4})
    elif r.get("tensors"):
        out += ["", f"{len(r['tensors'])} tensors (--tensors lists them)"]
    return "\n".join(out) + "\n"


# --- CLI -------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    """Add ``inspect`` to the ``lmc`` sub-commands."""
    p = subparsers.add_parser("inspect", help="what is inside a model file: header, sections, tensors, checks",
                              description="Report a model file's header, byte sections, layers, weight types "
                                          "and consistency checks. Exit status 1 when a check fails.")
    p.add_argument("model", metavar="FILE", help="model file (.bin, .gguf, .qsf)")
    p.add_argument("-z", "--tokenizer", default=None, help="llama2.c tokenizer to check against the model")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--verify", action="store_true",
                   help="read the weights too: layer CRCs for QSF, float tensors finite for GGUF and llama2.c")
    p.add_argument("--tensors", action="store_true", help="list every tensor in the text report")


def run(args: argparse.Namespace) -> int:
    # a tokenizer that is not there is bad input (exit 2); one that does not fit is a failed check (exit 1)
    if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
        raise CliError(f"{args.tokenizer}: no such tokenizer file (-z)")
    report = inspect_file(args.model, args.tokenizer, args.verify)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        sys.stdout.write(render_text(report, args.tensors))
    return 0 if all(c.get("ok", True) for c in report.get("checks", ())) else 1
