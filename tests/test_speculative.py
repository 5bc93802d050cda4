"""Speculative decoding (``runtime.speculative``): drafters, the acceptance
rule, the KV cache rolled back by position, and the ``verify`` entry.

Greedy: every drafter's output equals plain decoding's, token for token
(stories260K with each drafter on both backends, a second conversation turn
reusing the cache, and Gemma 3 270M and Qwen2.5-Coder-0.5B when available).
Sampling: chi-square tests that the first token decided by verification is
distributed as the target's own, for the rule alone (synthetic p and q,
where a wrong rule is shown to fail the same test) and end to end.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import runtime
from compiler.driver import load_model
from compiler.native import NativeOptions, compile_native
from runtime.cli import main as lmc
from runtime.models import gemma_path
from runtime.native import NativeExecutor
from runtime.sampling import Sampler, SamplerConfig
from runtime.speculative import (ONE_STREAM, Draft, LookupDrafter, Speculation, StreamSeq, accept,
                                lookup_continuation)
from shared_data import MODELS, QWEN, SMOLLM2, instruct_models, needs_shared

STORIES = str(MODELS / "stories260K.bin")
STORIES_Q8 = str(MODELS / "stories260K-q8.bin")
TOK = str(MODELS / "tok512.bin")
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside. "
          "Once upon a time, there was a little")


# --- prompt lookup ----------------------------------------------------------------------
def test_lookup_takes_the_longest_latest_match():
    h = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]
    # suffix [6, 7] occurred at 1 and 6: the latest (6) continues with 3, 4
    assert lookup_continuation(h, 2, 2) == [3, 4]
    # a longer suffix [8, 6, 7] has no earlier match; [6, 7] is taken
    assert lookup_continuation(h, 3, 3) == [3, 4, 8]
    assert lookup_continuation([1, 2, 3], 3, 4) == []          # nothing repeats
    assert lookup_continuation([4, 4], 2, 5) == [4]            # a run of one token
    assert lookup_continuation(h, 2, 0) == []
    assert LookupDrafter(2).propose([StreamSeq(h)], [1], ONE_STREAM)[0].tokens == [3]


# --- the acceptance rule --------------------------------------------------------------------
def _sampler(vocab: int, seed: int, temp: float = 1.0) -> Sampler:
    return Sampler(SamplerConfig(temperature=temp, top_p=1.0, seed=seed), vocab)


def test_greedy_accepts_while_the_draft_is_the_argmax():
    rows = np.array([[0, 5, 1, 0], [3, 0, 0, 0], [0, 0, 0, 9]], np.float32)
    s = _sampler(4, 1, temp=0.0)
    assert accept(rows, Draft([1, 0]), s, [2]) == (2, 3)       # both accepted, then the bonus token
    assert accept(rows, Draft([1, 2]), s, [2]) == (1, 0)       # the second is not the argmax: 0 instead
    assert accept(rows, Draft([3, 0]), s, [2]) == (0, 1)


def _first_tokens(rule, logits: np.ndarray, q: np.ndarray | None, draft_token: int, trials: int) -> np.ndarray:
    """Counts of the first emitted token over ``trials`` seeds; with q, the
    draft token is drawn from q (its own coins), else it is fixed (lookup)."""
    vocab = len(logits)
    counts = np.zeros(vocab, np.int64)
    rows = np.stack([logits, logits])
    draft_rng = np.random.default_rng(123)
    for seed in range(1, trials + 1):
        d = int(draft_rng.choice(vocab, p=q)) if q is not None else draft_token
        a, nxt = rule(rows, Draft([d], None if q is None else [q]), _sampler(vocab, seed), [])
        counts[d if a else nxt] += 1
    return counts


def _chi2_p(counts: np.ndarray, p: np.ndarray) -> float:
    return float(stats.chisquare(counts, p * counts.sum()).pvalue)


def _wrong_rule(rows, draft, sampler, history):
    """Accepts with min(1, q/p): the inverted ratio, a plausible slip."""
    p = sampler.probs(rows[0], history)
    d = draft.tokens[0]
    q_d = 1.0 if draft.q is None else draft.q[0][d]
    if sampler.uniform() < min(1.0, q_d / p[d]):
        return 1, d
    resid = np.maximum(p - (draft.q[0] if draft.q is not None else np.eye(len(p))[d]), 0)
    return 0, sampler.draw(resid if resid.sum() > 0 else p)


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_rejection_rule_keeps_the_target_distribution(drafter):
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05], np.float32))
    p = _sampler(6, 1).probs(logits)
    q = np.array([0.3, 0.1, 0.3, 0.1, 0.1, 0.1]) if drafter == "model" else None
    trials = 6000
    good = _first_tokens(accept, logits, q, 2, trials)
    assert _chi2_p(good, p) > 1e-3
    # the same test catches a wrong rule
    bad = _first_tokens(_wrong_rule, logits, q, 2, trials)
    assert _chi2_p(bad, p) < 1e-6


def test_probs_match_the_samplers_draws():
    """``Sampler.probs`` (what the rule compares) is the distribution
    ``sample`` draws from, top-k, top-p and min-p included."""
    logits = np.array([2.0, 1.5, 1.0, 0.2, -1.0, 0.9, 1.7, 0.0], np.float32)
    cfg = dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)
    p = Sampler(SamplerConfig(seed=1, **cfg), 8).probs(logits)
    s = Sampler(SamplerConfig(seed=7, **cfg), 8)
    counts = np.bincount([s.sample(logits) for _ in range(6000)], minlength=8)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p))
    keep = p > 0
    assert _chi2_p(counts[keep], p[keep] / p[keep].sum()) > 1e-3


# --- the verify entry ---------------------------------------------------------------------
@needs_shared
def test_verify_rows_are_decode_steps_bit_for_bit():
    m = load_model(STORIES, TOK)
    ex = NativeExecutor(compile_native(m, NativeOptions(ctx=128, verify=True)).artifact, m.path, 2)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, m.config.vocab_size, 30)]
    ex.prefill(ids[:12], 0)
    want = np.stack([ex.decode(t, 12 + i).copy() for i, t in enumerate(ids[12:])])
    ex.prefill(ids[:12], 0)
    for a in range(12, 30, 5):
        got = ex.verify(ids[a: a + 5], a)
        np.testing.assert_array_equal(got, want[a - 12: a - 12 + len(got)])


# --- greedy: identical to plain decoding ------------------------------------------------------
SPECS = {
    "lookup": lambda: Speculation(lookup=3),
    "lookup-short": lambda: Speculation(lookup=1, draft_max=2),
    "draft": lambda: Speculation(draft=STORIES_Q8, draft_tokenizer=TOK, draft_max=5),
    "draft-layers": lambda: Speculation(draft_layers=3),
    "draft-layers-1": lambda: Speculation(draft_layers=1, draft_max=4),
}


#: every variant natively; on the (slow) interpreter one variant of each drafter
CASES = [(name, "llvm") for name in SPECS] + [(name, "interp") for name in ("lookup", "draft", "draft-layers")]


@needs_shared
@pytest.mark.parametrize("name,backend", CASES)
def test_greedy_equals_plain_decoding_stories(name, backend):
    n = 120 if backend == "llvm" else 40
    plain = runtime.load(STORIES, TOK, threads=2, backend=backend)
    spec = runtime.load(STORIES, TOK, threads=2, backend=backend, speculation=SPECS[name]())
    for prompt in (PROMPT, "Tom had a red ball"):
        want = list(plain.generate(prompt, n, temperature=0.0, stop=False))
        got = list(spec.generate(prompt, n, temperature=0.0, stop=False))
        assert got == want
        st = spec.last_stats.as_dict()
        assert st["speculative"] == spec.speculation.kind
        assert 0 <= st["accepted"] <= st["drafted"] and st["generated_tokens"] == n
    assert st["drafted"] > 0 and st["verify_steps"] > 0
    assert len(set(want)) > 10   # a model that repeats one token would compare nothing
    # with a repetition penalty too (the rule samples with the history)
    kw = dict(temperature=0.0, repeat_penalty=1.3, stop=False)
    assert list(spec.generate(PROMPT, n, **kw)) == list(plain.generate(PROMPT, n, **kw))


@needs_shared
def test_drafts_get_accepted_and_rejected():
    """The q8 copy of the model drafts nearly always right; the first layer
    alone often wrong: both paths of the rule (and the rollback) run."""
    good = runtime.load(STORIES, TOK, threads=2, speculation=SPECS["draft"]())
    list(good.generate(PROMPT, 100, temperature=0.0, stop=False))
    assert good.last_stats.extra["acceptance_rate"] > 0.8
    poor = runtime.load(STORIES, TOK, threads=2, speculation=SPECS["draft-layers-1"]())
    list(poor.generate(PROMPT, 100, temperature=0.0, stop=False))
    st = poor.last_stats.extra
    assert st["accepted"] < st["drafted"]


@needs_shared
@pytest.mark.parametrize("name", ["lookup", "draft", "draft-layers"])
def test_complete_reuses_the_rolled_back_cache(name):
    """A second call reusing the KV cache (a chat's next turn) sees rows
    written by verify steps with rejected drafts: its output is still
    plain decoding's, and the cache holds exactly the accepted tokens."""
    plain = runtime.load(STORIES, TOK, threads=2)
    spec = runtime.load(STORIES, TOK, threads=2, speculation=SPECS[name]())
    outs = []
    for m in (plain, spec):
        first = m.complete(PROMPT, 60, temperature=0.0)
        ids = m.last_completion.prompt_ids + m.last_completion.generated_ids
        second = m.complete(ids + m.encode(" Then Tom", bos=False), 60, temperature=0.0)
        outs.append((first, second, m.last_completion.cached_tokens))
        assert m._kv == m.last_completion.prompt_ids + m.last_completion.generated_ids[:-1]
    assert outs[0] == outs[1]
    assert outs[1][2] > 0


# --- sampling end to end: the first verified token ----------------------------------------------
@needs_shared
def test_sampled_token_after_a_lookup_draft_has_the_targets_distribution():
    """Prompt lookup drafts the second token (the prompt repeats the first
    token's context); over many seeds, among runs whose first token is
    ``t1``, the second token is distributed as the target's p(. | prompt,
    t1). Lookup drafts are one-hot: accept with p(d), else draw from p
    without d."""
    temp = 1.5
    m = runtime.load(STORIES, TOK, threads=2, speculation=Speculation(lookup=2, draft_max=1))
    ids = m.encode("Lily saw a big dog. Lily saw a big")
    t1 = ids[ids.index(ids[-1]) + 1]   # " dog" ("dog." is three tokens): lookup then proposes its successor
    after = ids + [t1]
    assert lookup_continuation(after, 2, 1)   # the drafter has something to propose
    p = Sampler(SamplerConfig(temperature=temp), m.config.vocab_size).probs(m.logits(after)[-1], after)
    counts = np.zeros(m.config.vocab_size, np.int64)
    for seed in range(1, 6001):
        out = list(m.generate(ids, 3, temperature=temp, top_p=1.0, seed=seed, stop=False))
        if out[0] == t1:
            counts[out[1]] += 1
            assert m.last_stats.extra["drafted"] == 1   # the second token was a verified draft
    n = counts.sum()
    assert n > 300
    big = p * n >= 5   # chi-square bins: expected count >= 5, the rest pooled
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big], p[~big].sum())
    assert _chi2_p(obs, exp / exp.sum()) > 1e-3


# --- refusals ---------------------------------------------------------------------------------
@needs_shared
def test_refusals_are_one_line(capsys):
    assert lmc(["run", STORIES, "-z", TOK, "-p", "x", "--draft-layers", "5"]) == 2
    assert capsys.readouterr().err == "lmc: error: --draft-layers 5: the model has 5 layers (take 1 to 4)\n"
    assert lmc(["run", STORIES, "-z", TOK, "-p", "x", "--lookup", "2", "--draft-layers", "1"]) == 2
    assert "one drafter at a time" in capsys.readouterr().err
    assert lmc(["run", STORIES, "-z", TOK, "-p", "x", "--draft-max", "3"]) == 2
    assert "--draft-max goes with a drafter" in capsys.readouterr().err


def test_a_draft_of_another_vocabulary_is_refused(capsys):
    paths = instruct_models()
    assert lmc(["run", paths[SMOLLM2], "-p", "x", "--draft", paths[QWEN], "--backend", "interp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmc: error: --draft qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: not the target's "
                          "vocabulary") and err.count("\n") == 1


# --- the CLI --------------------------------------------------------------------------------------
@needs_shared
def test_run_json_reports_the_drafts(capsys):
    import json

    base = ["run", STORIES, "-z", TOK, "-p", PROMPT, "-n", "50", "--temp", "0", "--json"]
    assert lmc(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert lmc(base + ["--lookup", "3", "--draft-max", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["generated_ids"] == plain["generated_ids"]
    st = spec["stats"]
    assert st["speculative"] == "lookup" and st["draft_max"] == 4
    assert st["drafted"] > 0 and st["acceptance_rate"] == round(st["accepted"] / st["drafted"], 4)


@needs_shared
def test_bench_reports_the_speedup_and_identity(tmp_path):
    from runtime.cli.bench import format_table
    from runtime.tools.bench import run_bench

    r = run_bench(STORIES, TOK, 2, gen_tokens=40, runs=2, probe_bytes=16 << 20, probe_repeats=1,
                  speculation=Speculation(lookup=3), prompt_text=PROMPT)
    assert r["speculative_identical"] is True
    assert r["drafted"] > 0 and 0 <= r["acceptance_rate"] <= 1
    assert r["speculative_speedup"] > 0
    # the check's cost in decode steps, for each size up to the largest draft (draft-max 8 by default: 9 rows)
    assert r["decode_step_ms"] > 0
    assert set(r["verify_cost_steps"]) == {"2", "4", "8", "9"}
    assert all(v > 0 for v in r["verify_cost_steps"].values())
    table = format_table(r)
    assert "speed-up" in table and "a check of 8 rows" in table


# --- real models -------------------------------------------------------------------------------------
def _greedy_identical(path: str, spec: Speculation, prompt: str, n: int) -> dict:
    plain = runtime.load(path, threads=2, ctx=512)
    want = list(plain.generate(prompt, n, temperature=0.0, stop=False))
    del plain
    m = runtime.load(path, threads=2, ctx=512, speculation=spec)
    got = list(m.generate(prompt, n, temperature=0.0, stop=False))
    assert got == want
    return m.last_stats.extra


CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "Rewrite both functions with type hints:\n")


def _real_spec(path: str, spec: str, layers: int) -> Speculation:
    """``draft``: no smaller model shares these vocabularies here, so the
    draft is the same file with a q8 KV cache: a second model with its own
    cache and rounding, which agrees nearly always (Qwen: 37 of 37), so it
    checks the wiring and catch-up on a real model; rejections are checked
    on stories260K (test_drafts_get_accepted_and_rejected)."""
    if spec == "lookup":
        return Speculation(lookup=3)
    if spec == "draft":
        return Speculation(draft=runtime.load(path, threads=2, ctx=512, kv_type="q8"), draft_max=4)
    return Speculation(draft_layers=layers)


@pytest.mark.parametrize("spec", ["lookup", "draft-layers", "draft"])
def test_greedy_identical_gemma(spec):
    path = gemma_path()
    if path is None:
        pytest.skip("the Gemma 3 270M GGUF is not available")
    st = _greedy_identical(str(path), _real_spec(str(path), spec, 6), CODE, 48)
    assert st["drafted"] > 0


@pytest.mark.parametrize("spec", ["lookup", "draft-layers", "draft"])
def test_greedy_identical_qwen(spec):
    path = instruct_models()[QWEN]
    st = _greedy_identical(path, _real_spec(path, spec, 12), CODE, 48)
    assert st["drafted"] > 0


@needs_shared
def test_an_artifact_without_the_verify_entry_verifies_by_decode_steps():
    """``lmc compile`` artifacts have no verify entry: the drafts are then
    checked one decode step each, still plain decoding's numbers."""
    m = load_model(STORIES, TOK)
    ex = NativeExecutor(compile_native(m, NativeOptions(ctx=128)).artifact, m.path, 2)
    assert "verify" not in ex.entries
    ids = [int(i) for i in np.random.default_rng(3).integers(3, m.config.vocab_size, 20)]
    ex.prefill(ids[:12], 0)
    want = np.stack([ex.decode(t, 12 + i).copy() for i, t in enumerate(ids[12:])])
    np.testing.assert_array_equal(ex.verify(ids[12:], 12), want)
