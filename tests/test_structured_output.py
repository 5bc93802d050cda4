"""Structured output (``runtime.grammar``): generation constrained to a JSON
schema, a Lark grammar or a regex, enforced in the sampler.

The native mask against numpy's; the vocabulary bridge against our
tokenizer; errors as one line (CLI) or a 400 (HTTP) with the server still
up; and the suite of JSON schemas (``tests/data/json_schemas.json``: nested
objects, arrays with bounds, enums, anyOf/oneOf/allOf, $ref and recursion,
string formats and patterns, bounded numbers, additionalProperties) asked of
real models through the official ``openai`` client, greedy and at
temperature 1, every reply checked with the ``jsonschema`` package; the
same schemas through ``lmc run --json-schema``. A reply the model leaves
unfinished at max_tokens (it may loop inside what a schema allows: digits
of a fraction, an unbounded recursion) cannot be a complete value; it must
still be a prefix the grammar accepts, and such replies must be rare.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import llguidance
import numpy as np
import openai
import pytest
from pydantic import BaseModel

import runtime
from compiler.codegen.k_sampler import mask_logits
from runtime.grammar import ConstraintError, GrammarMatcher, json_schema, lark, regex
from runtime.grammar.vocabulary import ll_tokenizer
from runtime.models import BUNDLED_MODEL, BUNDLED_TOKENIZER
from serve_process import ROOT, serve
from shared_data import QWEN, SMOLLM2, instruct_models
from test_serve import metric

SCHEMAS = json.load(open(os.path.join(ROOT, "tests", "data", "json_schemas.json")))
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
MAX_TOKENS = 400


# --- pieces -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 31, 32, 33, 95, 4096, 49152, 151936])
def test_native_mask_equals_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    words = rng.integers(-2**31, 2**31, (n + 31) // 32, dtype=np.int64).astype(np.int32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)
    want = np.where(bits, x, np.float32(-np.inf)).astype(np.float32)
    got = mask_logits(x, words)
    np.testing.assert_array_equal(got, want)
    assert got is not x and np.isfinite(x).all()   # the caller's logits are left alone


def test_schema_check_names_what_it_cannot_enforce():
    for schema, part in (({"not": {"type": "string"}}, '["not"]'), ({"type": "array", "uniqueItems": True},
                                                                      '["uniqueItems"]')):
        with pytest.raises(ConstraintError, match="not supported") as e:
            json_schema(schema).grammar()
        assert part in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="not valid JSON"):
        json_schema("{")
    with pytest.raises(ConstraintError, match="unclosed character class"):
        regex("[a-").grammar()
    with pytest.raises(ConstraintError, match="unknown name"):
        lark("start: foo").grammar()
    with pytest.raises(ConstraintError, match="at most"):
        regex("a" * (300 << 10)).grammar()


@pytest.mark.parametrize("pattern,text", [("x", "x"), ("(yes|no)", None), ("a{3} b", "aaa b"), ("[0-9]{4}", None)])
def test_a_dummy_prefix_vocabulary_follows_a_regex(pattern, text):
    """The bundled llama2.c model (its tokenizer prepends " " to any text it
    encodes) through ``lmc run --regex``: the output matches, where a
    forced "x" once allowed the token " " and then refused it."""
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", BUNDLED_MODEL, "-z", BUNDLED_TOKENIZER, "-p", "hi",
                        "-n", "12", "-t", "1", "--regex", pattern], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip()
    assert out.startswith("hi"), out
    assert re.fullmatch(pattern, out[2:]), out
    assert text is None or out[2:] == text


@pytest.fixture(scope="module")
def smollm2() -> str:
    return instruct_models()[SMOLLM2]


@pytest.fixture(scope="module")
def smol(smollm2):
    return runtime.load(smollm2, ctx=1024, threads=2)


def test_vocabulary_bridge_spells_tokens_as_our_tokenizer(smol):
    tok = smol.tokenizer
    cfg = smol.config
    llt = ll_tokenizer(tok, tuple(cfg.stop_ids), cfg.vocab_size)
    assert llt.vocab_size == cfg.vocab_size
    for text in ('{"name": "Ava", "age": 25}', "  naïve café — 日本語\n", "def f(x):\n    return x"):
        ids = tok.encode(text, bos=False)
        assert llt.decode_bytes(ids) == text.encode()
    special = [i for i in range(len(tok)) if tok.is_special(i)]
    assert special and all(llt.is_special_token(i) for i in special)
    assert not any(llt.is_special_token(i) for i in tok.encode("plain words, no controls", bos=False))


def test_python_api_follows_each_kind(smol):
    schema = SCHEMAS["weather_report"]
    for temp in (0.0, 1.0):
        out = smol.chat([{"role": "user", "content": "Weather in Paris as JSON."}], 200, temperature=temp,
                        seed=5, grammar=json_schema(schema))
        jsonschema.validate(json.loads(out), schema)
        assert smol.last_completion.stop_reason == "stop"
    out = smol.complete("The year it happened was", 12, grammar=regex(r" [12][0-9]{3}\."))
    assert len(out) == 6 and out[1:5].isdigit() and smol.last_completion.stop_reason == "stop"
    out = smol.complete("Is the sky blue? Answer:", 8, temperature=1.0, seed=1, grammar=lark('start: " " ("yes" | "no")'))
    assert out in (" yes", " no")


def test_every_sampler_setting_keeps_to_the_grammar(smol):
    """top-k, top-p, min-p, penalties and temperature all draw from the masked
    logits: a regex that only digits satisfy, sampled hot."""
    kw = [dict(temperature=1.5, top_k=5), dict(temperature=1.2, top_p=0.5), dict(temperature=1.0, min_p=0.2),
          dict(temperature=1.0, repeat_penalty=1.3), dict(temperature=0.0)]
    for i, k in enumerate(kw):
        out = smol.complete("Write a story.", 10, seed=i, grammar=regex("[0-9]{1,6}"), **k)
        assert out.isdigit() and 1 <= len(out) <= 6, (k, out)


def test_matcher_masks_are_what_llguidance_allows(smol):
    """The mask the sampler applies is llguidance's own (its reference bitmask
    computation in numpy), step after step along a greedy generation."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok, cfg = smol.tokenizer, smol.config
    g = json_schema(SCHEMAS["person"])
    ours = GrammarMatcher(g, tok, tuple(cfg.stop_ids), cfg.vocab_size)
    ref = llguidance.LLMatcher(ll_tokenizer(tok, tuple(cfg.stop_ids), cfg.vocab_size), g.grammar())
    ids = smol.encode("A person:")
    ex = smol.executor
    ex.reset()
    logits = ex.prefill(ids, 0)
    bm = allocate_token_bitmask(1, cfg.vocab_size)
    for step in range(40):
        words = ours.mask().copy()
        fill_next_token_bitmask(ref, bm)
        np.testing.assert_array_equal(words, bm[0])
        t = int(np.argmax(mask_logits(logits, words)))
        ours.accept(t)
        assert ref.consume_token(t)
        if ours.done or t in cfg.stop_ids:
            break
        logits = ex.decode(t, len(ids) + step)


# --- through the interfaces -------------------------------------------------------------------
def _check(schema: dict, text: str, finish: str, llt, grammar: str) -> bool:
    """A finished reply validates; an unfinished one is a prefix the grammar accepts. True if finished."""
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        return True
    assert finish == "length"
    m = llguidance.LLMatcher(llt, grammar)
    assert m.consume_tokens(llt.tokenize_str(text)) or not m.is_error(), (text[:200], m.get_error())
    return False


def _suite(client, model_id: str, tok, cfg) -> list[tuple[str, float, bool]]:
    llt = ll_tokenizer(tok, tuple(cfg.stop_ids), cfg.vocab_size)

    def one(job):
        name, temp = job
        schema = SCHEMAS[name]
        r = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": f"Reply with a JSON value for: {name.replace('_', ' ')}."}],
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            temperature=temp, seed=7, max_tokens=MAX_TOKENS)
        ch = r.choices[0]
        return name, temp, _check(schema, ch.message.content, ch.finish_reason, llt, json_schema(schema).grammar())

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, [(n, t) for t in (0.0, 1.0) for n in SCHEMAS]))


@pytest.mark.parametrize("which", [SMOLLM2, QWEN])
def test_schema_suite_through_the_openai_client(which, smollm2):
    path = instruct_models()[which]
    tok = runtime.load_tokenizer(path)
    with serve(path, "-t", "2", "-c", "2048", "--parallel", "4") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=900)
        model_id = client.models.list().data[0].id
        from frontends.loader import load_model

        cfg = load_model(path).config
        results = _suite(client, model_id, tok, cfg)
        finished = sum(ok for _, _, ok in results)
        unfinished = [(n, t) for n, t, ok in results if not ok]
        assert len(results) == 2 * len(SCHEMAS) >= 60
        assert finished >= len(results) - 3, unfinished
        assert metric(s.url, "lmc_grammar_masked_steps_total") > 0

        class Person(BaseModel):
            name: str
            age: int
            city: str

        r = client.chat.completions.parse(model=model_id, messages=[{"role": "user", "content": "Invent a person."}],
                                          response_format=Person, temperature=0)
        assert isinstance(r.choices[0].message.parsed, Person)
        r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Any JSON object."}],
                                           response_format={"type": "json_object"}, max_tokens=MAX_TOKENS,
                                           temperature=0)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Yes or no?"}],
                                                extra_body={"regex": "(yes|no)"}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")


def test_bad_constraints_are_400s_and_the_server_stays_up(smollm2):
    with serve(smollm2, "-t", "1", "--parallel", "2") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        m = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "hi"}]
        cases = [
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {}}}}),
             '["not"]'),
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}),
             "Invalid type"),
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "a"}}), "json_schema"),
            (dict(response_format={"type": "xml"}), "xml"),
            (dict(extra_body={"grammar": "start: foo"}), "unknown name"),
            (dict(extra_body={"regex": "[a-"}), "unclosed"),
            (dict(extra_body={"regex": "a", "grammar": "start: \"a\""}), "one constraint"),
            # past llguidance's lexer limits: was a 200 with empty content
            (dict(extra_body={"regex": "a{99999999}"}), "cannot be enforced"),
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                                 for i in range(2000)}}}}), "at most"),
        ]
        for kw, part in cases:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=m, messages=msgs, max_tokens=4, **kw)
            assert part in str(e.value)
        r = client.chat.completions.create(model=m, messages=msgs, max_tokens=4)
        assert r.choices[0].message.content is not None
        assert metric(s.url, 'lmc_http_errors_total{status="400"}') >= len(cases)


#: an ambiguous Lark grammar (every split of a run of "a"s parses): llguidance's Earley rows grow with
#: the output until one passes its items limit (2,000) after at most 47 "a"s, though the grammar compiles
#: and its first token fits
AMBIGUOUS = "start: x0\n" + "\n".join(f'x{i}: x{i + 1} x{i + 1} | x{i + 1} x{i + 1} x{i + 1} | "a"'
                                       for i in range(12)) + '\nx12: "a"'


def test_a_grammar_failing_mid_generation_is_an_error_not_a_stop(smollm2):
    """A grammar its parser cannot follow to the end is a 400 naming it (the
    stream: an error event), not a reply cut short and called ``stop``;
    other requests go on and the server stays up."""
    with serve(smollm2, "-t", "1", "--parallel", "2") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        m = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Write many a letters."}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=m, messages=msgs, max_tokens=200, temperature=0,
                                           extra_body={"grammar": AMBIGUOUS})
        body = e.value.body
        assert body["param"] == "grammar", body
        assert "cannot be enforced past" in body["message"] and "max is 2000" in body["message"], body
        got = ""
        with pytest.raises(openai.APIError) as e:
            for chunk in client.chat.completions.create(model=m, messages=msgs, max_tokens=200, temperature=0,
                                                        stream=True, extra_body={"grammar": AMBIGUOUS}):
                got += chunk.choices[0].delta.content or ""
        assert "cannot be enforced past" in str(e.value)
        assert re.fullmatch("a+", got), got    # what it sent before, all under the grammar
        # the same grammar with room for few tokens ends by length, a plain grammar by stop
        r = client.chat.completions.create(model=m, messages=msgs, max_tokens=3, temperature=0,
                                           extra_body={"grammar": AMBIGUOUS})
        assert r.choices[0].finish_reason == "length" and re.fullmatch("a+", r.choices[0].message.content)
        r = client.chat.completions.create(model=m, messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"regex": "a{3}"})
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("aaa", "stop")
        assert metric(s.url, 'lmc_http_errors_total{status="400"}') >= 1


def test_a_chat_turn_a_grammar_ended_says_so(smol):
    """Python API: the stream raises ConstraintError, the reply stays as far
    as it got and the turn's stop reason is ``grammar``; the next turn runs."""
    from runtime.chat import ChatSession, ChatSettings

    s = ChatSession(smol, None, ChatSettings(max_new_tokens=200, sampling={"temperature": 0.0}, grammar=lark(AMBIGUOUS)))
    got = ""
    with pytest.raises(ConstraintError, match="does not fit the grammar"):
        for piece in s.send("Write many a letters."):
            got += piece
    assert re.fullmatch("a+", got) and s.messages[-1]["content"] == got
    assert s.turns[-1].stop_reason == "grammar"
    s.settings.grammar = regex("a{3}")
    assert "".join(s.send("Again.")) == "aaa" and s.turns[-1].stop_reason in ("eos", "stop")


def test_lmc_run_and_chat_say_which_flag_failed_mid_generation(smollm2, tmp_path):
    """``lmc run`` and ``lmc chat`` (piped, and answering --messages): the
    text so far on its line, then one line naming --grammar, exit 2."""
    g = tmp_path / "ambiguous.lark"
    g.write_text(AMBIGUOUS)
    m = tmp_path / "messages.json"
    m.write_text(json.dumps([{"role": "user", "content": "Write many a letters."}]))
    lmc = [sys.executable, "-m", "runtime.cli"]
    flags = ["--grammar", str(g), "-n", "200", "--temp", "0", "-t", "1"]
    for cmd, stdin, out in ((["run", smollm2, "-p", "Write a"], None, "Write aa+\n"),
                            (["chat", smollm2], "Write many a letters.\n", "aa+\n"),
                            (["chat", smollm2, "--messages", str(m)], None, "aa+\n"),
                            (["chat", smollm2, "--messages", str(m), "--json"], None, "")):
        r = subprocess.run(lmc + cmd + flags, input=stdin, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
        assert r.returncode == 2, (cmd, r.stderr[-2000:])
        assert re.fullmatch(out, r.stdout), (cmd, r.stdout)
        assert r.stderr.startswith("lmc: error: --grammar: cannot be enforced past ") and \
            r.stderr.count("\n") == 1, (cmd, r.stderr)


def test_lmc_run_json_schema_suite(smollm2, tmp_path):
    """Every schema through ``lmc run`` (the chat turn written out), greedy;
    a bad flag is one line and exit 2."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    tok = runtime.load_tokenizer(smollm2)
    from frontends.loader import load_model

    cfg = load_model(smollm2).config
    llt = ll_tokenizer(tok, tuple(cfg.stop_ids), cfg.vocab_size)
    done = 0
    for name, schema in SCHEMAS.items():
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(schema))
        prompt = f"<|im_start|>user\nA JSON value for: {name}<|im_end|>\n<|im_start|>assistant\n"
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", smollm2, "-p", prompt, "--special", "--json",
                            "--json-schema", str(f), "--temp", "0", "-n", str(MAX_TOKENS), "-t", "2"],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-1000:]
        out = json.loads(r.stdout)
        text = tok.decode(out["generated_ids"])
        done += _check(schema, text, "stop" if out["stop_reason"] in ("stop", "eos") else "length", llt,
                       json_schema(schema).grammar())
    assert done >= len(SCHEMAS) - 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "array", "uniqueItems": true}')
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", smollm2, "-p", "x", "--json-schema", str(bad)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("lmc: error: --json-schema: ") and r.stderr.count("\n") == 1
    assert '["uniqueItems"]' in r.stderr


def test_speculation_keeps_the_constrained_output(smollm2, smol):
    """Drafts are cut where the grammar refuses them and verified under the
    mask: greedy output with a grammar is the same with and without a
    drafter (prompt lookup, whose drafts come from the schema's own keys
    in the prompt), and the drafter did draft."""
    from runtime.speculative import Speculation

    spec = runtime.load(smollm2, ctx=1024, threads=2, speculation=Speculation(lookup=2))
    drafted = 0
    for name in ("weather_report", "array_of_objects", "nested"):
        schema = SCHEMAS[name]
        msgs = [{"role": "user", "content": f"Fill in this JSON schema with an example: {json.dumps(schema)}"}]
        want = smol.chat(msgs, 200, grammar=json_schema(schema))
        got = spec.chat(msgs, 200, grammar=json_schema(schema))
        assert got == want and spec.last_completion.stop_reason == smol.last_completion.stop_reason
        drafted += spec.last_completion.stats.extra.get("drafted", 0)
    assert drafted > 0


def test_served_speculation_keeps_the_constrained_output(smollm2):
    """The engine's drafts (prompt lookup, per request) are cut by each
    sequence's grammar and verified under its mask: greedy replies equal
    those without drafting, requests sent together."""
    with serve(smollm2, "-t", "2", "--parallel", "4") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=600)
        m = client.models.list().data[0].id

        def ask(job):
            name, lookup = job
            schema = SCHEMAS[name]
            r = client.chat.completions.create(
                model=m, temperature=0, max_tokens=300,
                messages=[{"role": "user", "content": f"Fill in this JSON schema with an example: {json.dumps(schema)}"}],
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
                extra_body={"lookup": lookup} if lookup else {"draft_max": 0})
            return r.choices[0].message.content, r.choices[0].finish_reason

        names = ["weather_report", "array_of_objects", "nested", "person"]
        with ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(ask, [(n, 0) for n in names]))
            drafted = list(pool.map(ask, [(n, 2) for n in names]))
        assert drafted == plain
        assert metric(s.url, "lmc_draft_tokens_total") > 0


def test_bench_measures_the_schema_beside_llamacpps(tmp_path):
    """``lmc bench --json-schema --compare-llamacpp``: both loops of ours
    (plain and under the schema, taking turns after the probe) and
    llama.cpp's server generating under the same schema, in one report;
    the ratios are what their figures say. Speed itself is not asserted."""
    pytest.importorskip("xllamacpp", reason="llama.cpp's server is the xllamacpp package (the test extra)")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["person"]))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "LMC_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", instruct_models()[SMOLLM2], "--runs", "2",
                        "--gen-tokens", "24", "--probe-mb", "64", "--json-schema", str(schema), "--prompt-file",
                        str(prompt), "--compare-llamacpp", "--json"], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["constraint"] == "json_schema" and got["constrained_loop_tok_s"] > 0
    assert got["constrained_vs_plain"] > 0 and got["constrained_sample_ms_per_token"] > 0
    ll = got["llamacpp"]
    assert "error" not in ll, ll
    assert ll["constrained_decode_tok_s"] > 0 and 0 < ll["constrained_tokens"] <= 24
    assert got["constrained_vs_llamacpp"] == pytest.approx(
        got["constrained_loop_tok_s"] / ll["constrained_decode_tok_s"], rel=1e-4)
