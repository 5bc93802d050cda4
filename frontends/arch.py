"""The architecture table: one transformer graph builder driven by a config.

A model family is a row of ``ARCHITECTURES`` (what differs: FFN activation,
norm placement, biases, RoPE layout ...), never a new code path. Frontends
only translate their file's header/metadata into a ``ModelConfig`` and their
tensors into weights named as in GGUF (``blk.N.attn_q`` ...).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ir.graph import Graph, Value, WeightRef
from ir.quant import get_layout
from ir.kv_lowbit import RECENT
from ir.switches import switch
from ir.ops.attention import ring_rows
from ir.types import DEFAULT_KV_TYPE, KEY_OFFSET_KV_TYPES, KV_TYPES, TensorType, kv_cache_type


class ModelError(ValueError):
    """A model file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes a family. Defaults are llama's."""

    ffn_act: str = "silu"          # gated FFN: act(gate(h)) * up(h)
    ffn_gated: bool = True         # False: act(up(h)) with no gate (GPT-2, StarCoder2, Phi-2)
    norm: str = "rms"              # "rms" (RMSNorm) or "layer" (LayerNorm: weight and bias)
    rope_style: str = "interleaved"  # or "neox", or "learned" (absolute position embeddings, no RoPE)
    partial_rotary: bool = False   # rope.dimension_count may rotate only part of each head (Phi-2)
    qkv_bias: bool = False
    biases: bool = False           # attn_output, ffn_up, ffn_down carry biases (GPT-2, StarCoder2, Phi-2)
    fused_qkv: bool = False        # files hold attn_qkv = [q; k; v] (split on load into attn_q/k/v)
    fused_gate_up: bool = False    # files hold ffn_up = [gate; up] (Phi-3; split on load)
    parallel: bool = False         # attention and FFN both read one norm of x: x + attn + ffn (Phi-2)
    qk_norm: bool = False          # per-head RMSNorm on Q and K
    post_norms: bool = False       # RMSNorm after attention and after FFN
    embed_scale: bool = False      # embeddings times sqrt(dim)
    swa_every: int = 0             # every n-th layer global, others sliding-window
    local_rope_theta: float = 0.0  # the sliding-window layers' RoPE base (0: the model's own)
    default_window: int = 0        # the window when the file does not give one
    softcap: bool = False          # attention- and final-logit soft-capping, values from the file (Gemma 2)
    rope_freqs: bool = False       # may carry per-frequency RoPE divisors (Llama 3's rope_freqs tensor)
    scale_local_rope: bool = True  # RoPE scaling applies to sliding-window layers too


#: biased LayerNorm families with a plain GELU FFN (llama.cpp's LLM_FFN_GELU is the tanh form)
_GPT = dict(ffn_act="gelu_tanh", ffn_gated=False, norm="layer", biases=True)

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(rope_freqs=True),
    "mistral": ArchSpec(rope_freqs=True),
    "qwen2": ArchSpec(rope_style="neox", qkv_bias=True),
    "qwen3": ArchSpec(rope_style="neox", qk_norm=True),
    "phi3": ArchSpec(rope_style="neox", fused_qkv=True, fused_gate_up=True),
    "gpt2": ArchSpec(**_GPT, rope_style="learned", fused_qkv=True, qkv_bias=True),
    "starcoder2": ArchSpec(**_GPT, rope_style="neox"),
    "phi2": ArchSpec(**_GPT, rope_style="neox", partial_rotary=True, fused_qkv=True, parallel=True),
    "gemma2": ArchSpec(ffn_act="gelu_tanh", rope_style="neox", post_norms=True, embed_scale=True, swa_every=2,
                       default_window=4096, softcap=True),
    # llama.cpp scales only the global layers' RoPE (the local ones keep base 10000, no scaling)
    "gemma3": ArchSpec(ffn_act="gelu_tanh", rope_style="neox", qk_norm=True, post_norms=True, embed_scale=True,
                       swa_every=6, local_rope_theta=10000.0, default_window=512, scale_local_rope=False),
}

#: the RoPE scaling types lmc implements (GGUF ``rope.scaling.type``)
ROPE_SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How a model stretches RoPE past its training context, as llama.cpp
    applies it: ``linear`` multiplies every angle by 1/factor; ``yarn``
    interpolates the low frequencies only (ramp between llama.cpp's
    correction dims for ``orig_ctx``) and scales the attention magnitude;
    ``attn_factor`` multiplies cos and sin in every layer."""

    kind: str = "none"
    factor: float = 1.0
    orig_ctx: int = 0
    attn_factor: float = 1.0

    def attrs(self, scaled: bool = True) -> dict:
        """The ``rope`` op's scaling attributes (``ir.rope_tables.ROPE_SCALING_DEFAULTS``);
        ``scaled=False`` for layers the family does not scale. Empty when
        nothing changes, so unscaled graphs are the same as ever."""
        out: dict = {}
        if scaled and self.kind in ("linear", "yarn") and self.factor != 1.0:
            out["freq_scale"] = float(np.float32(1.0) / np.float32(self.factor))
            if self.kind == "yarn":
                out.update(ext_factor=1.0, yarn_orig_ctx=int(self.orig_ctx))
        if self.attn_factor != 1.0:
            out["attn_factor"] = float(np.float32(self.attn_factor))
        return out


@dataclass
class ModelConfig:
    """Hyper-parameters of one model, whatever file they came from."""

    arch: str
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    head_dim: int = 0
    #: dimensions of each head that RoPE rotates (0: all; less with partial rotary, Phi-2)
    rope_dims: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tied_output: bool = True
    bos_id: int = 1
    eos_id: int = 2
    #: tokens that end generation; llama2.c's run.c stops when it samples BOS (and goes on past EOS)
    stop_ids: tuple[int, ...] = (1,)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    #: family-specific values from the file: ``sliding_window``, ``rope_local_theta``,
    #: ``attn_softcap`` and ``final_softcap`` (Gemma 2)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if not self.rope_dims:
            self.rope_dims = self.head_dim

    @property
    def spec(self) -> ArchSpec:
        return ARCHITECTURES[self.arch]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class WeightInfo:
    type: TensorType
    ref: WeightRef


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the family's graph needs, with its [out, in] shape
    (fused file tensors already split: ``file_shapes`` gives the file's)."""
    s = cfg.spec
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd": (cfg.vocab_size, cfg.dim),
        "output_norm": (cfg.dim,),
    }
    if s.rope_style == "learned":
        shapes["position_embd"] = (cfg.seq_len, cfg.dim)
    if s.norm == "layer":
        shapes["output_norm.bias"] = (cfg.dim,)
    if not cfg.tied_output:
        shapes["output"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm": (cfg.dim,),
            b + "attn_q": (cfg.q_dim, cfg.dim),
            b + "attn_k": (cfg.kv_dim, cfg.dim),
            b + "attn_v": (cfg.kv_dim, cfg.dim),
            b + "attn_output": (cfg.dim, cfg.q_dim),
        })
        if not s.parallel:
            shapes[b + "ffn_norm"] = (cfg.dim,)
        if s.ffn_gated:
            shapes[b + "ffn_gate"] = (cfg.hidden_dim, cfg.dim)
        shapes.update({b + "ffn_up": (cfg.hidden_dim, cfg.dim), b + "ffn_down": (cfg.dim, cfg.hidden_dim)})
        if s.norm == "layer":
            shapes.update({n + ".bias": shapes[n] for n in (b + "attn_norm", b + "ffn_norm") if n in shapes})
        if s.biases:
            shapes.update({b + "attn_output.bias": (cfg.dim,), b + "ffn_up.bias": (cfg.hidden_dim,),
                           b + "ffn_down.bias": (cfg.dim,)})
        if s.qkv_bias:
            shapes.update({b + "attn_q.bias": (cfg.q_dim,), b + "attn_k.bias": (cfg.kv_dim,),
                           b + "attn_v.bias": (cfg.kv_dim,)})
        if s.qk_norm:
            shapes.update({b + "attn_q_norm": (cfg.head_dim,), b + "attn_k_norm": (cfg.head_dim,)})
        if s.post_norms:
            shapes.update({b + "post_attention_norm": (cfg.dim,), b + "post_ffw_norm": (cfg.dim,)})
    return shapes


def optional_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a model of the family may carry and the graph then uses: a
    bias for any projection (llama.cpp reads them for llama too), and the
    RoPE frequency divisors where the family has them."""
    shapes = {name + ".bias": (shape[0],) for name, shape in expected_shapes(cfg).items()
              if len(shape) == 2 and name not in ("token_embd", "position_embd")}
    if not cfg.tied_output:
        shapes["output.bias"] = (cfg.vocab_size,)
    if cfg.spec.rope_freqs:
        shapes["rope_freqs"] = (cfg.rope_dims // 2,)
    return shapes


def _fusions(cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """(file tensor, the graph tensors it holds in row order) per layer."""
    s, out = cfg.spec, []
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        if s.fused_qkv:
            out.append((b + "attn_qkv", [b + "attn_q", b + "attn_k", b + "attn_v"]))
        if s.fused_gate_up:
            out.append((b + "ffn_up", [b + "ffn_gate", b + "ffn_up"]))
    return out


def file_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a file of the family holds, as llama.cpp's converter
    writes them (fused where the family fuses), with their shapes."""
    shapes = expected_shapes(cfg)
    for fused, parts in _fusions(cfg):
        rows = sum(shapes[p][0] for p in parts)
        cols = shapes[parts[0]][1]
        has_bias = all(p + ".bias" in shapes for p in parts)
        pos = list(shapes).index(parts[0])
        drop = set(parts) | ({p + ".bias" for p in parts} if has_bias else set())
        items = [(k, v) for k, v in shapes.items() if k not in drop]
        items.insert(min(pos, len(items)), (fused, (rows, cols)))
        if has_bias:
            items.insert(min(pos + 1, len(items)), (fused + ".bias", (rows,)))
        shapes = dict(items)
    return shapes


def split_fused(cfg: ModelConfig, weights: dict[str, WeightInfo], path: str) -> dict[str, WeightInfo]:
    """A file's fused tensors (``attn_qkv``, Phi-3's ``ffn_up`` = [gate; up])
    as the graph's separate ones: row ranges of the same bytes (every layout
    stores whole rows), nothing copied. Files with the parts separate pass
    through."""
    need = expected_shapes(cfg)
    out = dict(weights)
    for fused, parts in _fusions(cfg):
        if fused not in weights or (fused == parts[-1] and parts[0] in weights):
            continue  # stored separately (llama.cpp accepts either): Phi-3's ffn_up is then up alone
        for suffix in ("", ".bias"):
            w = weights.get(fused + suffix)
            if w is None:
                continue
            rows = [need[p][0] for p in parts]
            want = (sum(rows),) + (() if suffix else (need[parts[0]][1],))
            if tuple(w.type.shape) != want:
                raise ModelError(f"{path}: tensor {fused}{suffix} has shape {tuple(w.type.shape)}, the config needs "
                                 f"{want}")
            layout = w.type.layout or "F32"
            row_bytes = get_layout(layout).nbytes((1,) + want[1:])
            del out[fused + suffix]
            start = 0
            for p, n in zip(parts, rows):
                ref = replace(w.ref, offset=w.ref.offset + start * row_bytes, nbytes=n * row_bytes)
                out[p + suffix] = WeightInfo(replace(w.type, shape=(n,) + want[1:]), ref)
                start += n
    return out


def check_weights(cfg: ModelConfig, weights: dict[str, WeightInfo], path: str) -> None:
    """Every needed tensor is present with the shape the config implies, and
    nothing else is there: a tensor the family does not use would change the
    computation in the program that wrote it (no silent fallback)."""
    needed = expected_shapes(cfg)
    for name, shape in needed.items():
        w = weights.get(name)
        if w is None:
            raise ModelError(f"{path}: missing tensor {name}")
        if tuple(w.type.shape) != shape:
            raise ModelError(f"{path}: tensor {name} has shape {tuple(w.type.shape)}, the config needs {shape}")
    optional = optional_shapes(cfg)
    for name, w in weights.items():
        if name in needed:
            continue
        if name not in optional:
            raise ModelError(f"{path}: tensor {name} is not part of lmc's {cfg.arch} family (it would change the "
                             f"computation, and lmc does not implement it)")
        if tuple(w.type.shape) != optional[name]:
            raise ModelError(f"{path}: tensor {name} has shape {tuple(w.type.shape)}, the config needs "
                             f"{optional[name]}")


class _Builder:
    def __init__(self, g: Graph, cfg: ModelConfig, weights: dict[str, WeightInfo]) -> None:
        self.g, self.cfg, self.weights = g, cfg, weights

    def w(self, name: str, alias: str | None = None) -> Value:
        """The weight ``name``, known to the graph as ``alias`` when given
        (one tensor of the file used by every layer, named per layer)."""
        info = self.weights[name]
        return self.g.add_weight(alias or name, info.type, info.ref)

    def op(self, op: str, *inputs: Value, **attrs) -> Value:
        return self.g.add_node(op, list(inputs), attrs)

    def norm(self, x: Value, name: str, eps: float) -> Value:
        """The family's norm: RMSNorm, or LayerNorm with its bias."""
        if self.cfg.spec.norm == "layer":
            return self.op("layernorm", x, self.w(name), self.w(name + ".bias"), eps=eps)
        return self.op("rmsnorm", x, self.w(name), eps=eps)

    def ffn(self, h: Value, p: str) -> Value:
        """down(act(gate(h)) * up(h)), or down(act(up(h))) without a gate."""
        act = self.cfg.spec.ffn_act
        up = self.linear(h, p + "ffn_up")
        if self.cfg.spec.ffn_gated:
            up = self.op("mul", self.op(act, self.linear(h, p + "ffn_gate")), up)
        else:
            up = self.op(act, up)
        return self.linear(up, p + "ffn_down")

    def linear(self, x: Value, name: str) -> Value:
        """x @ W.T (+ bias). Quantized weights go through an explicit dequant,
        which ``fuse_dequant`` folds into the matmul."""
        w = self.w(name)
        if w.type.layout not in (None, "F32"):
            w = self.op("dequant", w)
        y = self.op("matmul", x, w)
        if name + ".bias" in self.weights:
            y = self.op("bias_add", y, self.w(name + ".bias"))
        return y


def build_graph(cfg: ModelConfig, weights: dict[str, WeightInfo], mode: str = "decode",
                ctx: int | None = None, all_logits: bool = False, name: str = "model",
                kv_type: str = DEFAULT_KV_TYPE, block_size: int | None = None, n_blocks: int | None = None,
                select: int | None = None, max_rows: int | None = None, key_offsets: Any = None) -> Graph:
    """The token-step graph. ``decode`` takes one ``token``; ``prefill`` takes
    ``tokens[T]`` (matrix-matrix products), returning the last row's logits or,
    with ``all_logits``, one row per token. The KV cache holds ``ctx`` positions
    stored as ``kv_type`` (``ir.types.KV_TYPES``).

    ``batch`` runs T rows of any number of sequences at once (continuous
    batching): ``tokens[T]``, each row's own ``positions[T]`` and its
    sequence's ``block_tables[T, ceil(ctx / block_size)]`` into a KV pool of
    ``n_blocks`` blocks of ``block_size`` positions (vLLM's paged attention).
    Every row's K/V is written before any row attends, so rows of one
    sequence in one batch see each other causally. ``all_logits`` gives a
    row per row (a decode batch); without it the last row's (a prompt chunk
    of one sequence); with ``select`` = R, the rows that an input
    ``rows[R]`` names (a step mixing decode rows and prompt chunks needs
    logits for the decode rows and each finished prompt's last row only:
    the head, the largest matmul, runs for those alone).

    ``max_rows``: the most rows a decode or prefill step takes (the native
    plan's prompt chunk). With it, a sliding-window layer whose window plus
    that is shorter than ``ctx`` keeps a ring of that many positions instead
    of the whole context (``ir.ops.attention``): Gemma 3's 15 local layers
    hold 512 + 128 positions, not 32,768.

    ``key_offsets`` ([n_layers, kv_dim] floats, ``runtime.key_offsets``): what
    each layer's key writes subtract when ``kv_type`` is one of
    ``KEY_OFFSET_KV_TYPES`` (the write's ``offset``; exact for attention,
    which softmax makes blind to a constant added to every key). A layer
    with a soft cap on its scores gets none: there the shift would not cancel."""
    if mode not in ("decode", "prefill", "batch"):
        raise ValueError(f"unknown graph mode {mode!r}")
    if select is not None and (mode != "batch" or all_logits or not (isinstance(select, int) and select > 0)):
        raise ValueError(f"select={select!r}: a positive row count, for a batch graph without all_logits")
    check_kv_type(cfg, kv_type, name)
    s = cfg.spec
    ctx = ctx or cfg.seq_len
    g = Graph(f"{name}.{mode}")
    g.meta.update(arch=cfg.arch, mode=mode, ctx=ctx, kv_type=kv_type)
    b = _Builder(g, cfg, weights)
    paged: dict = {}
    pool = ctx
    if mode == "batch":
        if not (isinstance(block_size, int) and block_size > 0 and isinstance(n_blocks, int) and n_blocks > 0):
            raise ValueError(f"a batch graph needs a positive block_size and n_blocks, got {block_size}, {n_blocks}")
        max_blocks = -(-ctx // block_size)
        g.meta.update(block_size=block_size, n_blocks=n_blocks, max_blocks=max_blocks)
        tok = g.add_input("tokens", TensorType(("T",), "i32"))
        pos = g.add_input("positions", TensorType(("T",), "i32"))
        tables = g.add_input("block_tables", TensorType(("T", max_blocks), "i32"))
        if select is not None:
            rows = g.add_input("rows", TensorType((int(select),), "i32"))
        paged = dict(block_size=block_size)
        pool = n_blocks * block_size
    else:
        if mode == "decode":
            tok = g.add_input("token", TensorType((), "i32"))
        else:
            tok = g.add_input("tokens", TensorType(("T",), "i32"))
        pos = g.add_input("pos", TensorType((), "i32"))

    x = b.op("embedding", b.w("token_embd"), tok)
    if s.rope_style == "learned":
        table = int(weights["position_embd"].type.shape[0])
        if ctx > table:
            raise ModelError(f"{name}: a context of {ctx} positions is more than its {table} learned position "
                             f"embeddings (use -c {table} or less)")
        x = b.op("add", x, b.op("pos_embedding", b.w("position_embd"), pos, tok))
    if s.embed_scale:
        x = b.op("scale", x, factor=float(math.sqrt(cfg.dim)))
    eps = float(cfg.norm_eps)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        glob, window = layer_window(cfg, i)
        ring = ring_rows(window, max_rows) if window and max_rows and not paged else 0
        ring = ring if ring and ring < ctx else 0
        kc = g.add_state(f"k_cache.{i}", kv_cache_type(kv_type, ring or pool, cfg.kv_dim, cfg.head_dim))
        vc = g.add_state(f"v_cache.{i}", kv_cache_type(kv_type, ring or pool, cfg.kv_dim, cfg.head_dim))
        theta = cfg.rope_theta if glob else float(cfg.extra.get("rope_local_theta", cfg.rope_theta))
        in_ring = {"ring": ring} if ring else {}
        if ring:
            g.meta["ring_slack"] = ring - window

        h = b.norm(x, p + "attn_norm", eps)
        q = b.linear(h, p + "attn_q")
        k = b.linear(h, p + "attn_k")
        v = b.linear(h, p + "attn_v")
        if s.qk_norm:
            q = b.op("rmsnorm", q, b.w(p + "attn_q_norm"), eps=eps)
            k = b.op("rmsnorm", k, b.w(p + "attn_k_norm"), eps=eps)
        if s.rope_style != "learned":
            rope = dict(head_dim=cfg.head_dim, theta=float(theta), style=s.rope_style,
                        **cfg.rope_scaling.attrs(scaled=glob or s.scale_local_rope))
            if cfg.rope_dims != cfg.head_dim:
                rope["dims"] = int(cfg.rope_dims)
            # Llama 3's frequency divisors: one tensor, a weight of every layer (as llama.cpp's
            # per-layer rope_freqs), so each block's section and stream segment hold their own
            factors = [b.w("rope_freqs", p + "rope_freqs")] if "rope_freqs" in weights else []
            q = b.op("rope", q, pos, *factors, **rope)
            k = b.op("rope", k, pos, *factors, **rope)
        att = dict(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                   scale=1.0 / math.sqrt(cfg.head_dim), window=window)
        if cfg.extra.get("attn_softcap"):
            att["softcap"] = float(cfg.extra["attn_softcap"])
        koff = {}
        if key_offsets is not None and kv_type in KEY_OFFSET_KV_TYPES and not att.get("softcap"):
            koff = {"offset": tuple(float(v) for v in key_offsets[i])}
        if paged:
            kc = b.op("kv_write_paged", kc, k, pos, tables, **paged, **koff)
            vc = b.op("kv_write_paged", vc, v, pos, tables, **paged)
            a = b.op("attention_paged", q, kc, vc, pos, tables, **att, **paged)
        else:
            kc = b.op("kv_write", kc, k, pos, **in_ring, **koff)
            vc = b.op("kv_write", vc, v, pos, **in_ring)
            exact: list = []
            if kv_type in KEY_OFFSET_KV_TYPES and switch("LMC_KV_EXACT"):   # low-bit: recent rows and sink exact
                xring = ring_rows(RECENT, max_rows) if max_rows else 0
                xring = xring if xring and xring < pool else 0
                xt = kv_cache_type("f16", (xring or pool) + 1, cfg.kv_dim)
                xk = g.add_state(f"k_recent.{i}", xt)
                xv = g.add_state(f"v_recent.{i}", xt)
                xr = {"ring": xring} if xring else {}
                exact = [b.op("kv_write", xk, k, pos, sink=1, **xr, **koff), b.op("kv_write", xv, v, pos, sink=1, **xr)]
                att.update(recent=RECENT, xring=xring)
                if xring:
                    g.meta["ring_slack"] = xring - RECENT
            a = b.op("attention", q, kc, vc, pos, *exact, **att, **in_ring)
        o = b.linear(a, p + "attn_output")
        if s.post_norms:
            o = b.op("rmsnorm", o, b.w(p + "post_attention_norm"), eps=eps)
        if s.parallel:  # Phi-2: both branches read h, then (attn + ffn) + x as llama.cpp adds them
            x = b.op("add", b.op("add", o, b.ffn(h, p)), x)
            continue
        x = b.op("add", x, o)

        f = b.ffn(b.norm(x, p + "ffn_norm", eps), p)
        if s.post_norms:
            f = b.op("rmsnorm", f, b.w(p + "post_ffw_norm"), eps=eps)
        x = b.op("add", x, f)

    if select is not None:
        x = b.op("take_rows", x, rows)
    elif mode != "decode" and not all_logits:
        x = b.op("take_last", x)
    x = b.norm(x, "output_norm", eps)
    logits = b.linear(x, "token_embd" if cfg.tied_output else "output")
    if cfg.extra.get("final_softcap"):
        logits = b.op("softcap", logits, cap=float(cfg.extra["final_softcap"]))
    logits.name = "logits"
    g.set_outputs(logits)
    return g


def layer_window(cfg: ModelConfig, i: int) -> tuple[bool, int]:
    """Layer i's kind: (global, its sliding window in positions, 0 for none).
    Gemma 2/3 alternate local and global layers (``swa_every``); a family
    without a pattern whose file gives a window (Mistral) slides every layer."""
    s = cfg.spec
    window = int(cfg.extra.get("sliding_window", 0) or 0)
    if s.swa_every:
        glob = (i + 1) % s.swa_every == 0
        return glob, 0 if glob else window
    return window == 0, window


def check_kv_type(cfg: ModelConfig, kv_type: str, name: str = "model") -> None:
    """A KV cache type the model can use: q8, q4 and q2 blocks of 32 must not
    straddle two heads (attention reads one head's slice of a row), and q4 /
    q2 rotate each head by a fast Walsh-Hadamard transform, which needs a
    power of two."""
    if kv_type not in KV_TYPES:
        raise ModelError(f"--kv-type {kv_type}: unknown KV cache type (one of {', '.join(KV_TYPES)})")
    hd = cfg.head_dim
    if kv_type in ("q4", "q2") and (hd < 32 or hd & (hd - 1)):
        alt = f"--kv-type {kv_type}-plain or q8" if hd % 32 == 0 else "--kv-type f16"
        raise ModelError(f"--kv-type {kv_type}: {name} has head_dim {hd}, not a power of two >= 32 ({kv_type} "
                         f"rotates each head by a Walsh-Hadamard transform); use {alt}")
    if KV_TYPES[kv_type][1] is not None and hd % 32:
        raise ModelError(f"--kv-type {kv_type}: {name} has head_dim {hd}, not a multiple of 32 ({kv_type} stores "
                         f"blocks of 32 values per head); use --kv-type f16")


def with_context(cfg: ModelConfig, ctx: int) -> ModelConfig:
    return replace(cfg, seq_len=ctx)
