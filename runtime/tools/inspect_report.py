"""What is inside a model file (``lmc inspect``): the report.

One function per format builds a plain JSON-able dict; one renderer prints
any such dict. The schema is shared with QSF (``frontends.qsf.inspect_qsf``),
so a new format only writes its builder:

    {"format", "path", "size",                         # always present
     "header":   {field: value},                       # in file order
     "config":   {...},                                # the ModelConfig lmc derives
     "sections": [{"name", "offset", "size"}],         # byte ranges, in file order
     "layers":   [{"index", "offset", "stored", "decompressed", "qtype",
                   "compression", "tensors", "crc", "crc_ok", "importance"}],
     "tensors":  [{"name", "type", "shape", "offset", "nbytes", "layer"}],
     "summary":  {"types": {type: {"count", "bytes"}}, "total_weight_bytes",
                  "bits_per_weight"},
     "checks":   [{"what", "ok", "detail"}]}

Every key but format/path/size is optional. Shapes are row-major (numpy
order, outermost first), as lmc's IR prints them; GGUF files list their
dimensions the other way round.

Problems a report can describe (a size that does not match its type, an
unsupported quant type, a config lmc cannot derive) become failed checks.
A file too short for what its header promises is a one-line error, since
there is then no trustworthy layout to report.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from typing import Any, Callable

import numpy as np

from frontends.arch import ModelError

QSF_MAGIC = b"QSF1"
_LAYER = re.compile(r"^blk\.(\d+)\.")


# --- shared pieces -------------------------------------------------------------

def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _tensor_rows(records: list[tuple[str, str, tuple[int, ...], int, int]]) -> list[dict]:
    return [{"name": n, "type": q, "shape": list(s), "offset": o, "nbytes": b, "layer": _layer_of(n)}
            for n, q, s, o, b in records]


def _layers(tensors: list[dict]) -> list[dict]:
    """Per-layer totals, for formats that do not store layers as units."""
    by: dict[int, list[dict]] = {}
    for t in tensors:
        if t["layer"] is not None:
            by.setdefault(t["layer"], []).append(t)
    return [{"index": i, "stored": sum(t["nbytes"] for t in ts), "qtype": "+".join(sorted({t["type"] for t in ts})),
             "tensors": len(ts)} for i, ts in sorted(by.items())]


def summary(tensors: list[dict]) -> dict:
    types: dict[str, dict] = {}
    params = 0
    for t in tensors:
        d = types.setdefault(t["type"], {"count": 0, "bytes": 0, "parameters": 0})
        n = math.prod(t["shape"])
        d["count"] += 1
        d["bytes"] += t["nbytes"]
        d["parameters"] += n
        params += n
    total = sum(d["bytes"] for d in types.values())
    return {"types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])), "total_weight_bytes": total,
            "parameters": params, "bits_per_weight": round(8 * total / params, 4) if params else None}


def _check(what: str, bad: list[str], ok_detail: str) -> dict:
    """A check from a list of offenders: the first few are named."""
    if not bad:
        return {"what": what, "ok": True, "detail": ok_detail}
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    return {"what": what, "ok": False, "detail": "; ".join(bad[:3]) + more}


def _layout_checks(tensors: list[dict], size: int) -> list[dict]:
    """Bounds and overlap: what must hold before anything maps the tensors."""
    outside = [f"{t['name']} {t['offset']}..{t['offset'] + t['nbytes']}" for t in tensors
               if t["offset"] < 0 or t["offset"] + t["nbytes"] > size]
    ordered = sorted(tensors, key=lambda t: t["offset"])
    overlaps = [f"{a['name']} ends at {a['offset'] + a['nbytes']}, {b['name']} starts at {b['offset']}"
                for a, b in zip(ordered, ordered[1:]) if a["offset"] + a["nbytes"] > b["offset"]]
    return [_check("every tensor lies inside the file", outside, f"{len(tensors)} tensors within {size} bytes"),
            _check("tensors do not overlap", overlaps, "no two tensors share a byte")]


def _lmc_layout_check(tensors: list[dict], shape_of: Callable[[dict], tuple[int, ...]]) -> dict:
    """Each tensor's stored size against what lmc's layout of its type needs."""
    from ir.quant import get_layout

    bad = []
    for t in tensors:
        try:
            need = get_layout(t["type"]).nbytes(shape_of(t))
        except KeyError:
            bad.append(f"{t['name']}: type {t['type']} is not supported by lmc")
            continue
        except ValueError as e:
            bad.append(f"{t['name']}: {e}")
            continue
        if need != t["nbytes"]:
            bad.append(f"{t['name']}: {t['nbytes']} bytes stored, {t['type']} {tuple(t['shape'])} needs {need}")
    return _check("tensor sizes match their types (lmc's layouts)", bad,
                  f"{len(tensors)} tensors; types: {', '.join(sorted({t['type'] for t in tensors}))}")


def _finite_check(path: str, tensors: list[dict]) -> dict:
    """--verify without checksums in the file: float tensors hold no NaN or Inf."""
    kinds = {"F32": "<f4", "F16": "<f2"}
    mm = np.memmap(path, np.uint8, "r")
    bad, n, nbytes = [], 0, 0
    for t in tensors:
        dt = kinds.get(t["type"])
        if dt is None or t["offset"] + t["nbytes"] > len(mm):
            continue
        v = np.frombuffer(mm, dt, t["nbytes"] // np.dtype(dt).itemsize, t["offset"])
        n, nbytes = n + 1, nbytes + t["nbytes"]
        if not np.isfinite(v).all():
            bad.append(f"{t['name']}: {int((~np.isfinite(v)).sum())} values are NaN or Inf")
    del mm
    return _check("float tensors are finite (--verify)", bad,
                  f"{n} F32/F16 tensors, {nbytes} bytes read; quantized blocks are not checked "
                  "(the file has no checksums)")


def _config(loader: Callable[[], Any]) -> tuple[dict | None, dict]:
    """The ModelConfig lmc derives, and a check saying whether it could."""
    try:
        m = loader()
    except ModelError as e:
        return None, {"what": "lmc can load the model", "ok": False, "detail": str(e)}
    cfg = dataclasses.asdict(m.config)
    cfg["stop_ids"] = list(cfg["stop_ids"])
    return cfg, {"what": "lmc can load the model", "ok": True,
                 "detail": f"{m.config.arch}, {m.config.n_layers} layers, vocabulary {m.config.vocab_size}"}


# --- GGUF ------------------------------------------------------------------------

def _meta_value(v: Any) -> Any:
    """A metadata value for the report: arrays as their length, long text as its length."""
    from frontends.string_table import StringArray

    if isinstance(v, StringArray) or (isinstance(v, list) and v and isinstance(v[0], bytes)):
        return f"[{len(v)} strings]"
    if isinstance(v, np.ndarray):
        return f"[{v.size} x {v.dtype.name}]"
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str) and (len(v) > 120 or "\n" in v):
        return f"<text, {len(v)} characters>"
    if isinstance(v, float) and np.isfinite(v) and float(np.float32(v)) == v:
        return float(f"{v:.7g}")  # a float32 in the file: its shortest form
    if isinstance(v, np.generic):
        return v.item()
    return v


def inspect_gguf(path: str, verify: bool = False) -> dict:
    from frontends.gguf import read_gguf
    from frontends.gguf_parse import gguf_layout
    from frontends.loader import load_model

    size = os.path.getsize(path)
    try:
        contents = read_gguf(path)
    except ModelError as e:
        walk = gguf_layout(path)  # raises its own clearer message when the header is cut
        raise ModelError(walk.truncation(path, size) or str(e)) from None   # (read_gguf's says why)
    walk = gguf_layout(path)
    meta = contents.meta
    header: dict[str, Any] = {"magic": walk.magic.decode("latin-1"), "version": walk.version,
                              "tensor_count": walk.n_tensors, "metadata_kv_count": walk.n_kv,
                              "alignment": walk.alignment}
    header.update((k, _meta_value(v)) for k, v in meta.items() if not k.startswith("GGUF."))

    tensors = _tensor_rows([(t.name, t.qtype, tuple(reversed(t.shape)), t.offset, t.nbytes)
                            for t in contents.tensors])
    data_end = max((t["offset"] + t["nbytes"] for t in tensors), default=walk.data_start)
    sections = [{"name": "header + metadata", "offset": 0, "size": walk.kv_end},
                {"name": "tensor infos", "offset": walk.kv_end, "size": walk.infos_end - walk.kv_end},
                {"name": "padding", "offset": walk.infos_end, "size": walk.data_start - walk.infos_end},
                {"name": "tensor data", "offset": walk.data_start, "size": data_end - walk.data_start}]
    if data_end < size:
        sections.append({"name": "trailing bytes", "offset": data_end, "size": size - data_end})

    config, loads = _config(lambda: load_model(path))
    al = walk.alignment
    checks = _layout_checks(tensors, size)
    checks.append(_check(f"tensor data aligned to {al} bytes",
                         [f"{t['name']} at {t['offset']}" for t in tensors
                          if (t["offset"] - walk.data_start) % al], f"{len(tensors)} tensors"))
    checks.append(_check("tensor count matches the header",
                         [] if len(tensors) == walk.n_tensors else
                         [f"header says {walk.n_tensors}, {len(tensors)} read"], f"{len(tensors)}"))
    checks.append(_lmc_layout_check(tensors, lambda t: tuple(t["shape"])))
    checks.append(loads)
    if verify:
        checks.append(_finite_check(path, tensors))
    report = {"format": "gguf", "path": path, "size": size, "header": header}
    if config is not None:
        report["config"] = config
    report.update(sections=sections, layers=_layers(tensors), tensors=tensors, summary=summary(tensors),
                  checks=checks)
    return report


# --- llama2.c --------------------------------------------------------------------

def inspect_llama2c(path: str, tokenizer: str | None = None, verify: bool = False) -> dict:
    """The loader maps out the tensors (and refuses a truncated file); the
    header is decoded again here to show its fields exactly as stored."""
    from frontends.llama2c import MAGIC, V1_HEADER, load_llama2c

    ck = load_llama2c(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(V1_HEADER)
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    header: dict[str, Any] = {}
    if ck.version == 0:
        header.update(zip(names, struct.unpack_from("<7i", head, 0)))
        header["shared_classifier"] = header["vocab_size"] > 0  # negative: a classifier follows the weights
        header_size = 28
    else:
        header["magic"] = f"0x{MAGIC:08X} ('ak42')"
        header["version"] = ck.version
        header.update(zip(names, struct.unpack_from("<7i", head, 8)))
        header["shared_classifier"] = bool(head[36])
        if ck.version == 2:
            header["group_size"] = ck.group_size
        header_size = V1_HEADER

    tensors = _tensor_rows(sorted(((name, w.type.layout, tuple(w.type.shape), w.ref.offset, w.ref.nbytes)
                                   for name, w in ck.weights.items()), key=lambda r: r[3]))
    # v0 keeps run.c's precomputed RoPE tables (unused) after output_norm
    rope = ck.config.seq_len * (ck.config.head_dim // 2) * 2 * 4 if ck.version == 0 else 0
    sections = [{"name": "header", "offset": 0, "size": header_size}]
    at = header_size
    for t in tensors + [{"offset": size, "nbytes": 0}]:
        if t["offset"] > at:
            gap = t["offset"] - at
            name = "freq_cis_real + freq_cis_imag (unused)" if gap == rope else "unreferenced bytes"
            sections.append({"name": name, "offset": at, "size": gap})
        if "name" in t:
            sections.append({"name": t["name"], "offset": t["offset"], "size": t["nbytes"]})
        at = max(at, t["offset"] + t["nbytes"])

    expect = header_size + sum(t["nbytes"] for t in tensors) + rope
    checks = _layout_checks(tensors, size)
    checks.append(_check("header, tensors" + (" and RoPE tables" if rope else "") + " account for every byte",
                         [] if expect == size else [f"{expect} bytes expected, the file has {size}"],
                         f"{expect} = {size} bytes"))
    checks.append(_lmc_layout_check(tensors, lambda t: tuple(t["shape"])))
    config = dataclasses.asdict(ck.config)
    config["stop_ids"] = list(config["stop_ids"])
    report: dict[str, Any] = {"format": f"llama2c-v{ck.version}", "path": path, "size": size, "header": header,
                              "config": config}
    tok = _llama2c_tokenizer(path, tokenizer, ck.config.vocab_size)
    if tok is not None:
        report["tokenizer"], check = tok
        checks.append(check)
    if verify:
        checks.append(_finite_check(path, tensors))
    report.update(sections=sections, layers=_layers(tensors), tensors=tensors, summary=summary(tensors),
                  checks=checks)
    return report


def _llama2c_tokenizer(path: str, tokenizer: str | None, vocab: int) -> tuple[dict, dict] | None:
    """The tokenizer given with -z, or found beside the model as ``lmc run``
    would find it; None when there is neither (the model file alone is fine)."""
    from frontends.llama2c_tokenizer import Llama2cTokenizer, TokenizerError
    from frontends.loader import find_llama2c_tokenizer

    if tokenizer is None:
        try:
            tokenizer = find_llama2c_tokenizer(path, vocab)
        except ModelError:
            return None
    what = "the tokenizer fits the model's vocabulary"
    try:
        tok = Llama2cTokenizer.from_file(tokenizer, vocab)
    except (TokenizerError, OSError) as e:
        return {"path": tokenizer}, {"what": what, "ok": False, "detail": str(e)}
    return ({"path": tokenizer, "vocab_size": tok.vocab_size},
            {"what": what, "ok": tok.vocab_size == vocab, "detail": f"{tokenizer}: {tok.vocab_size} tokens"})


# --- dispatch --------------------------------------------------------------------

def inspect_file(path: str | os.PathLike, tokenizer: str | None = None, verify: bool = False) -> dict:
    """The report of any model file lmc knows, by its magic bytes."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ModelError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic in (b"GGUF", QSF_MAGIC) and tokenizer is not None:
        raise ModelError(f"{path}: the file carries its own vocabulary; -z is for llama2.c checkpoints")
    if magic == QSF_MAGIC:
        from frontends.qsf import inspect_qsf

        r = inspect_qsf(path, verify)
        r["summary"] = summary(r["tensors"])
        return r
    if magic == b"GGUF":
        return inspect_gguf(path, verify)
    return inspect_llama2c(path, tokenizer, verify)
