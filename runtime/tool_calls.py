"""Tool calls: how a model's reply spells a function call, chosen from its
chat template as llama.cpp chooses (``common/chat.cpp``), read back into
OpenAI's ``tool_calls``, and written as a grammar when a call is required.

A format is one row of ``FORMATS``: how to recognise its template, the
text that opens a call (the stream holds text back from there), how to
read calls out of a reply, and the Lark grammar (llguidance's dialect, its
``%json`` taking each function's parameter schema) of one or more calls,
used for ``tool_choice`` ``required`` and a named function, so such a call
always parses and its arguments validate:

- ``hermes`` (Qwen 2.5, Hermes 2/3): ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>``,
  one block per call;
- ``llama3`` (Llama 3.1-3.3): a reply that is one JSON object ``{"name": .., "parameters": {..}}``,
  after ``<|python_tag|>`` or not;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": .., "arguments": {..}}``;
- ``generic`` (a template that renders no tools): the tools and this
  format are described in a system message, and the reply is
  ``{"tool_calls": [{"name": .., "arguments": {..}}]}`` or plain text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .grammar.constraint import JSON_OPTIONS


class ToolCallError(ValueError):
    """Tools or a tool choice that cannot be honoured (the message says why)."""


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True)
class ToolFormat:
    name: str
    #: does a chat template's source use this format
    detect: Callable[[str], bool]
    #: texts (or control tokens' texts) that may open a call in a reply
    openers: tuple[str, ...]
    #: reply text -> (the text around the calls, the calls), or None when the reply holds no well-formed call
    parse: Callable[[str], "tuple[str, list[ToolCall]] | None"]
    #: Lark for one call whose JSON body follows the schema given
    call_rule: Callable[[str], str]
    #: Lark joining n >= 1 calls (``calls``), one (``call``)
    many_rule: Callable[[bool], str]
    #: whether the template renders the tools itself (else a system message describes them)
    template_renders_tools: bool = True
    #: under ``auto``, a reply that opens with a JSON object (or a ```json fence) is a call written
    #: without its opener, and is bound by the calls' grammar too (llama.cpp's Hermes triggers)
    bare_calls: bool = False


def _json_objects(text: str) -> list[tuple[int, int, Any]]:
    """The JSON values that start at each '{' or '[' of text and parse: (start, end, value)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            break
        try:
            v, end = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        out.append((j, end, v))
        i = end
    return out


def _call(v: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(v, dict) or not isinstance(v.get("name"), str):
        return None
    args = v.get(args_key, v.get("arguments", v.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(v["name"], args)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    calls, rest, last = [], [], 0
    for m in _HERMES.finditer(text):
        objs = _json_objects(m.group(1))
        c = _call(objs[0][2]) if len(objs) == 1 else None
        if c is None:
            return None
        calls.append(c)
        rest.append(text[last:m.start()])
        last = m.end()
    if not calls:
        # a block cut before its closing tag (the reply ended on a stop token), or, as llama.cpp's
        # Hermes parser also takes, the call in a ```json fence or as the whole reply
        i = text.find("<tool_call>")
        if i >= 0:
            objs = _json_objects(text[i + len("<tool_call>"):])
            c = _call(objs[0][2]) if len(objs) == 1 else None
            return (text[:i].strip(), [c]) if c is not None else None
        fence = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*(?:```\s*)?", text, re.S)
        body = (fence.group(1) if fence else text).strip()
        objs, end = [], 0
        for a, b, v in _json_objects(body):   # the objects that follow each other from the start
            if body[end:a].strip():
                break
            objs.append(v)
            end = b
        # what follows them is nothing, or a last call cut short (max_tokens), not content
        if not objs or (body[end:].strip() and not body[end:].lstrip().startswith("{")):
            return None
        if not all(isinstance(v, dict) and "arguments" in v for v in objs):
            return None
        calls = [_call(v) for v in objs]
        return ("", calls) if all(calls) else None
    tail = text[last:]
    if "<tool_call>" in tail:   # a last call cut short (max_tokens): not content
        tail = tail[:tail.index("<tool_call>")]
    rest.append(tail)
    return "".join(rest).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    body = text.split("<|python_tag|>", 1)[-1].strip()
    objs = _json_objects(body)
    if len(objs) != 1 or objs[0][0] != 0 or objs[0][1] != len(body):
        return None
    c = _call(objs[0][2], "parameters")
    return ("", [c]) if c is not None else None


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return None
    objs = _json_objects(text[i + len("[TOOL_CALLS]"):])
    if not objs or not isinstance(objs[0][2], list):
        return None
    calls = [_call(v) for v in objs[0][2]]
    return (text[:i].strip(), calls) if calls and all(calls) else None


def _parse_generic(text: str) -> tuple[str, list[ToolCall]] | None:
    body = text.strip()
    objs = _json_objects(body)
    if len(objs) != 1 or objs[0][0] != 0 or objs[0][1] != len(body) or not isinstance(objs[0][2], dict):
        return None
    v = objs[0][2]
    items = v.get("tool_calls")
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(x) for x in items]
    return ("", calls) if all(calls) else None


def _body(schema: str) -> str:
    return f"%json {schema}"


FORMATS: list[ToolFormat] = [
    ToolFormat("hermes", lambda src: "<tool_call>" in src, ("<tool_call>", "```", "{"), _parse_hermes,
               lambda schema: f'<tool_call> "\\n" {_body(schema)} "\\n" </tool_call>',
               lambda many: 'start: call ("\\n" call)*' if many else "start: call", bare_calls=True),
    ToolFormat("mistral", lambda src: "[TOOL_CALLS]" in src, ("[TOOL_CALLS]",), _parse_mistral,
               lambda schema: _body(schema),
               lambda many: 'start: "[TOOL_CALLS]" "[" call (", " call)* "]"' if many
               else 'start: "[TOOL_CALLS]" "[" call "]"'),
    ToolFormat("llama3", lambda src: "<|python_tag|>" in src or '"parameters": dictionary' in src,
               ("<|python_tag|>", "{"),
               _parse_llama3, lambda schema: _body(schema), lambda many: "start: call"),
    ToolFormat("generic", lambda src: True, ("{",), _parse_generic, lambda schema: _body(schema),
               lambda many: 'start: "{\\"tool_calls\\": [" call (", " call)* "]}"' if many
               else 'start: "{\\"tool_calls\\": [" call "]}"', template_renders_tools=False),
]


def format_for(template_source: str) -> ToolFormat:
    """The format a chat template's source speaks (the generic one when it renders no tools)."""
    if "tools" not in template_source:
        return FORMATS[-1]
    return next(f for f in FORMATS if f.detect(template_source))


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools``: each ``{"type": "function", "function": {"name", "parameters"?}}``."""
    if not isinstance(tools, list) or not tools:
        raise ToolCallError("tools must be a non-empty list of functions")
    names = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolCallError('each tool must be {"type": "function", "function": {"name": ..., "parameters": '
                                '{...}}}')
        if fn["name"] in names:
            raise ToolCallError(f"two tools are named {fn['name']!r}")
        names.add(fn["name"])
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolCallError(f"{fn['name']}: parameters must be a JSON schema object")
    return tools


def chosen(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[str, str | None]:
    """(``auto`` | ``none`` | ``required`` | ``named``, the named function or None)."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "none", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise ToolCallError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                            '{"name": ...}}')
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise ToolCallError(f"tool_choice names {fn['name']!r}, which is not among the tools")
    return "named", fn["name"]


def call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], only: str | None, parallel: bool,
                 special: Callable[[str], bool] = lambda text: True, lazy: bool = False) -> str:
    """The Lark grammar of a reply that is one call (or several, ``parallel``)
    to ``only`` or to any of ``tools``, each call's body the JSON of its
    name and arguments, the arguments following the function's parameters.
    ``lazy``: free text is allowed too, and calls after it (``auto``; the
    opener must be a control token, which free text cannot contain). A
    format with ``bare_calls`` also binds calls written without their
    opener: free text may not open with a JSON object or a ```json fence,
    so a reply that does is held to the calls' schemas from its first
    character (as llama.cpp's Hermes grammar triggers on ``{"name"``)."""
    key = "parameters" if fmt.name == "llama3" else "arguments"
    bodies = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        schema = {"type": "object", "x-guidance": JSON_OPTIONS,
                  "properties": {"name": {"const": fn["name"]},
                                 key: fn.get("parameters") or {"type": "object"}},
                  "required": ["name", key], "additionalProperties": False}
        bodies.append(json.dumps(schema))
    many = parallel and only is None   # a named function: one call to it
    names = " | ".join(f"call{i}" for i in range(len(bodies)))
    rules = [fmt.many_rule(many), f"call: {names}"]
    rules += [f"call{i}: {fmt.call_rule(b)}" for i, b in enumerate(bodies)]
    if lazy:   # free text, or text then the calls: the grammar binds only once a call opens
        rules[0] = rules[0].replace("start:", "calls:", 1)
        if fmt.bare_calls:   # free text cannot open with JSON: a reply that does is a bare call
            rules = ["start: FREE | FREE? calls | bare", "FREE: /(?s:.+)/ & ~/(?s:\\s*(```(json)?\\s*)?\\{.*)/",
                     'bare: bcalls | "```json\\n" bcalls "\\n```"',
                     'bcalls: bcall ("\\n" bcall)*' if many else "bcalls: bcall",
                     f"bcall: {names.replace('call', 'bcall')}",
                     *[f"bcall{i}: {_body(b)}" for i, b in enumerate(bodies)], *rules]
        else:
            rules = ["start: FREE | FREE? calls", "FREE: /(?s:.+)/", *rules]
    out = "\n".join(rules) + "\n"
    for tag in ("<tool_call>", "</tool_call>"):   # a control token where the vocabulary has one, else its text
        if tag in out and not special(tag):
            out = out.replace(f" {tag} ", f' "{tag}" ').replace(f": {tag} ", f': "{tag}" ')
    return out


def generic_system_text(tools: list[dict[str, Any]]) -> str:
    """What a template that renders no tools is told about them (the generic format)."""
    sigs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call these functions:\n" + sigs + "\n\nTo call functions, reply with only the JSON "
            '{"tool_calls": [{"name": <function name>, "arguments": <arguments object>}]}; '
            "otherwise reply in plain text.")


def read_calls(fmt: ToolFormat, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: no well-formed call leaves the text as content."""
    got = fmt.parse(text)
    if got is None or not got[1]:
        return text, []
    content, calls = got
    if not parallel:
        calls = calls[:1]
    return (content or None), calls
