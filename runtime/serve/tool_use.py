"""A chat request's tools (``runtime.tool_calls``) as the server handles
them: how the prompt shows them, the grammar a call follows, the calls read
back from the reply, and a streamed reply's text held back where a call may
begin."""
from __future__ import annotations

from typing import Any

from .. import grammar as grammar_lib
from .. import tool_calls
from ..grammar import Constraint
from . import schemas as S
from .errors import ApiError


class ToolUse:
    """A request's tools: how the prompt shows them, the grammar a required
    or named call follows, and the calls read back from the reply."""

    def __init__(self, body: S.ChatRequest, backend: Any) -> None:
        try:
            self.tools = tool_calls.check_tools(body.tools)
            self.mode, self.only = tool_calls.chosen(self.tools, body.tool_choice)
        except tool_calls.ToolCallError as e:
            raise ApiError(400, str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
        tok = backend.tokenizer
        self.fmt = tool_calls.format_for(tok.chat_template.source)
        self.is_special = lambda text: _is_control(tok, text)
        self.parallel = body.parallel_tool_calls
        self.vocab = (tok, backend.info.stop_ids, backend.info.vocab)
        #: the body constrains the reply itself (response_format, grammar, regex)
        self.own = bool(body.grammar or body.regex or (body.response_format or {}).get("type", "text") != "text")
        if self.mode in ("required", "named") and self.own:
            raise ApiError(400, f"tool_choice {self.mode!r} constrains the reply already: not with "
                           f"response_format, grammar or regex", "tool_choice")

    @classmethod
    def of(cls, body: S.ChatRequest, backend: Any) -> "ToolUse | None":
        if not body.tools:
            if body.tool_choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            return None
        use = cls(body, backend)
        return None if use.mode == "none" else use

    def prompt(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """The messages and the template's keywords that show the tools."""
        if self.fmt.template_renders_tools:
            return messages, {"tools": self.tools}
        note = {"role": "system", "content": tool_calls.generic_system_text(self.tools)}
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{note['content']}")
            return [first, *messages[1:]], {}
        return [note, *messages], {}

    def constraint(self) -> Constraint | None:
        """required / named: the reply is calls. auto, where a call opens with
        a control token of the vocabulary (Qwen's <tool_call>): free text, or
        text then calls whose bodies follow the grammar (llama.cpp's lazy
        grammar), so a call the model starts always parses and validates."""
        if self.mode in ("required", "named"):
            return grammar_lib.lark(tool_calls.call_grammar(self.fmt, self.tools, self.only, self.parallel,
                                                            self.is_special), field="tools")
        if self.mode == "auto" and not self.own and self.fmt.name == "hermes" and self.is_special("<tool_call>"):
            return grammar_lib.lark(tool_calls.call_grammar(self.fmt, self.tools, None, self.parallel,
                                                            self.is_special, lazy=True), field="tools")
        return None

    def read(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """The reply's content and calls; calls read from free text (a fenced
        JSON call, say) count only if their arguments follow the function's
        parameters (checked by llguidance), else the reply stays text."""
        content, calls = tool_calls.read_calls(self.fmt, text, self.parallel)
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if calls and not all(c.name in params and self._valid(c.arguments, params[c.name]) for c in calls):
            return text, []
        return content, calls

    def _valid(self, args: dict, schema: dict) -> bool:
        import json

        import llguidance

        from ..grammar.vocabulary import ll_tokenizer

        llt = ll_tokenizer(*self.vocab)
        m = llguidance.LLMatcher(llt, grammar_lib.json_schema(schema).grammar(), log_level=0)
        return m.consume_tokens(llt.tokenize_str(json.dumps(args, ensure_ascii=False))) and m.is_accepting()


class HeldText:
    """A streamed reply's text, held back from where a tool call may begin
    (the format's opener, or what could still become it) until the end,
    when the calls are read out of it."""

    def __init__(self, calls: ToolUse | None) -> None:
        self.calls = calls
        self.held = ""
        self.holding = False

    def feed(self, text: str, finish: str | None) -> tuple[str, list, str | None]:
        """(text to send now, calls found at the end, finish reason)."""
        if self.calls is None:
            return text, [], finish
        self.held += text
        out = ""
        if not self.holding:
            i = self._opening()
            if i is not None:
                out, self.held, self.holding = self.held[:i], self.held[i:], True
            else:   # keep a tail that may be the start of an opener
                keep = max((n for o in self.calls.fmt.openers for n in range(min(len(o), len(self.held)), 0, -1)
                            if o.startswith(self.held[-n:])), default=0)
                out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if finish is None:
            return out, [], None
        content, found = self.calls.read(self.held)
        if found:
            return out + (content or ""), found, "tool_calls" if finish == "stop" else finish
        rest, self.held = self.held, ""
        return out + rest, [], finish

    def _opening(self) -> int | None:
        """Where a call may open in the text so far: an opener anywhere, or
        "{" / "```" as the reply's first characters (a reply that is a call)."""
        at = [i for o in self.calls.fmt.openers if o not in ("{", "```") and (i := self.held.find(o)) >= 0]
        head = self.held.lstrip()
        if any(o in ("{", "```") and head.startswith(o) for o in self.calls.fmt.openers):
            at.append(len(self.held) - len(head))
        return min(at) if at else None


def _is_control(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` is one special token of the vocabulary (``<tool_call>`` in Qwen's)."""
    find = getattr(tokenizer, "piece_to_id", None)
    i = find(text) if find is not None else None
    return i is not None and bool(getattr(tokenizer, "is_special", lambda _: False)(i))
