"""End to end on real models: the CLI and the Python API against run.c."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import runtime
from shared_data import MODELS, ROOT, needs_shared, reference_cases

RUNC = reference_cases("stories260K_runc.json")
RUNQ = reference_cases("stories260K_q8_runq.json")


def lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def run_case_args(model: str, case: dict, backend: str = "interp") -> list[str]:
    n = case["steps"] - len(case["prompt_ids"]) + 1
    args = ["run", str(MODELS / model), "-z", str(MODELS / "tok512.bin"), "-p", case["prompt"], "-n", str(n),
            "--temp", str(case["temperature"]), "--top-p", str(case["top_p"]), "--json", "--backend", backend,
            "--kv-type", "f32"]   # run.c keeps its KV cache in f32
    if case["seed"] is not None:
        args += ["--seed", str(case["seed"])]
    return args


@needs_shared
@pytest.mark.parametrize("backend", ["interp", "llvm"])
@pytest.mark.parametrize("case", RUNC, ids=[f"{c['prompt'][:12]!r}-seed{c['seed']}" for c in RUNC])
def test_cli_reproduces_runc(case, backend):
    r = lmc(*run_case_args("stories260K.bin", case, backend))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == case["prompt_ids"]
    assert out["generated_ids"] == case["generated_ids"]
    # run.c prints the pieces and then a newline
    assert out["text"] + "\n" == case["text"]
    assert out["stats"]["generated_tokens"] == len(case["generated_ids"])


@needs_shared
def test_q8_checkpoint_float_path():
    """Our float engine on the v2 (Q8_0) file stays close to the fp32 model;
    how far it agrees with runq's integer arithmetic is reported, not tuned."""
    q8 = runtime.load(MODELS / "stories260K-q8.bin", MODELS / "tok512.bin")
    fp = runtime.load(MODELS / "stories260K.bin", MODELS / "tok512.bin")
    case = next(c for c in RUNQ if c["seed"] is None)
    seq = case["prompt_ids"] + case["generated_ids"][:100]
    lq, lf = q8.logits(seq), fp.logits(seq)
    assert np.abs(lq - lf).max() / np.abs(lf).max() < 0.05
    n = case["steps"] - len(case["prompt_ids"]) + 1
    out = list(q8.generate(case["prompt_ids"], n, temperature=0.0))
    agree = next((i for i, (a, b) in enumerate(zip(out, case["generated_ids"])) if a != b), len(out))
    print(f"q8 float path vs runq: {agree} leading greedy tokens agree")


@needs_shared
def test_runq_arithmetic_explains_the_q8_reference():
    """runq quantizes activations to int8 per group of GS and, with
    hidden_dim 172 and GS 8, skips the last 4 columns of w2 and reads scales
    of groups that straddle rows. Emulating that on the weights our reader
    maps out reproduces runq's tokens, so the file is read right."""
    from frontends.llama2c import load_llama2c
    from ir.interp import WeightStore

    ck = load_llama2c(MODELS / "stories260K-q8.bin")
    cfg, gs, ws = ck.config, ck.group_size, WeightStore()

    def qt(name):
        w = ck.weights[name]
        raw, (rows, cols) = ws.raw(w.ref), w.type.shape
        n = rows * cols
        return np.frombuffer(raw, np.int8, n).reshape(rows, cols), np.frombuffer(raw, "<f4", n // gs, n), cols

    def f32(name):
        return np.frombuffer(ws.raw(ck.weights[name].ref), "<f4")

    def qmatvec(x, name):
        wq, wsc, n = qt(name)
        ng = n // gs
        xg = x[: ng * gs].reshape(ng, gs)
        xs = (np.abs(xg).max(axis=1) / np.float32(127.0)).astype(np.float32)
        xq = np.round(xg / xs[:, None]).astype(np.int32)
        iv = np.einsum("rgk,gk->rg", wq[:, : ng * gs].reshape(-1, ng, gs).astype(np.int32), xq)
        sidx = (np.arange(wq.shape[0])[:, None] * n + np.arange(ng)[None, :] * gs) // gs
        val = np.zeros(wq.shape[0], np.float32)
        for g in range(ng):  # runq accumulates group by group in float32
            val = val + (iv[:, g].astype(np.float32) * wsc[sidx[:, g]]) * xs[g]
        return val

    def rms(x, w):
        ss = np.float32(np.sum(x * x, dtype=np.float32) / np.float32(x.size) + np.float32(1e-5))
        return (w * (x * (np.float32(1) / np.sqrt(ss)))).astype(np.float32)

    hs, L = cfg.head_dim, cfg.n_layers
    kc = np.zeros((L, cfg.seq_len, cfg.kv_dim), np.float32)
    vc = np.zeros_like(kc)
    from ir.ops import rope_ref

    def forward(tok, pos):
        eq, es, d = qt("token_embd")
        x = (eq[tok].astype(np.float32).reshape(-1, gs) * es[tok * d // gs:(tok + 1) * d // gs, None]).reshape(-1)
        for l in range(L):
            p = f"blk.{l}."
            h = rms(x, f32(p + "attn_norm"))
            q, k, v = (qmatvec(h, p + n) for n in ("attn_q", "attn_k", "attn_v"))
            q = rope_ref(q, pos, head_dim=hs, theta=10000.0, style="interleaved")
            kc[l, pos] = rope_ref(k, pos, head_dim=hs, theta=10000.0, style="interleaved")
            vc[l, pos] = v
            att = np.zeros(cfg.dim, np.float32)
            for hh in range(cfg.n_heads):
                kv = hh // (cfg.n_heads // cfg.n_kv_heads)
                sc = kc[l, : pos + 1, kv * hs:(kv + 1) * hs] @ q[hh * hs:(hh + 1) * hs] / np.float32(np.sqrt(hs))
                e = np.exp(sc - sc.max())
                att[hh * hs:(hh + 1) * hs] = (e / e.sum()) @ vc[l, : pos + 1, kv * hs:(kv + 1) * hs]
            x = x + qmatvec(att, p + "attn_output")
            h = rms(x, f32(p + "ffn_norm"))
            g, u = qmatvec(h, p + "ffn_gate"), qmatvec(h, p + "ffn_up")
            x = x + qmatvec((g / (1 + np.exp(-g)) * u).astype(np.float32), p + "ffn_down")
        return qmatvec(rms(x, f32("output_norm")), "token_embd")

    for case in [c for c in RUNQ if c["seed"] is None]:
        ids, out = case["prompt_ids"], []
        tok = ids[0]
        for pos in range(len(ids) + 24):
            logits = forward(tok, pos)
            tok = ids[pos + 1] if pos + 1 < len(ids) else int(np.argmax(logits))
            if pos + 1 >= len(ids):
                out.append(tok)
        assert out == case["generated_ids"][: len(out)]


@needs_shared
def test_python_api():
    m = runtime.load(MODELS / "stories260K.bin", tokenizer=MODELS / "tok512.bin", kv_type="f32")  # run.c's cache
    case = RUNC[0]
    assert m.encode(case["prompt"]) == case["prompt_ids"]
    ids = list(m.generate(case["prompt"], 20, temperature=0.0))
    assert ids == case["generated_ids"][:20]
    assert m.decode(case["prompt_ids"] + ids).startswith("Once upon a time, there was")
    seq = case["prompt_ids"] + case["generated_ids"][:30]
    lg = m.logits(seq)
    assert lg.shape == (len(seq), 512) and lg.dtype == np.float32
    # teacher-forced argmax equals the greedy continuation
    assert list(lg[len(case["prompt_ids"]) - 1: -1].argmax(axis=1)) == case["generated_ids"][:30]
    # seeded sampling through the API matches run.c
    s = next(c for c in RUNC if c["seed"] is not None)
    n = s["steps"] - len(s["prompt_ids"]) + 1
    got = list(m.generate(s["prompt_ids"], n, temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"]))
    assert got == s["generated_ids"]
    tok = runtime.load_tokenizer(MODELS / "tok512.bin")
    assert tok.encode("Once upon a time", bos=False) == case["prompt_ids"][1:]
    assert tok.decode(case["prompt_ids"]) == "Once upon a time"


@needs_shared
def test_other_llama2c_model_and_extra_samplers():
    m = runtime.load(MODELS / "aidreams260K.bin", tokenizer=MODELS / "aidreams_tok512.bin")
    a = list(m.generate("I dreamed", 30, temperature=0.9, top_k=20, min_p=0.05, repeat_penalty=1.2, seed=3))
    b = list(m.generate("I dreamed", 30, temperature=0.9, top_k=20, min_p=0.05, repeat_penalty=1.2, seed=3))
    assert a == b and 0 < len(a) <= 30
    # greedy decode through the cache equals teacher-forced prefill argmax
    g = list(m.generate("I dreamed", 20, temperature=0.0))
    ids = m.encode("I dreamed")
    lg = m.logits(ids + g)
    expect = [int(i) for i in lg[len(ids) - 1:].argmax(axis=1)][: len(g)]
    assert g == expect[: len(g)]


def test_default_model_runs():
    """Gemma 3 270M with the demo extra installed, else stories260K: either
    way the greedy continuation of this prompt begins ', there was'."""
    r = lmc("run", "-p", "Once upon a time", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was")


def test_tokenize_and_ir_commands():
    from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER

    r = lmc("tokenize", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "Once upon a time")
    assert r.returncode == 0 and json.loads(r.stdout) == [1, 403, 407, 261, 378]
    r = lmc("tokenize", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "Once upon a time", "--no-bos")
    assert json.loads(r.stdout) == [403, 407, 261, 378]
    r = lmc("ir", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER)
    assert r.returncode == 0 and "= attention(%" in r.stdout and r.stdout.rstrip().endswith("}")
    r = lmc("ir", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "--format", "dot")
    assert r.returncode == 0 and r.stdout.startswith("digraph")


def _bad(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("lmc: error: ")
    for n in needles:
        assert n in err, err
    assert r.stdout == ""


def test_bad_input(tmp_path):
    from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER

    _bad(lmc("run", str(tmp_path / "nope.bin"), "-p", "x"), "nope.bin", "no such file")
    data = open(DEFAULT_MODEL, "rb").read()
    (tmp_path / "cut.bin").write_bytes(data[:100_000])
    _bad(lmc("run", str(tmp_path / "cut.bin"), "-z", DEFAULT_TOKENIZER, "-p", "x"), "cut.bin", "truncated")
    (tmp_path / "long.bin").write_bytes(data + b"\0" * 64)
    _bad(lmc("run", str(tmp_path / "long.bin"), "-z", DEFAULT_TOKENIZER), "long.bin", "header implies")
    (tmp_path / "v9.bin").write_bytes(b"\x32\x34\x6b\x61" + (9).to_bytes(4, "little") + b"\0" * 300)
    _bad(lmc("run", str(tmp_path / "v9.bin"), "-z", DEFAULT_TOKENIZER), "v9.bin", "version 9")
    if (MODELS / "tokenizer.bin").exists():
        _bad(lmc("run", DEFAULT_MODEL, "-z", str(MODELS / "tokenizer.bin")), "tokenizer.bin", "512")
    stories = (DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER)  # its context is 512
    _bad(lmc("run", *stories, "-p", "once " * 40, "-c", "16", "-n", "1"), "longer than the context")
    _bad(lmc("run", *stories, "-p", "x", "-n", "-5"), "-n")
    _bad(lmc("run", *stories, "-p", "x", "-n", "99999999999"), "-n")
    _bad(lmc("run", *stories, "-p", "x", "--stop", ""), "stop")
    _bad(lmc("run", *stories, "-p", "x", "--temp", "-1"), "--temp")
    _bad(lmc("run", *stories, "-p", "x", "--top-p", "1.5"), "--top-p")
    _bad(lmc("run", "--no-such-flag"), "--no-such-flag")
    _bad(lmc("tokenize", DEFAULT_MODEL, "-z", str(tmp_path / "none.bin"), "x"), "none.bin")


def test_run_to_the_end_of_the_context_and_stop_strings():
    """-n past the context runs until the context is full (stop_reason
    length), as run.c clips its steps; --stop ends at a stop string that is
    not printed."""
    from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER

    stories = (DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER)
    r = lmc("run", *stories, "-p", "Once upon a time", "-c", "64", "-n", "600", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stop_reason"] == "length"
    assert len(out["prompt_ids"]) + len(out["generated_ids"]) - 1 == 64
    stop = out["text"][40:45]
    r = lmc("run", *stories, "-p", "Once upon a time", "-n", "60", "--temp", "0", "--stop", stop, "--json")
    cut = json.loads(r.stdout)
    assert cut["stop_reason"] == "stop" and cut["text"] == out["text"][: out["text"].index(stop)]
    r = lmc("run", *stories, "-p", "Once upon a time", "-n", "60", "--temp", "0", "--stop", stop)
    assert r.returncode == 0 and r.stdout == cut["text"] + "\n"
