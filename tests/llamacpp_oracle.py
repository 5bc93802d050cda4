"""llama.cpp as the oracle for a model file: differential tests on synthetic models.

llama.cpp runs any GGUF that carries the right metadata and tensors, random
weights included, so a small synthetic file of a family (written with
``frontends.gguf_writer``: the family's real tensor names and keys) can be
run by both engines and their next-token distributions compared.

llama.cpp comes from the ``xllamacpp`` package (its server, in-process). One
server per process (a second one hangs), so it runs in a child process: the
prompt goes to ``/completion`` with greedy sampling and ``n_probs``, and
llama.cpp reports, at every generated position, the top log-probabilities
of its raw next-token distribution. lmc then runs the same sequence (prompt
+ llama.cpp's own greedy continuation) under teacher forcing and the two are
compared row by row, centred (log-probabilities and logits differ by a
per-row constant). llama.cpp keeps its KV cache in f16 by default; the
child sets f32 and turns flash attention off so that F32 models compare
at float32 precision. It runs one thread: llama.cpp's threads spin at
every op until all arrive, so beside another test's threads each op could
wait a scheduler slice (SmolLM2's three prompts here: 3.3 s alone, 12.4 s
with both cores busy on 2 threads, 7.2 s on 1), and its results do not
depend on the count (the same greedy tokens and top-20 log-probabilities,
to the bit, on 1 and 2 threads).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

_CHILD = r"""
import json, os, sys, urllib.request
import xllamacpp as x
endpoint, reqs, params = json.loads(sys.stdin.read())
p = x.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = int(sys.argv[2])
p.port = 0
p.warmup = False
p.use_jinja = True
p.cache_type_k = x.ggml_type.GGML_TYPE_F32
p.cache_type_v = x.ggml_type.GGML_TYPE_F32
p.flash_attn_type = 0
p.cpuparams.n_threads = 1
p.cpuparams_batch.n_threads = 1
for k, v in params.items():
    setattr(p, k, v)
s = x.Server(p)
addr = s.listening_address.rstrip("/")
out = []
for req in reqs:
    r = urllib.request.Request(addr + endpoint, data=json.dumps(req).encode(),
                               headers={"Content-Type": "application/json"})
    out.append(json.loads(urllib.request.urlopen(r, timeout=600).read()))
sys.stdout.write("\n@@" + json.dumps(out) + "\n")
sys.stdout.flush()
os._exit(0)
"""


def llamacpp_requests(model: Path | str, endpoint: str, requests: list[dict], n_ctx: int = 256,
                      params: dict[str, Any] | None = None) -> list[dict]:
    """POST each request body to llama.cpp's server (one child process, one
    server) and return the decoded JSON answers. ``params`` sets fields of
    the server's ``CommonParams`` (``prefill_assistant`` ...)."""
    have_llamacpp()
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(n_ctx)],
                           input=json.dumps([endpoint, requests, params or {}]), capture_output=True, text=True,
                           timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail("llama.cpp's server did not answer within 900 s")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("@@")]
    if r.returncode != 0 or not lines:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"llama.cpp could not run {model}:\n{tail}")
    return json.loads(lines[-1][2:])


def have_llamacpp() -> None:
    """Skip the calling test unless llama.cpp's bindings are installed."""
    pytest.importorskip("xllamacpp", reason="xllamacpp (llama.cpp's server as a Python package) is not installed")


@dataclass
class Greedy:
    """llama.cpp's greedy continuation and, per generated position, its top
    (id, log-probability) pairs."""

    generated: list[int]
    top: list[list[tuple[int, float]]]


def llamacpp_greedy(model: Path | str, prompt_ids: list[int], n: int = 64, n_probs: int = 20,
                    n_ctx: int = 256) -> Greedy:
    return llamacpp_greedy_many(model, [prompt_ids], n, n_probs, n_ctx)[0]


def llamacpp_greedy_many(model: Path | str, prompts: list[list[int]], n: int = 64, n_probs: int = 20,
                         n_ctx: int = 256) -> list[Greedy]:
    """``llamacpp_greedy`` for several prompts through one server (one model load)."""
    reqs = [{"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
             "n_probs": n_probs, "post_sampling_probs": False, "cache_prompt": False, "ignore_eos": True}
            for ids in prompts]
    out = []
    for answer in llamacpp_requests(model, "/completion", reqs, n_ctx):
        probs = answer["completion_probabilities"]
        out.append(Greedy([p["id"] for p in probs], [[(t["id"], t["logprob"]) for t in p["top_logprobs"]]
                                                     for p in probs]))
    return out


@dataclass
class Agreement:
    positions: int
    argmax_equal: int
    worst_centred: float      # largest |centred difference| over llama.cpp's top ids
    smallest_margin: float    # llama.cpp's smallest top-1 minus top-2 log-prob gap

    def row(self, name: str) -> str:
        return (f"{name}: argmax {self.argmax_equal}/{self.positions}, largest centred top-20 difference "
                f"{self.worst_centred:.2e}, smallest llama.cpp margin {self.smallest_margin:.3f}")


def compare(logits_of: Callable[[list[int]], np.ndarray], prompt_ids: list[int], ref: Greedy) -> Agreement:
    """Teacher-force prompt + llama.cpp's continuation through ``logits_of``
    (rows = next-token logits after each position) and compare each
    generated position with llama.cpp's top log-probabilities."""
    seq = list(prompt_ids) + ref.generated
    logits = np.asarray(logits_of(seq), np.float64)
    first = len(prompt_ids) - 1
    equal, worst, margin = 0, 0.0, float("inf")
    for k, top in enumerate(ref.top):
        row = logits[first + k]
        ids = np.array([i for i, _ in top])
        lp = np.array([v for _, v in top], np.float64)
        mine = row[ids]
        worst = max(worst, float(np.abs((mine - mine.mean()) - (lp - lp.mean())).max()))
        equal += int(np.argmax(row)) == int(ids[0])  # llama.cpp's raw top-1 (greedy skips EOS)
        margin = min(margin, float(lp[0] - lp[1]))
    return Agreement(len(ref.top), equal, worst, margin)


def assert_agrees_f32(path: Path | str, prompt_ids: list[int], ref: Greedy, name: str, n: int = 64,
                     ctx: int = 128) -> None:
    """An F32 model against llama.cpp's greedy run ``ref``: the argmax equal
    at all ``n`` positions and the largest centred top-20 difference within
    1e-2, through the native prefill, the native decode steps and the
    interpreter."""
    import runtime

    native = runtime.load(path, threads=2, ctx=ctx, kv_type="f32")   # as the child's llama.cpp
    rows = {"prefill": compare(native.logits, prompt_ids, ref),
            "decode": compare(lambda seq: decode_logits(native, seq, len(prompt_ids)), prompt_ids, ref),
            "interp": compare(runtime.load(path, backend="interp", ctx=ctx, kv_type="f32").logits, prompt_ids, ref)}
    for how, a in rows.items():
        print(a.row(f"{name} {how}"))
        assert a.argmax_equal == a.positions == n, a.row(how)
        assert a.worst_centred <= 1e-2, a.row(how)


def printable_vocab(n: int) -> tuple[list[bytes], list[float], list[int]]:
    """An SPM vocabulary whose every token prints as valid UTF-8 on its own:
    llama.cpp's server drops the probabilities of tokens that end inside a
    UTF-8 sequence (byte tokens 0x80-0xFF), which would misalign positions."""
    from gguf import TokenType

    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(128)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 128
    k = 0
    while len(toks) < n:
        toks.append(("\u2581" if k % 2 else "").encode() + f"w{k}".encode())
        types.append(TokenType.NORMAL)
        k += 1
    return toks[:n], [0.0 if i < 131 else -float(i) for i in range(n)], [int(t) for t in types[:n]]


def decode_logits(model: Any, seq: list[int], n_prompt: int) -> np.ndarray:
    """Next-token logits after each position of ``seq``, the prompt through
    one prefill and every later token through a decode step (rows before
    the prompt's last are NaN): the decode kernels' view of the sequence."""
    ex = model.executor
    ex.reset()
    rows = np.full((len(seq), model.config.vocab_size), np.nan, np.float32)
    rows[n_prompt - 1] = ex.prefill(seq[:n_prompt], 0)
    for k in range(n_prompt, len(seq)):
        rows[k] = ex.decode(seq[k], k)
    return rows


def random_tensor(shapes: dict[str, tuple[int, ...]], seed: int, factors: dict[str, Any] | None = None
                  ) -> Callable[[str], np.ndarray]:
    """Weights for a synthetic model: norms near 1, matrices scaled by
    1/sqrt(fan-in), the embedding and head three times that so that the
    next-token distribution is peaked but not one-hot (argmax ties would
    be luck, and a one-hot model compares nothing). ``factors`` gives fixed tensors by name (``rope_freqs``)."""
    def tensor(name: str) -> np.ndarray:
        if factors and name in factors:
            return np.asarray(factors[name], np.float32)
        shape = shapes[name]
        rng = np.random.default_rng([seed, sum(map(ord, name)), len(name)])
        a = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            return (1.0 + 0.1 * a).astype(np.float32) if not name.endswith(".bias") else 0.1 * a
        scale = 3.0 if name in ("token_embd", "output") else 1.0  # the head (tied or not): logits ~ N(0, 9)
        return (a * scale / np.sqrt(shape[-1])).astype(np.float32)

    return tensor


def write_tensors_gguf(path: Path, arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                       vocab_size: int) -> Path:
    """A GGUF of ``arch`` holding exactly ``shapes``' tensors (F32, random)
    and ``metadata``: for files ``frontends.gguf_writer`` would not write
    (a tensor outside the family, one missing, an unknown architecture)."""
    import gguf

    from frontends.gguf_writer import add_value

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in metadata.items():
        add_value(w, k, v)
    toks, scores, types = printable_vocab(vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    tensor = random_tensor(shapes, 0)
    for n in shapes:
        w.add_tensor(n if n.endswith(".bias") else n + ".weight", tensor(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_with_vocab(vocab_path: Path, dst: Path, chat_template: str | None = None) -> Path:
    """A one-layer llama GGUF with random weights carrying the vocabulary (and
    chat template) of ``vocab_path``: llama.cpp loads no vocabulary-only
    file as a model, and a template test needs one to hold."""
    import gguf

    from frontends.gguf import read_gguf
    from frontends.string_table import StringArray

    meta = {k: v for k, v in read_gguf(vocab_path).meta.items() if k.startswith("tokenizer.")}
    n = len(meta["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(dst), "llama")
    e, f = 64, 128
    w.add_context_length(64)
    w.add_embedding_length(e)
    w.add_block_count(1)
    w.add_feed_forward_length(f)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(e // 2)
    T = gguf.GGUFValueType
    for k, v in meta.items():
        if k == "tokenizer.chat_template":
            continue
        if isinstance(v, (list, StringArray)):
            w.add_key_value(k, [bytes(x) for x in v], T.ARRAY, sub_type=T.STRING)
        elif isinstance(v, (bytes, bytearray, memoryview)):
            w.add_key_value(k, bytes(v).decode("utf-8"), T.STRING)
        elif isinstance(v, np.ndarray):
            w.add_key_value(k, v.tolist(), T.ARRAY, sub_type=T.FLOAT32 if v.dtype == np.float32 else T.INT32)
        elif isinstance(v, bool):
            w.add_key_value(k, v, T.BOOL)
        else:
            w.add_key_value(k, int(v), T.UINT32)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (n, e), "output_norm.weight": (e,), "blk.0.attn_norm.weight": (e,),
              "blk.0.ffn_norm.weight": (e,), "blk.0.attn_q.weight": (e, e), "blk.0.attn_k.weight": (e, e),
              "blk.0.attn_v.weight": (e, e), "blk.0.attn_output.weight": (e, e),
              "blk.0.ffn_gate.weight": (f, e), "blk.0.ffn_up.weight": (f, e), "blk.0.ffn_down.weight": (e, f)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
