"""Chat templates: HF's rendering, the named templates, choosing one, the
bounds on untrusted templates, the tokenizers' apply_chat_template, and the
real models' templates against llama.cpp."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontends.chat_template import (MAX_TEMPLATE_BYTES, NAMED_TEMPLATES, ChatTemplate, ChatTemplateError,
                                     resolve_chat_template)
import shared_data
from llamacpp_oracle import llamacpp_requests, model_with_vocab
from shared_data import MODELS, SHARED

SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "Hi"}
A1 = {"role": "assistant", "content": "Hello! How can I help?"}
U2 = {"role": "user", "content": "Tell me a joke."}
CONVERSATION = [SYS, U1, A1, U2]


def render(name: str, messages: list, gen: bool = True, **kw) -> str:
    return ChatTemplate(NAMED_TEMPLATES[name], name).render(messages, gen, **kw)


# --- the named templates, each against its family's format written out by hand ----------

def test_chatml():
    assert render("chatml", CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render("chatml", [U1], gen=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_llama2():
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render("llama2", CONVERSATION, **kw) == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! How can I help? </s>"
        "<s>[INST] Tell me a joke. [/INST]")
    assert render("llama2", [U1], **kw) == "<s>[INST] Hi [/INST]"
    assert render("llama2", [U1], gen=False, **kw) == "<s>[INST] Hi [/INST]"   # the reply follows [/INST]
    with pytest.raises(ChatTemplateError, match="alternate user and assistant"):
        render("llama2", [U1, U2], **kw)


def test_llama3():
    assert render("llama3", CONVERSATION, bos_token="<|begin_of_text|>") == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render("llama3", [{"role": "user", "content": "  padded\n"}], gen=False, bos_token="<|begin_of_text|>") \
        == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>"


def test_gemma():
    assert render("gemma", CONVERSATION, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert render("gemma", [U1], gen=False, bos_token="<bos>") == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    with pytest.raises(ChatTemplateError, match="alternate"):
        render("gemma", [A1])


def test_phi3():
    assert render("phi3", CONVERSATION) == (
        "<|system|>\nYou are terse.<|end|>\n"
        "<|user|>\nHi<|end|>\n"
        "<|assistant|>\nHello! How can I help?<|end|>\n"
        "<|user|>\nTell me a joke.<|end|>\n"
        "<|assistant|>\n")


def test_plain():
    assert render("plain", CONVERSATION) == (
        "System: You are terse.\n\nUser: Hi\n\nAssistant: Hello! How can I help?\n\n"
        "User: Tell me a joke.\n\nAssistant:")
    assert render("plain", [U1], gen=False) == "User: Hi\n\n"


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_a_conversation_renders_as_a_prefix_of_its_next_turn(name):
    """A chat keeps its KV cache and prefills only what is new: that needs the
    finished conversation to be a prefix of the next turn's prompt."""
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    history = [U1, A1]
    assert render(name, history + [U2], **kw).startswith(render(name, history, gen=False, **kw))


# --- rendering as Hugging Face does ---------------------------------------------------

def _hf_render(source: str, **variables) -> str:
    """transformers' _compile_jinja_template, without our bounds: the reference."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**variables)


_HF_FEATURES = r"""
{%- for m in messages -%}
  {%- if loop.index0 > 5 %}{% break %}{% endif -%}
  [{{ m.role | upper }}|{{ m.content | trim | replace('a', 'A') }}|{{ m | tojson(sort_keys=true) }}|{{ m | tojson(indent=2) }}]
  {{ '%s-%03d' | format(m.role, loop.index) ~ ' ' ~ ('{}:{}'.format(m.role, loop.length)) }} {{ m.content.split() | join(',') }}
{% endfor -%}
{%- set ns = namespace(n=0) %}{% for i in range(10) %}{% set ns.n = ns.n + i * 2 ** 3 %}{% endfor -%}
{{ ns.n }} {{ tools | tojson }} {{ bos_token }}{{ eos_token }} {{ add_generation_prompt }} {{ documents }} {{ extra_var }}
{% macro tag(x) %}<{{ x }}>{% endmacro %}{% set cap %}{{ tag('a') }}{{ tag('b') }}{% endset %}{{ cap }} {{ 'x' * 3 }} {{ [1, 2] + [3] }}
{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list }} {{ {'b': 1, 'a': 'é'} | tojson }}
"""


@pytest.mark.parametrize("source", [_HF_FEATURES] + [NAMED_TEMPLATES[n] for n in sorted(NAMED_TEMPLATES)])
def test_renders_as_hugging_face(source):
    """The bounds change nothing a well-behaved template renders."""
    msgs = [SYS, {"role": "user", "content": " a banana\nand  an apple "}, A1, {"role": "user", "content": "Grüße 🌧"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "☀"}}}]
    ours = ChatTemplate(source).render(msgs, True, bos_token="<s>", eos_token="</s>", tools=tools, extra_var=7)
    assert ours == _hf_render(source, messages=msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                              tools=tools, documents=None, extra_var=7)


def test_text_parts_are_joined_and_other_parts_refused():
    parts = {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    assert render("chatml", [parts], gen=False) == "<|im_start|>user\none\ntwo<|im_end|>\n"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(ChatTemplateError, match=r"message 0: content part 0: only text parts .* not 'image_url'"):
        render("chatml", [image])


def test_tool_calls_reach_the_template():
    t = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.tool_calls | default(none) | tojson }}\n{% endfor %}"
                     "{{ tools | length }}")
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    out = t.render([U1, call], tools=[{"name": "f"}])
    assert out == 'user:Hi:null\nassistant:None:[{"function": {"name": "f", "arguments": {"a": 1}}}]\n1'


def test_strftime_now_and_raise_exception():
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]) == time.strftime("%Y")
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate("{% if messages | length > 1 %}{{ raise_exception('Only one message, please.') }}{% endif %}",
                     "strict").render([U1, A1])
    assert str(e.value) == "chat template strict: Only one message, please."


# --- bad messages -------------------------------------------------------------------

@pytest.mark.parametrize("messages, problem", [
    ("Hi", "messages must be a list of {'role': ..., 'content': ...} dicts, not str"),
    ({"role": "user", "content": "Hi"}, "messages must be a list"),
    ([U1, "Hi"], "message 1 is a str, not a dict"),
    ([U1, {"content": "x"}], "message 1 has no 'role' string"),
    ([{"role": 3, "content": "x"}], "message 0 has no 'role' string"),
    ([{"role": "user"}], "message 0 (user) has no 'content'"),
    ([{"role": "user", "content": None}], "message 0 (user) has a NoneType 'content'"),
    ([U1, A1, {"role": "user", "content": 42}], "message 2 (user) has a int 'content'"),
])
def test_bad_messages(messages, problem):
    with pytest.raises(ChatTemplateError) as e:
        render("chatml", messages)
    assert str(e.value).startswith("chat template chatml: ") and problem in str(e.value)
    assert "\n" not in str(e.value)


# --- untrusted templates ----------------------------------------------------------------

def _fails(source: str, messages: list | None = None, **bounds) -> str:
    """Render a hostile template: one ChatTemplateError line, the trace function
    and the process as they were."""
    before = sys.gettrace()
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source, "evil", **bounds).render(messages if messages is not None else [U1])
    assert sys.gettrace() is before
    msg = str(e.value)
    assert msg.startswith("chat template evil: ") and "\n" not in msg and len(msg) < 400, msg
    assert render("chatml", [U1]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"   # still fine
    return msg


def test_syntax_error_names_the_line():
    msg = _fails("{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}")
    assert msg.startswith("chat template evil: line 3: ")
    assert _fails("{{ messages | no_such_filter }}").startswith("chat template evil: line 1: ")
    assert "line 2" in _fails("ok\n{% for %}")


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages[0].__class__.__subclasses__() }}",
    "{{ (messages | first).items.__self__.__class__ }}",
])
def test_unsafe_attributes_are_refused(source):
    assert "unsafe" in _fails(source)


@pytest.mark.parametrize("source", [
    "{{ messages.append(1) }}",
    "{% set x = messages[0].update({'role': 'x'}) %}",
    "{% set x = messages.pop() %}",
])
def test_mutation_is_refused(source):
    assert "unsafe" in _fails(source) or "not safely callable" in _fails(source)


@pytest.mark.parametrize("source", ["{% include 'x' %}", "{% import 'os' as os %}", "{% extends '/etc/passwd' %}",
                                    "{% from 'x' import y %}{{ y }}"])
def test_no_file_access(source):
    assert "cannot include, import or extend" in _fails(source)


# 3e8 iterations without output: ~10 s unbounded (so that these tests fail, not hang, without the bound)
LONG_LOOP = "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"


def test_a_long_loop_stops_at_the_time_bound():
    t = time.monotonic()
    assert _fails(LONG_LOOP, time_limit=0.3).endswith("line 1: rendering took longer than 0.3 s")
    assert time.monotonic() - t < 1.5
    t = time.monotonic()
    assert "longer than 2 s" in _fails(LONG_LOOP)   # the default
    assert 1.9 < time.monotonic() - t < 4
    explode = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(22) }}"
    assert "longer than 0.3 s" in _fails(explode, time_limit=0.3)


def test_the_time_bound_works_in_any_thread():
    errors: list[str] = []

    def chat() -> None:
        try:
            ChatTemplate(LONG_LOOP, "evil", time_limit=0.3).render([U1])
        except ChatTemplateError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=chat) for _ in range(3)]
    t = time.monotonic()
    for th in threads:
        th.start()
    assert render("chatml", [U1]).startswith("<|im_start|>user")   # this thread renders meanwhile
    for th in threads:
        th.join(10)
    assert time.monotonic() - t < 3
    assert errors == ["chat template evil: line 1: rendering took longer than 0.3 s"] * 3


@pytest.mark.parametrize("source, problem", [
    # predicted before the work: the huge value is never built
    ("{{ 'x' * 100000000 }}", "line 1: '*' would make a value of more than 1048576 characters"),
    ("{{ ['x'] * 10**7 }}", "'*' would make a value"),
    ("{{ 10 ** 4000000 }}", "a number of more than 1048576 digits"),
    ("{{ (10 ** 300000) * (10 ** 300000) * (10 ** 300000) * (10 ** 300000) }}", "a number of more than"),
    ("{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "'~' would make a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "'+' would make a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}",
     "|join was given a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% set ns.s = t %}{% endfor %}", "a captured block or macro would make a value"),
    ("{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
     "{% for i in range(24) %}{% set ns.s = twice(ns.s) %}{% endfor %}", "a captured block or macro would make"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(24) %}{% set ns.s = ns.s.replace('x', 'xx') %}{% endfor %}",
     "replace would make a value"),
    ("{{ 'x'.center(10**8) }}", "center() would make a value"),
    ("{{ 'x' | center(10**8) }}", "|center: an argument of 100000000 (more than 1048576)"),
    ("{{ ('x' * 10000).replace('', 'y' * 10000) }}", "replace would make a value"),
    ("{{ ('x' * 1000).translate({120: 'y' * 10000}) }}", "translate() would make a value"),
    ("{{ '%99999999d' % 1 }}", "a format width"),
    ("{{ '%*d' % (99999999, 1) }}", "a format width"),
    ("{{ '{:>99999999}'.format(1) }}", "a format width"),
    ("{{ '{:>{w}}'.format(1, w=99999999) }}", "a format width"),
    ("{{ '%099999999d' | format(1) }}", "a format width"),
    ("{{ ('a\n' * 10000) | indent(10000) }}", "|indent would make a value"),
    ("{{ ([[[[[[1]]]]]] * 1000) | tojson(indent=1000) }}", "|tojson would make a value"),
    ("{{ (('x' * 100 ~ ' ') * 100) | wordwrap(1, wrapstring='y' * 10000) }}", "|wordwrap would make a value"),
    ("{{ ([[1]] * 60000) | sum(start=[]) }}", "summing 60000 lists is too much work"),
    ("{{ lipsum(10**4) }}", "lipsum() would make a value"),
    # checked before str() builds the text of a structure
    ("{% set s = 'x' * 1000000 %}{{ [s, s] }}", "printing a value of more than"),
    ("{% set s = 'x' * 1000000 %}{{ [s, s] ~ '' }}", "'~' was given a value"),
    ("{% set s = 'x' * 1000000 %}{{ [s, s] | string }}", "|string was given a value"),
    # checked after: at most the bound was built
    ("{% set s = 'x' * 600000 %}{{ s.upper() ~ s }}", "'~' would make a value"),
    ("{{ ('ß' * 600000).upper() }}", "upper() made a value"),   # SS
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the output is longer than 1048576 characters"),
])
def test_size_bounds(source, problem):
    assert problem in _fails(source)


def test_memory_bound():
    if not Path("/proc/self/statm").exists():
        pytest.skip("the memory watch reads /proc/self/statm (Linux)")
    # each value is small enough, but the template keeps them all: a linked list of 500 strings of 1 MB
    keep = ("{% set ns = namespace(d=none) %}{% for i in range(500) %}"
            "{% set ns.d = {'prev': ns.d, 'v': 'x' * 1000000 ~ i} %}{% endfor %}")
    assert "rendering used more than 64 MiB of memory" in _fails(keep, memory_limit=64 << 20)


def test_output_and_time_bounds_are_per_template():
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "small", max_output_chars=10)
    assert t.render([{"role": "user", "content": "x" * 10}]) == "x" * 10
    with pytest.raises(ChatTemplateError, match="chat template small: the output is longer than 10 characters"):
        t.render([{"role": "user", "content": "x" * 11}])


def test_compiled_once():
    a, b = ChatTemplate(NAMED_TEMPLATES["chatml"]), ChatTemplate(NAMED_TEMPLATES["chatml"])
    assert a._template is b._template


# --- choosing a template ------------------------------------------------------------

def test_resolve_by_name_file_model_and_fallback(tmp_path):
    assert resolve_chat_template("gemma", "{{ 'model' }}", "m.gguf").name == "gemma"
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}")
    t = resolve_chat_template(str(f), "{{ 'model' }}", "m.gguf")
    assert t.name == str(f) and t.render([U1]) == "user> Hi\n"
    own = resolve_chat_template(None, "{{ 'own' }}", "m.gguf")
    assert own.name == "model" and own.render([U1]) == "own"
    assert resolve_chat_template(None, None, "m.gguf").name == "plain"
    assert resolve_chat_template("", "", "m.gguf").name == "plain"
    with pytest.raises(ChatTemplateError, match=r"chat template of m.gguf: line 1: "):
        resolve_chat_template(None, "{% if %}", "m.gguf")


def test_resolve_refuses_bad_files(tmp_path):
    def error(spec: str) -> str:
        with pytest.raises(ChatTemplateError) as e:
            resolve_chat_template(spec, None, "m.gguf")
        assert "\n" not in str(e.value)
        return str(e.value)

    missing = str(tmp_path / "nope.jinja")
    assert error(missing) == (f"chat template {missing}: no such file (and not a named template: "
                              "chatml, llama2, llama3, gemma, phi3, plain)")
    assert error(str(tmp_path)).endswith("is a directory, not a template file")
    big = tmp_path / "big.jinja"
    big.write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    assert error(str(big)).endswith("the file is larger than 1 MiB")
    binary = tmp_path / "bin.jinja"
    binary.write_bytes(b"ok \xff\xfe")
    assert error(str(binary)).endswith("not UTF-8 text (byte 3)")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ messages }\n")
    assert error(str(broken)).startswith(f"chat template {broken}: line 1: ")


# --- tokenizers ---------------------------------------------------------------------

def _gguf_with_template(dst: Path, template: str | None) -> Path:
    """A one-layer GGUF with TinyStories-656K's vocabulary and the given chat template."""
    src = MODELS / "TinyStories-656K-Q8_0.gguf"
    if not src.exists():
        pytest.skip("../shared (models and references) is absent")
    return model_with_vocab(src, dst, template)


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_gguf_and_qsf_tokenizers_carry_the_template(tmp_path):
    from frontends.convert import convert
    from frontends.loader import load_model

    src = _gguf_with_template(tmp_path / "tpl.gguf", TEMPLATE)
    tok = load_model(src).tokenizer
    assert tok.model_chat_template == TEMPLATE and tok.chat_template.name == "model"
    expected = ("<|start_story|><system>You are terse.<|end_story|><user>Hi<|end_story|>"   # the vocabulary's
                "<assistant>")                                                           # BOS/EOS texts
    assert tok.apply_chat_template([SYS, U1]) == expected
    assert tok.apply_chat_template([SYS, U1], add_generation_prompt=False) == expected[:-len("<assistant>")]
    assert tok.apply_chat_template([U1], bos_token="[B]") == "[B]<user>Hi<|end_story|><assistant>"

    out = tmp_path / "tpl.qsf"
    convert(str(src), str(out), "q8")   # every tokenizer.* key goes into the file
    q = load_model(out).tokenizer
    assert q.model_chat_template == TEMPLATE and q.apply_chat_template([SYS, U1]) == expected

    q.chat_template = resolve_chat_template("chatml", q.model_chat_template, q.name)   # --chat-template chatml
    assert q.apply_chat_template([U1]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    q.chat_template = None   # back to the model's own
    assert q.apply_chat_template([U1]) == "<|start_story|><user>Hi<|end_story|><assistant>"
    with pytest.raises(TypeError):
        q.chat_template = "chatml"


def test_a_model_without_a_template_chats_plain_and_a_broken_one_still_loads(tmp_path):
    from frontends.loader import load_model

    plain = load_model(_gguf_with_template(tmp_path / "none.gguf", None)).tokenizer
    assert plain.chat_template.name == "plain" and plain.apply_chat_template([U1]) == "User: Hi\n\nAssistant:"
    broken = load_model(_gguf_with_template(tmp_path / "broken.gguf", "{% for %}")).tokenizer
    assert broken.encode("Hi", bos=False)   # loading and tokenizing do not need the template
    with pytest.raises(ChatTemplateError, match=r"^chat template of broken.gguf: line 1: "):
        broken.apply_chat_template([U1])


def test_llama2c_tokenizer_chats_plain():
    from frontends.llama2c_tokenizer import Llama2cTokenizer

    if not (MODELS / "tok512.bin").exists():
        pytest.skip("../shared (models and references) is absent")
    tok = Llama2cTokenizer.from_file(MODELS / "tok512.bin")
    assert tok.apply_chat_template([SYS, U1]) == "System: You are terse.\n\nUser: Hi\n\nAssistant:"
    tok.chat_template = resolve_chat_template("llama2", None, tok.name)
    assert tok.apply_chat_template([U1]) == "<s>[INST] Hi [/INST]"   # "\n<s>\n" in the file, stripped


# --- the real models' templates against llama.cpp ---------------------------------------------

def _llama_cpp_prompts(model: str, cases: list[dict], prefill: bool) -> list[str]:
    """llama.cpp's /apply-template for each case (jinja on; ``prefill``: its
    prefill_assistant setting)."""
    return [r["prompt"] for r in llamacpp_requests(model, "/apply-template", cases,
                                                    params={"prefill_assistant": prefill})]


@pytest.fixture(scope="module")
def instruct_models() -> dict[str, str]:
    """SmolLM2-135M-Instruct (ChatML) and Qwen2.5-Coder-0.5B-Instruct (Qwen, with tools)."""
    pytest.importorskip("xllamacpp", reason="xllamacpp (llama.cpp bindings) is not installed")
    return shared_data.instruct_models()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter in einer Stadt ☀",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "days": {"type": "integer"}}, "required": ["city"]}}}]
TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}

# (messages, add_generation_prompt): one to four turns, with and without a
# system message, unicode, newlines, leading and trailing spaces, empty
# content, text parts. Not compared: an empty conversation (llama.cpp's
# template engine lets the Qwen template read messages[0] of an empty list,
# jinja2 and HF raise).
CONVERSATIONS: list[tuple[list[dict], bool]] = [
    ([U1], True),
    ([U1], False),
    ([SYS, {"role": "user", "content": "What is 2+2?"}], True),
    ([U1, A1, U2], True),
    ([SYS, U1, A1, U2], False),
    ([SYS, U1, A1, U2, {"role": "assistant", "content": "Why did the chicken cross the road?"},
      {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "To get to the other side."},
      {"role": "user", "content": "Ha."}], True),
    ([{"role": "user", "content": "Grüße aus Köln 🌧️ — 日本語も大丈夫? Ελληνικά, עברית, ½ ≠ 0.5"}], True),
    ([{"role": "system", "content": "Multi\nline\n\nsystem prompt\n"},
      {"role": "user", "content": "   leading spaces\n\nand\ttabs\n"},
      {"role": "assistant", "content": "  indented answer\n  on two lines  "}], False),
    ([{"role": "user", "content": ""}], True),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}],
     True),
    ([{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
     True),
    ([SYS, U1, A1], True),   # assistant last, with a generation prompt (llama.cpp's prefill is off here)
    ([{"role": "user", "content": "<|im_start|>not special<|im_end|> {{ not jinja }} {% raw %}"}], True),
    ([SYS], True),
]


def _compare(path: str, cases: list[tuple[list[dict], bool, list | None]]) -> None:
    from compiler.driver import load_model

    tok = load_model(path).tokenizer   # metadata only, no compilation
    theirs = _llama_cpp_prompts(path, [{"messages": m, "add_generation_prompt": g, **({"tools": t} if t else {})}
                                       for m, g, t in cases], prefill=False)
    for (messages, gen, tools), expected in zip(cases, theirs):
        kw = {"tools": tools} if tools else {}
        assert tok.apply_chat_template(messages, add_generation_prompt=gen, **kw) == expected, (messages, gen)


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"])
def test_model_templates_render_as_llama_cpp(instruct_models, name):
    """llama.cpp's /apply-template with jinja on and prefill_assistant off,
    which renders every conversation as given (see the prefill test for
    what it does by default when the assistant speaks last). Both models
    have add_bos false, so llama.cpp's stripping of a leading BOS text does
    not apply; we return HF's string in any case."""
    cases = [(m, g, None) for m, g in CONVERSATIONS]
    if name.startswith("qwen"):
        tool_turn = {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"}
        cases += [([{"role": "user", "content": "Weather in Paris?"}], True, TOOLS),
                  ([SYS, {"role": "user", "content": "Weather in Paris?"}, TOOL_CALL, tool_turn], True, TOOLS),
                  ([{"role": "user", "content": "Weather?"}, dict(TOOL_CALL, content="Let me check."), tool_turn,
                    dict(tool_turn, content="more")], False, TOOLS)]
    _compare(instruct_models[name], cases)


def test_llama_cpp_prefills_a_last_assistant_message(instruct_models):
    """What llama.cpp does by default (prefill_assistant on) when the last
    message is the assistant's: it renders the conversation before it with a
    generation prompt and appends that message's content without closing the
    turn (a reply to continue), whatever add_generation_prompt says. Our
    renderer has no such mode: the caller renders messages[:-1] and appends
    the text itself."""
    from compiler.driver import load_model

    path = instruct_models["SmolLM2-135M-Instruct.Q4_1.gguf"]
    tok = load_model(path).tokenizer
    convs = [[U1, A1], [SYS, U1, A1, U2, {"role": "assistant", "content": "Knock knock"}]]
    theirs = _llama_cpp_prompts(path, [{"messages": m, "add_generation_prompt": g} for m in convs
                                       for g in (True, False)], prefill=True)
    for i, m in enumerate(convs):
        continued = tok.apply_chat_template(m[:-1], add_generation_prompt=True) + m[-1]["content"]
        assert theirs[2 * i] == theirs[2 * i + 1] == continued
