"""``lmc convert``: a llama2.c or GGUF model (or a QSF one) -> a QSF file.

Weights are read through their own layouts (dequantized to float32 one
tensor at a time), quantized to QSF block types by a policy, and written
layer by layer (``frontends/qsf_writer.py``); the model's config and
tokenizer go into the same file.

Policies (``--qtype``):

- ``q8``, ``q4``, ``q2``, ``ternary``: every matrix of a layer in that type;
  the token embedding in the same type, but never below 4 bits (with a tied
  head it is also the output projection, which 2-bit ruins);
- ``mixed`` (the seed's policy): attention and FFN up/gate in 4 bits, FFN
  down in 8 bits (it is the most sensitive matrix of a block), embeddings
  in 4 bits. With ``--calibration TEXT`` the bits are instead chosen per
  tensor: the text is run through the float model once (the IR
  interpreter) to measure each matrix's input activations, each
  candidate type's error is weighed by them (the expected relative error
  of the matrix's output, ``E|dW x|^2 / E|W x|^2``), and a greedy search
  spends the same number of bytes as the fixed mixed policy where it
  lowers that error most. The per-layer sums fill the index's importance
  scores.

Norms and biases are always stored as F16; a matrix whose rows are not a
multiple of 64 values (QSF blocks) falls back to F16 and is reported.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ir.quant import get_layout

from .arch import ModelConfig, ModelError, RopeScaling, expected_shapes
from .loader import LoadedModel, load_model
from .qsf_format import (FLAG_EMBED_SCALE, FLAG_POST_NORMS, FLAG_QK_NORM, FLAG_QKV_BIAS, FLAG_TIED, QSF_NORMS,
                         QSF_POSITIONS, Header)
from .qsf_writer import QSFLayer, QSFTensor, QSFWriter

QTYPES = {"q8": "QSF_Q8", "q4": "QSF_Q4", "q2": "QSF_Q2", "ternary": "QSF_TERNARY", "mixed": "mixed"}
BLOCK = 64
#: candidate types of the calibrated search, cheapest first
CANDIDATES = ("QSF_Q2", "QSF_Q4", "QSF_Q8")


@dataclass
class ConvertReport:
    output: str
    source_format: str
    qtype: str
    compression: str
    tensors: dict[str, str] = field(default_factory=dict)        # name -> stored type
    fallbacks: list[str] = field(default_factory=list)             # matrices stored F16 (rows not / 64)
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)   # calibration: name -> type -> error
    importance: list[float] = field(default_factory=list)
    source_bytes: int = 0
    output_bytes: int = 0
    stored_layer_bytes: int = 0
    layer_bytes: int = 0


def _kind(name: str) -> str:
    """attn_q, ffn_down, token_embd, output, norm, bias ..."""
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    if base.endswith(".bias"):
        return "bias"
    if base.endswith("norm"):
        return "norm"
    return base


def _fixed_policy(qtype: str, name: str, shape: tuple[int, ...]) -> str:
    kind = _kind(name)
    if len(shape) == 1 or kind in ("norm", "bias"):
        return "F16"
    if qtype == "mixed":
        if kind in ("token_embd", "output"):
            return "QSF_Q4"
        return "QSF_Q8" if kind == "ffn_down" else "QSF_Q4"
    t = QTYPES[qtype]
    if kind in ("token_embd", "output") and t in ("QSF_Q2", "QSF_TERNARY"):
        return "QSF_Q4"
    return t


def _store():
    from ir.interp import WeightStore

    from .qsf_codecs import read_region

    return WeightStore(unpack=read_region)


def read_f32(model: LoadedModel, name: str, store=None) -> np.ndarray:
    """A source tensor as float32, through its own layout's dequantizer."""
    w = model.weights[name]
    shape = tuple(int(d) for d in w.type.shape)
    raw = (store or _store()).raw(w.ref)
    return get_layout(w.type.layout or "F32").dequantize(raw, shape).astype(np.float32, copy=False)


def quantize(values: np.ndarray, layout: str) -> np.ndarray:
    if layout == "F16":
        return values.astype(np.float16)
    if layout == "F32":
        return values.astype(np.float32)
    return get_layout(layout).quantize(values.reshape(-1, values.shape[-1]))


#: values per work item when a matrix is converted in row chunks
_CHUNK = 1 << 20


def encode_tensor(model: LoadedModel, name: str, layout: str, store=None, pool=None) -> tuple[tuple[int, ...], bytes]:
    """A source tensor stored as ``layout``: converted in chunks of rows
    (dequantize, quantize), so a large embedding never exists whole in
    float32, and the chunks run on ``pool``'s threads (numpy releases the
    GIL in its loops)."""
    w = model.weights[name]
    shape = tuple(int(d) for d in w.type.shape)
    src = get_layout(w.type.layout or "F32")
    raw = (store or _store()).raw(w.ref)
    if len(shape) != 2:
        return shape, quantize(src.dequantize(raw, shape), layout).tobytes()
    rows, cols = shape
    step = max(1, _CHUNK // cols)

    def part(r0: int) -> bytes:
        v = src.dequantize_rows(raw, shape, np.arange(r0, min(rows, r0 + step))).astype(np.float32, copy=False)
        return quantize(v, layout).tobytes()

    starts = range(0, rows, step)
    parts = list(pool.map(part, starts)) if pool is not None else [part(r) for r in starts]
    return shape, b"".join(parts)


def _header(cfg: ModelConfig, qtype: str, pad_id: int) -> Header:
    s = cfg.spec
    flags = ((FLAG_TIED if cfg.tied_output else 0) | (FLAG_QKV_BIAS if s.qkv_bias else 0)
             | (FLAG_QK_NORM if s.qk_norm else 0) | (FLAG_POST_NORMS if s.post_norms else 0)
             | (FLAG_EMBED_SCALE if s.embed_scale else 0))
    window = int(cfg.extra.get("sliding_window", 0) or 0)   # Gemma's local layers, or every layer (Mistral)
    return Header(
        version=1, arch=cfg.arch, qtype=qtype, activation=s.ffn_act, norm=QSF_NORMS[s.norm],
        position=QSF_POSITIONS[s.rope_style], flags=flags,
        n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        vocab_size=cfg.vocab_size, context=cfg.seq_len, ffn_dim=cfg.hidden_dim, head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
        rope_local_theta=float(cfg.extra.get("rope_local_theta", 0.0)) if window else 0.0,
        sliding_window=window, swa_every=s.swa_every, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=pad_id,
        index_offset=0, embedding_offset=0, final_offset=0, tokenizer_offset=0, file_size=0,
        rope_dims=cfg.rope_dims if cfg.rope_dims != cfg.head_dim else 0,
        attn_softcap=float(cfg.extra.get("attn_softcap", 0.0)), final_softcap=float(cfg.extra.get("final_softcap", 0.0)))


def tokenizer_blob(model: LoadedModel) -> tuple[str, bytes, int]:
    """(kind, bytes, pad id) of the source's tokenizer, to carry inside the file."""
    from .gguf_cache import meta_to_bytes
    from .llama2c_tokenizer import Llama2cTokenizer

    tok = model.tokenizer
    if isinstance(tok, Llama2cTokenizer):
        with open(tok.path, "rb") as f:
            return "llama2c", f.read(), -1
    if model.format == "qsf":
        from .qsf import open_qsf
        from .qsf_format import unpack_tokenizer

        qf = open_qsf(model.path)
        sec = qf.section("tokenizer")
        with open(model.path, "rb") as f:
            f.seek(sec.offset)
            kind, blob = unpack_tokenizer(f.read(sec.stored))
        return kind, blob, qf.header.pad_id
    from .gguf import read_gguf

    meta = read_gguf(model.path).meta
    keep = {k: v for k, v in meta.items() if k.startswith("tokenizer.") or k in ("general.name",
                                                                                 "general.architecture")}
    pad = meta.get("tokenizer.ggml.padding_token_id", -1)
    return "gguf-metadata", meta_to_bytes(keep), int(pad)


def _group_names(cfg: ModelConfig, weights: dict) -> tuple[list[str], list[list[str]], list[str]]:
    order = [n for n in expected_shapes(cfg) if n in weights]
    emb = [n for n in ("token_embd", "position_embd") if n in weights]
    layers = [[n for n in order if n.startswith(f"blk.{i}.")] for i in range(cfg.n_layers)]
    final = [n for n in ("output_norm", "output_norm.bias", "output", "output.bias") if n in weights]
    return emb, layers, final


def plan_types(model: LoadedModel, qtype: str, sensitivity: dict[str, dict[str, float]] | None = None,
               ) -> tuple[dict[str, str], list[str]]:
    """Stored type of every tensor, and the matrices that fall back to F16."""
    types, fallbacks = {}, []
    for name, w in model.weights.items():
        shape = tuple(int(d) for d in w.type.shape)
        t = _fixed_policy(qtype, name, shape)
        if t.startswith("QSF_") and shape[-1] % BLOCK:
            t = "F16"
            fallbacks.append(name)
        types[name] = t
    if sensitivity:
        types.update(_allocate_bits(model, types, sensitivity))
    return types, fallbacks


def _allocate_bits(model: LoadedModel, fixed: dict[str, str], sens: dict[str, dict[str, float]]) -> dict[str, str]:
    """Greedy: every calibrated matrix starts at the cheapest type; upgrades
    go where they lower the (size-weighted) relative error most per byte,
    until the bytes of the fixed policy are spent."""
    def nbytes(name: str, t: str) -> int:
        return get_layout(t).nbytes(model.weights[name].type.shape)

    names = sorted(sens)
    budget = sum(nbytes(n, fixed[n]) for n in names)
    choice = {n: 0 for n in names}
    used = sum(nbytes(n, CANDIDATES[0]) for n in names)
    while True:
        best, best_gain = None, 0.0
        for n in names:
            c = choice[n]
            if c + 1 >= len(CANDIDATES):
                continue
            a, b = CANDIDATES[c], CANDIDATES[c + 1]
            cost = nbytes(n, b) - nbytes(n, a)
            if used + cost > budget:
                continue
            numel = math.prod(model.weights[n].type.shape)
            gain = (sens[n][a] - sens[n][b]) * numel / cost
            if gain > best_gain:
                best, best_gain = n, gain
        if best is None:
            break
        used += nbytes(best, CANDIDATES[choice[best] + 1]) - nbytes(best, CANDIDATES[choice[best]])
        choice[best] += 1
    return {n: CANDIDATES[c] for n, c in choice.items()}


def calibrate(model: LoadedModel, text: str, max_tokens: int = 256,
              progress: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """Per matrix and candidate type: the expected relative output error
    ``sum_j E[x_j^2] |dW_:j|^2 / sum_j E[x_j^2] |W_:j|^2`` with the input
    activations x measured on ``text`` (the float model in the interpreter)."""
    from ir import interp
    from ir.ops import get_op

    from .arch import build_graph

    ids = model.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ModelError("calibration text: fewer than 2 tokens")
    g = build_graph(model.config, model.weights, "prefill", ctx=len(ids), all_logits=True)
    weights = _store()
    state = interp.new_state(g)
    env = {id(v): a for v, a in ((v, np.asarray(ids, np.int32)) for v in g.inputs if v.name == "tokens")}
    env.update({id(v): np.asarray(0, np.int32) for v in g.inputs if v.name == "pos"})
    env.update({id(v): state[n] for n, v in g.states.items()})
    env.update({id(v): weights.get(v) for v in g.weights.values()})
    sq: dict[str, np.ndarray] = {}
    for node in g.nodes:
        out = get_op(node.op).ref(*[env[id(v)] for v in node.inputs], **node.attrs)
        env[id(node.output)] = out
        if node.op == "matmul":
            w = node.inputs[1]
            src = w.producer.inputs[0] if w.producer is not None else w
            x = np.asarray(env[id(node.inputs[0])], np.float64).reshape(-1, w.type.shape[-1])
            sq[src.name] = sq.get(src.name, 0) + (x * x).mean(axis=0)
    out: dict[str, dict[str, float]] = {}
    names = [n for n in sq if n.startswith("blk.") and model.weights[n].type.shape[-1] % BLOCK == 0]
    for i, name in enumerate(names):
        if progress:
            progress(f"calibrating {name} ({i + 1}/{len(names)})")
        W = read_f32(model, name, weights).astype(np.float64)
        e = sq[name]
        ref = float(((W * W) * e).sum()) or 1.0
        out[name] = {}
        for t in CANDIDATES:
            Q = get_layout(t).dequantize(quantize(W.astype(np.float32), t), W.shape).astype(np.float64)
            out[name][t] = float((((Q - W) ** 2) * e).sum() / ref)
    return out


def convert(src: str, output: str, qtype: str = "q8", tokenizer: str | None = None, compression: str = "none",
            calibration: str | None = None, level: int | None = None,
            progress: Callable[..., object] | None = None, always_compress: bool = False,
            jobs: int | None = None) -> ConvertReport:
    """Convert ``src`` to a QSF file at ``output``. ``progress(total, desc)``
    returns an object with ``update(n)`` and ``close()`` (tqdm's interface).
    ``jobs``: threads quantizing tensors (the CLI passes the cores it may use)."""
    if qtype not in QTYPES:
        raise ModelError(f"--qtype {qtype}: one of {', '.join(QTYPES)}")
    if os.path.abspath(src) == os.path.abspath(output):
        raise ModelError(f"{output}: the output would overwrite the input")
    model = load_model(src, tokenizer)
    if model.config.rope_scaling != RopeScaling() or "rope_freqs" in model.weights:
        # the v1 header has no field for it: converting would silently drop it
        raise ModelError(f"{src}: the model scales its RoPE ({model.config.rope_scaling.kind}"
                         f"{', rope_freqs' if 'rope_freqs' in model.weights else ''}), which QSF version 1 "
                         f"cannot record; lmc convert refuses rather than write a different model")
    sens = None
    if calibration is not None:
        if qtype != "mixed":
            raise ModelError("--calibration chooses bit widths: it needs --qtype mixed")
        try:
            with open(calibration, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelError(f"{calibration}: cannot read the calibration text ({e})") from None
        sens = calibrate(model, text)
    types, fallbacks = plan_types(model, qtype, sens)
    report = ConvertReport(output, model.format, qtype, compression, types, fallbacks, sens or {},
                           source_bytes=os.path.getsize(src))
    cfg = model.config
    kind, blob, pad = tokenizer_blob(model)
    emb, layers, final = _group_names(cfg, model.weights)
    if sens:
        per_layer = [sum(sens[n][types[n]] for n in names if n in sens) for names in layers]
        top = max(per_layer) or 1.0
        report.importance = [v / top for v in per_layer]
    else:
        report.importance = [0.0] * cfg.n_layers
    header_qtype = QTYPES[qtype] if qtype != "mixed" else "mixed"

    store = _store()

    def tensors(names: list[str], strip: str = "") -> list[QSFTensor]:
        out = []
        for n in names:
            shape, data = encode_tensor(model, n, types[n], store, pool)
            out.append(QSFTensor(n[len(strip):], types[n], shape, data))
        return out

    bar = progress(cfg.n_layers + 2, "converting") if progress else None
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool, \
            QSFWriter(output, _header(cfg, header_qtype, pad), compression, level, always_compress) as w:
        w.embedding(tensors(emb))
        bar and bar.update(1)
        for i, names in enumerate(layers):
            ts = tensors(names, f"blk.{i}.")
            mats = [t.qtype for t in ts if len(t.shape) > 1]
            main = mats[0] if mats and all(m == mats[0] for m in mats) else "mixed"
            e = w.layer(QSFLayer(ts, main, report.importance[i]))
            report.stored_layer_bytes += e.stored
            report.layer_bytes += e.size
            bar and bar.update(1)
        w.final(tensors(final))
        w.tokenizer(kind, blob)
        bar and bar.update(1)
    bar and bar.close()
    report.output_bytes = os.path.getsize(output)
    return report
