"""Tool calls (``runtime.tool_calls``): each format's reader on replies as
models write them, the format chosen from a template's source, the
grammar of a required or named call, and, through ``lmc serve`` and the
official ``openai`` client on Qwen2.5-Coder: tool_choice auto, required,
a named function and none, a parallel call, streamed call deltas, the
tool's result fed back for a final answer, an agent loop, and bad tools as
400s. Every call's arguments are checked against the function's declared
parameters with ``jsonschema``."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import llguidance
import openai
import pytest

from runtime import tool_calls as tc
from serve_process import serve
from shared_data import QWEN, instruct_models

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"], "additionalProperties": False}}},
]
#: one worker runs them all, so the Qwen server is started once
pytestmark = pytest.mark.xdist_group("tool_calls")

PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FMT = {f.name: f for f in tc.FORMATS}


# --- readers ------------------------------------------------------------------------------------
def test_hermes_reader():
    read = FMT["hermes"].parse
    content, calls = read('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                          '</tool_call>\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+1"}}\n'
                          '</tool_call>')
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("calculate", {"expression": "1+1"})]
    _, calls = read('<tool_call>\n{"name": "f", "arguments": {"a": 1}}')          # cut before its closing tag
    assert calls[0].arguments == {"a": 1}
    _, calls = read('```json\n{"name": "f", "arguments": {"a": [1, 2]}}\n```')    # in a fence (llama.cpp takes it)
    assert calls[0].name == "f"
    _, calls = read('{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {"x": "y"}}')
    assert [c.name for c in calls] == ["f", "g"]
    content, calls = read('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g"')
    assert content == "" and [c.name for c in calls] == ["f"]                    # a call cut by max_tokens
    assert read("The weather is fine.") is None
    assert read('<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>') is None
    assert tc.read_calls(FMT["hermes"], "no call here") == ("no call here", [])


def test_llama3_mistral_and_generic_readers():
    _, calls = FMT["llama3"].parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert (calls[0].name, calls[0].arguments) == ("get_weather", {"city": "Oslo"})
    assert FMT["llama3"].parse('{"name": "f", "parameters": {}} and more') is None
    _, calls = FMT["mistral"].parse('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert [c.name for c in calls] == ["f", "g"]
    _, calls = FMT["generic"].parse('{"tool_calls": [{"name": "f", "arguments": {"q": "x"}}]}')
    assert calls[0].arguments == {"q": "x"}
    assert FMT["generic"].parse('{"answer": 42}') is None
    content, calls = tc.read_calls(FMT["mistral"], '[TOOL_CALLS][{"name": "f", "arguments": {}}, '
                                                   '{"name": "g", "arguments": {}}]', parallel=False)
    assert [c.name for c in calls] == ["f"] and content is None
    call = calls[0].openai(0)
    assert call["type"] == "function" and call["index"] == 0 and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {}


def test_format_follows_the_template():
    qwen = instruct_models()[QWEN]
    import runtime

    assert tc.format_for(runtime.load_tokenizer(qwen).chat_template.source).name == "hermes"
    assert tc.format_for("{% if tools %}{{ '<|python_tag|>' }}{% endif %}").name == "llama3"
    assert tc.format_for("{% for t in tools %}[AVAILABLE_TOOLS]{% endfor %}[TOOL_CALLS]").name == "mistral"
    assert tc.format_for("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"


@pytest.mark.parametrize("fmt", [f.name for f in tc.FORMATS])
@pytest.mark.parametrize("only,parallel", [(None, True), (None, False), ("calculate", True)])
def test_call_grammars_compile(fmt, only, parallel):
    for lazy in (False, True):
        g = tc.call_grammar(FMT[fmt], TOOLS, only, parallel, special=lambda text: False, lazy=lazy)
        bad, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.LLMatcher.grammar_from_lark(g))
        assert not bad, msgs
        assert ("get_weather" in g) == (only is None) and ("FREE" in g) == lazy


def test_auto_grammar_binds_calls_written_without_their_tag():
    """Under ``auto`` (Hermes), free text may not open with JSON: a reply
    that opens with an object or a ```json fence is held to the calls'
    schemas, as llama.cpp's Hermes grammar triggers on ``{"name"``; text,
    and text then a tagged call, stay free."""
    import runtime
    from runtime.grammar import GrammarMatcher, lark

    tok = runtime.load_tokenizer(instruct_models()[QWEN])
    special = lambda text: len(tok.encode(text, special=True)) == 1   # noqa: E731
    g = lark(tc.call_grammar(FMT["hermes"], TOOLS, None, True, special=special, lazy=True))

    def takes(text: str) -> bool:
        ids = tok.encode(text, special=True)
        return GrammarMatcher(g, tok, (tok.eos_id,), tok.vocab_size).valid_prefix(ids) == len(ids)

    assert takes("It is sunny, {maybe}.")
    assert takes('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert takes('{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "calculate", "arguments": '
                 '{"expression": "1+1"}}')
    assert takes('```json\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n```')
    assert not takes('{"name": "get_time"')                                          # no such function
    assert not takes('{"name": "get_weather", "arguments": {"town": "Paris"}}')       # not its parameters
    assert not takes('{"answer": 42}')


def test_bad_tools_and_choices():
    with pytest.raises(tc.ToolCallError, match="non-empty list"):
        tc.check_tools([])
    with pytest.raises(tc.ToolCallError, match="each tool"):
        tc.check_tools([{"type": "function"}])
    with pytest.raises(tc.ToolCallError, match="two tools"):
        tc.check_tools(TOOLS + TOOLS[:1])
    with pytest.raises(tc.ToolCallError, match="not among the tools"):
        tc.chosen(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(tc.ToolCallError, match="tool_choice must be"):
        tc.chosen(TOOLS, "always")
    assert tc.chosen(TOOLS, None) == ("auto", None)


# --- through lmc serve ----------------------------------------------------------------------------
def _valid(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, PARAMS[c.function.name])
        assert c.id and c.type == "function"
        out.append((c.function.name, args))
    return out


@pytest.fixture(scope="module")
def qwen_client():
    with serve(instruct_models()[QWEN], "-t", "2", "-c", "2048", "--parallel", "2") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=600)
        yield client, client.models.list().data[0].id


WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


def test_tool_choices(qwen_client):
    client, model = qwen_client
    kw = dict(model=model, tools=TOOLS, temperature=0, max_tokens=160)
    r = client.chat.completions.create(messages=WEATHER, tool_choice="required", parallel_tool_calls=False, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(_valid(ch.message.tool_calls)) == 1
    r = client.chat.completions.create(messages=WEATHER, **kw,
                                       tool_choice={"type": "function", "function": {"name": "calculate"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and [n for n, _ in _valid(ch.message.tool_calls)] == ["calculate"]
    r = client.chat.completions.create(messages=WEATHER, tool_choice="none", **kw)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = client.chat.completions.create(messages=WEATHER, tool_choice="auto", **kw)
    ch = r.choices[0]
    if ch.message.tool_calls:     # auto: the model decides; a call it makes must parse and validate
        assert ch.finish_reason == "tool_calls" and _valid(ch.message.tool_calls)


def test_parallel_call_and_stream(qwen_client):
    client, model = qwen_client
    r = client.chat.completions.create(model=model, tools=TOOLS, tool_choice="required", temperature=0,
                                       max_tokens=200,
                                       messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}])
    calls = _valid(r.choices[0].message.tool_calls)
    assert len(calls) >= 2 and calls[0][0] == "get_weather" and calls[1][0] == "get_weather"
    assert {calls[0][1]["city"], calls[1][1]["city"]} == {"Paris", "Rome"}
    stream = client.chat.completions.create(model=model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=160, messages=WEATHER, stream=True)
    deltas, finish, text = [], None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        text += d.content or ""
        deltas += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in text
    assert [d.index for d in deltas] == [0] and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), PARAMS["get_weather"])


def test_tool_result_round_trip_and_agent_loop(qwen_client):
    """An agent loop as the openai client's users write it: call, run the
    tool, send its result (role tool), until the model answers in text."""
    client, model = qwen_client

    def run_tool(name: str, args: dict) -> str:
        if name == "get_weather":
            return json.dumps({"city": args["city"], "temp_c": 18, "sky": "sunny"})
        return json.dumps({"error": "unknown"})

    messages = [{"role": "system", "content": "You are a helpful assistant. After a tool result, answer the user "
                                              "in one sentence."}, *WEATHER]
    for turn in range(3):
        choice = "required" if turn == 0 else "none"
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, temperature=0, max_tokens=120)
        msg = r.choices[0].message
        if not msg.tool_calls:
            break
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            args = _valid([call])[0][1]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name, args)})
    assert turn == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert "18" in (msg.content or "") or "sunny" in (msg.content or "").lower()


def test_bad_tool_requests_are_400s(qwen_client):
    client, model = qwen_client
    for kw, part in ((dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
                     (dict(tools=[{"type": "function"}]), "each tool"),
                     (dict(tool_choice="required"), "needs tools"),
                     (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                      "constrains the reply"),
                     (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                           tool_choice="required"), '["not"]')):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=WEATHER, max_tokens=8, **kw)
        assert part in str(e.value)
    r = client.chat.completions.create(model=model, messages=WEATHER, max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_lmc_chat_shows_a_tool_call(tmp_path):
    """``lmc chat --tools``: the reply's call is shown plainly and, with
    --json, as OpenAI's tool_calls; a bad tools file is one line, exit 2."""
    import os
    import subprocess
    import sys

    from serve_process import ROOT

    tools, msgs = tmp_path / "tools.json", tmp_path / "m.json"
    tools.write_text(json.dumps(TOOLS))
    msgs.write_text(json.dumps(WEATHER))
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "runtime.cli", "chat", instruct_models()[QWEN], "--messages", str(msgs), "--tools",
           str(tools), "--temp", "0", "-t", "2", "-n", "120"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-1000:]
    shown = [ln for ln in r.stdout.splitlines() if ln.startswith("[tool call] ")]
    assert shown and shown[0].startswith("[tool call] get_weather {")
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=600)
    calls = json.loads(r.stdout)["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), PARAMS["get_weather"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    r = subprocess.run(cmd[:-6] + ["--tools", str(bad)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and r.stderr.startswith("lmc: error: --tools ") and r.stderr.count("\n") == 1


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_loop(qwen_client, streamed):
    """The openai-agents SDK's own loop (``Runner``, ``function_tool``,
    ``OpenAIChatCompletionsModel``) against lmc serve: the SDK sends the
    tools, runs the Python functions on the calls we return, feeds their
    results back and ends on the model's answer. Tools stay enabled until
    one has been used (``is_enabled``), so the 0.5B model answers rather
    than calling again."""
    agents = pytest.importorskip("agents", reason="the Agents SDK is openai-agents (the test extra)")
    client, model = qwen_client
    agents.set_tracing_disabled(True)
    ran: list[tuple[str, dict]] = []

    def first_round(ctx, agent) -> bool:
        return not ran

    @agents.function_tool(is_enabled=first_round)
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(("get_weather", {"city": city}))
        return json.dumps({"city": city, "temp_c": 18, "sky": "sunny"})

    @agents.function_tool(is_enabled=first_round)
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        ran.append(("calculate", {"expression": expression}))
        return "391"

    aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0, timeout=600)
    agent = agents.Agent(
        name="assistant", instructions="You are a helpful assistant. After a tool result, answer the user in one "
                                       "sentence.",
        tools=[get_weather, calculate], model=agents.OpenAIChatCompletionsModel(model=model, openai_client=aclient),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=160, parallel_tool_calls=False))
    question = "What is the weather in Paris?"
    if streamed:
        async def run():
            r = agents.Runner.run_streamed(agent, question, max_turns=4)
            kinds = [e.item.type async for e in r.stream_events() if e.type == "run_item_stream_event"]
            return r, kinds
        result, kinds = asyncio.run(run())
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    else:
        result = agents.Runner.run_sync(agent, question, max_turns=4)
    assert ran == [("get_weather", {"city": "Paris"})]
    jsonschema.validate(ran[0][1], PARAMS["get_weather"])
    answer = result.final_output
    assert isinstance(answer, str) and "<tool_call>" not in answer and not answer.lstrip().startswith("{")
    assert "18" in answer or "sunny" in answer.lower(), answer
