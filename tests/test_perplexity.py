"""``lmc perplexity``: checked against a slow explicit loop, across backends
and file formats, and on its windowing arithmetic."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import runtime
from runtime.models import BUNDLED_MODEL, BUNDLED_TOKENIZER
from runtime.perplexity import perplexity, perplexity_of_ids, plan_windows
from shared_data import MODELS, ROOT, SHARED, needs_shared

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
        "One day, she saw a big red ball in the park.")
EVAL = SHARED / "eval" / "stories_eval.txt"


@pytest.fixture(scope="module")
def interp():
    # f32 cache: the windows' arithmetic against decode steps, not f16's rounding of their last bits
    return runtime.load(BUNDLED_MODEL, BUNDLED_TOKENIZER, backend="interp", kv_type="f32")


def lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def nll_by_decoding(m, window: list[int], targets_from: int) -> tuple[float, int]:
    """Feed ``window`` one token at a time through the decode graph and sum
    -log p(window[j]) for j >= targets_from, with a log-softmax written here."""
    m.executor.reset()
    total, n = 0.0, 0
    for pos in range(len(window) - 1):
        logits = np.asarray(m.executor.decode(window[pos], pos), dtype=np.float64)
        if pos + 1 >= targets_from:
            top = logits.max()
            total += top + math.log(np.exp(logits - top).sum()) - logits[window[pos + 1]]
            n += 1
    return total, n


def test_one_window_matches_explicit_decode_loop(interp):
    ids = interp.encode(TEXT)
    total, n = nll_by_decoding(interp, ids, 1)
    r = perplexity(interp, TEXT)
    assert r.windows == 1 and r.tokens == n == len(ids) - 1
    assert r.nll == pytest.approx(total / n, rel=1e-6)
    assert r.perplexity == pytest.approx(math.exp(total / n), rel=1e-6)


@pytest.mark.parametrize("ctx,stride", [(16, 8), (12, 5), (10, 9)])
def test_windows_match_explicit_decode_loop(interp, ctx, stride):
    """Each window starts again at position 0 with BOS in place of its first
    token (as llama.cpp does) and scores only tokens no window scored before."""
    ids = interp.encode(TEXT)
    assert len(ids) > 2 * ctx
    total, scored, start, done = 0.0, 0, 0, 1
    while True:
        end = min(start + ctx, len(ids))
        window = [ids[0]] + ids[start + 1:end]
        t, n = nll_by_decoding(interp, window, done - start)
        total, scored, done = total + t, scored + n, end
        if end == len(ids):
            break
        start += stride
    r = perplexity(interp, TEXT, ctx=ctx, stride=stride)
    assert r.tokens == scored == len(ids) - 1
    assert r.ctx == ctx and r.stride == stride
    assert r.nll == pytest.approx(total / scored, rel=1e-6)


@pytest.mark.parametrize("n,ctx,stride", [(2, 2, 1), (100, 16, 8), (100, 16, 15), (101, 16, 7), (17, 16, 8),
                                          (16, 16, 8), (5, 512, 256), (1633, 512, 256)])
def test_every_token_scored_once(n, ctx, stride):
    wins = plan_windows(n, ctx, stride)
    scored = [j for w in wins for j in range(w.first, w.end)]
    assert scored == list(range(1, n))
    assert all(0 < w.end - w.start <= ctx and w.start < w.first for w in wins)
    assert wins[-1].end == n


def test_stride_equal_to_ctx_leaves_window_boundaries_unscored():
    """No overlap: the first token of each later window is BOS-replaced context, never a target."""
    wins = plan_windows(40, 10, 10)
    scored = {j for w in wins for j in range(w.first, w.end)}
    assert set(range(1, 40)) - scored == {10, 20, 30}


def test_default_ctx_and_stride(interp):
    r = perplexity(interp, TEXT)
    assert r.ctx == interp.ctx == 512 and r.stride == 256
    assert r.seconds > 0 and r.tokens_per_s > 0
    d = r.as_dict()
    assert {"perplexity", "nll", "tokens", "windows", "ctx", "stride", "seconds", "tokens_per_s"} <= set(d)


def test_bad_arguments(interp):
    with pytest.raises(runtime.RunError, match="at least 2"):
        perplexity_of_ids(interp, [1])
    with pytest.raises(runtime.RunError, match="empty"):
        perplexity(interp, "")
    with pytest.raises(runtime.RunError, match="--stride"):
        perplexity(interp, TEXT, ctx=8, stride=9)
    with pytest.raises(runtime.RunError, match="--stride"):
        perplexity(interp, TEXT, ctx=8, stride=0)
    with pytest.raises(runtime.RunError, match="ctx"):
        perplexity(interp, TEXT, ctx=1)
    with pytest.raises(runtime.RunError, match="loaded with a context of 512"):
        perplexity(interp, TEXT, ctx=1024)


def test_native_agrees_with_interpreter(interp):
    native = runtime.load(BUNDLED_MODEL, BUNDLED_TOKENIZER)
    a = perplexity(interp, TEXT * 4, ctx=64)
    b = perplexity(native, TEXT * 4, ctx=64)
    assert (a.tokens, a.windows) == (b.tokens, b.windows)
    assert b.nll == pytest.approx(a.nll, rel=1e-4)


@needs_shared
def test_llama2c_and_gguf_of_the_same_weights_agree():
    text = EVAL.read_text()
    a = perplexity(runtime.load(MODELS / "stories260K.bin", MODELS / "tok512.bin"), text, ctx=512)
    b = perplexity(runtime.load(MODELS / "stories260K.gguf", ctx=512), text, ctx=512)
    assert (a.tokens, a.windows) == (b.tokens, b.windows)
    assert a.tokens == a.text_tokens - 1 and a.windows > 1
    assert b.perplexity == pytest.approx(a.perplexity, rel=1e-5)


# --- CLI -------------------------------------------------------------------------

MODEL_ARGS = (BUNDLED_MODEL, "-z", BUNDLED_TOKENIZER)


def test_cli_json_and_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    r = lmc("perplexity", *MODEL_ARGS, "--text", str(f), "--backend", "interp", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress bar when stderr is not a terminal
    out = json.loads(r.stdout)
    assert out["tokens"] == out["text_tokens"] - 1 and out["windows"] == 1
    assert out["perplexity"] == pytest.approx(math.exp(out["nll"]))
    r = lmc("perplexity", *MODEL_ARGS, "--text", str(f), "--backend", "interp", "-c", "16")
    assert r.returncode == 0, r.stderr
    assert "perplexity: " in r.stdout and "ctx 16, stride 8" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("--text", "/nonexistent/t.txt"), "No such file"),
    (("--text", "EMPTY"), "empty"),
    (("--text", "TEXT", "--stride", "0"), "--stride 0"),
    (("--text", "TEXT", "-c", "8", "--stride", "9"), "--stride 9"),
    (("--text", "TEXT", "-c", "1"), "--ctx 1"),
    (("--text", "TEXT", "-c", "100000"), "--ctx 100000"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "t.txt").write_text(TEXT)
    args = [str(tmp_path / "empty.txt") if a == "EMPTY" else str(tmp_path / "t.txt") if a == "TEXT" else a
            for a in args]
    r = lmc("perplexity", *MODEL_ARGS, "--backend", "interp", *args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmc: error: ") and message in lines[0], r.stderr
