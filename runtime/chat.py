"""A conversation with a model: messages in, streamed replies out, the KV
cache kept across turns.

Each turn renders the whole conversation with the model's chat template, but
only what is new since the last turn goes through the model: when the new
prompt text begins with the last prompt plus the reply the model wrote, the
new ids are the old ones (prompt and generated, exactly as run) followed by
the new text's ids, and the model's cache already holds every old row; the
time to the first token of turn N does not grow with the history. When the
conversation outgrows the context, the oldest turns (never the system
message) are dropped and the caller is told; with the model's context shift
on (``runtime.context_shift``) the messages all stay and tokens go instead:
the first ``keep`` (the system prompt's by default) stay, the oldest half of
the rest goes, the cache keeps the ids as shifted, and the next turn starts
from them.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .context_shift import chat_keep, shift_tokens
from .errors import RunError
from .model import Model, TextStream


@dataclass
class TurnStats:
    prompt_tokens: int        # the whole rendered conversation
    cached_tokens: int        # of those, KV rows reused from the last turn
    prefilled_tokens: int     # run through the model this turn
    generated_tokens: int = 0
    first_token_s: float = 0.0
    decode_tok_s: float | None = None
    stop_reason: str | None = None
    dropped_messages: int = 0
    #: context shifts this turn (of the prompt and while replying), and the tokens they dropped
    context_shifts: int = 0
    shifted_tokens: int = 0


@dataclass
class ChatSettings:
    max_new_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    #: every reply follows this constraint (``runtime.grammar``), or None
    grammar: Any = None
    #: functions the model may call (OpenAI's ``tools``): shown by the template, calls read from replies
    tools: list[dict[str, Any]] | None = None


class ChatSession:
    def __init__(self, model: Model, system: str | None = None, settings: ChatSettings | None = None) -> None:
        self.model = model
        self.settings = settings or ChatSettings()
        self.messages: list[dict[str, Any]] = []
        self.system = system
        self.turns: list[TurnStats] = []
        # what the last turn left in the cache, as text and as the ids that were run
        self._text: str | None = None
        self._ids: list[int] = []

    # --- the conversation ----------------------------------------------------------------
    @property
    def system(self) -> str | None:
        return self._system

    @system.setter
    def system(self, text: str | None) -> None:
        self._system = text or None
        self.messages = [m for m in getattr(self, "messages", []) if m["role"] != "system"]
        if self._system:
            self.messages.insert(0, {"role": "system", "content": self._system})

    def reset(self) -> None:
        """Forget the turns (the system message stays)."""
        self.messages = self.messages[:1] if self.system else []
        self.turns = []

    def save(self, path: str | os.PathLike) -> None:
        """The conversation as JSON messages (what ``load`` and
        ``lmc chat --messages`` read), written whole or not at all."""
        path = os.fspath(path)
        tmp = f"{path}.{os.getpid()}.part"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.messages, f, ensure_ascii=False, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        self.set_messages(read_messages(path))

    def set_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        msgs = [dict(m) for m in messages]
        system = [m for m in msgs if m.get("role") == "system"]
        self._system = system[0]["content"] if system else None
        self.messages = msgs
        self.turns = []

    # --- a turn --------------------------------------------------------------------------
    def send(self, text: str) -> TextStream:
        """Add the user's message and stream the reply (``reply``)."""
        self.messages.append({"role": "user", "content": text})
        try:
            return self.reply()
        except Exception:
            self.messages.pop()
            raise

    def reply(self) -> TextStream:
        """Stream the assistant's reply to the conversation as it stands; the
        reply joins the conversation as its pieces arrive, so an interrupted
        reply (Ctrl-C, ``stream.close()``) stays as far as it got."""
        if not self.messages or self.messages[-1]["role"] not in ("user", "tool"):
            raise RunError("the conversation must end with a user message (or a tool's result) to be answered")
        keep = self._keep()
        ids, dropped, shifted = self._fit(keep)
        s = self.settings
        t0 = time.perf_counter()
        shift = {"keep": keep} if keep is not None else {}
        stream = self.model.complete(ids, s.max_new_tokens, stream=True, stop=s.stop or None, reuse_cache=True,
                                     grammar=s.grammar or self._tool_grammar(), **shift, **s.sampling)
        comp = stream.completion
        if shifted:   # the prompt's shift, counted with the reply's
            comp.stats.extra["context_shifts"] += 1
            comp.stats.extra["shifted_tokens"] += shifted
        turn = TurnStats(prompt_tokens=len(ids), cached_tokens=comp.cached_tokens,
                         prefilled_tokens=len(ids) - comp.cached_tokens, dropped_messages=dropped)
        self._count_shifts(turn, comp)
        self.turns.append(turn)
        reply = {"role": "assistant", "content": ""}
        self.messages.append(reply)
        self._text = None

        def pieces():
            first = True
            try:
                for piece in stream:
                    if first:
                        turn.first_token_s = time.perf_counter() - t0
                        first = False
                    reply["content"] += piece
                    yield piece
            finally:
                stream.close()
                self._count_shifts(turn, comp)
                self._after(turn, comp, ids)
                self._read_calls(reply)

        return TextStream(pieces(), comp)

    def send_tool_result(self, text: str) -> TextStream:
        """Add a tool's result (to the last reply's first call not yet
        answered) and stream the reply to it."""
        calls = [c for m in self.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        answered = {m.get("tool_call_id") for m in self.messages if m["role"] == "tool"}
        pending = [c for c in calls if c["id"] not in answered]
        if not pending:
            raise RunError("no tool call is waiting for a result")
        self.messages.append({"role": "tool", "tool_call_id": pending[0]["id"], "content": text})
        try:
            return self.reply()
        except Exception:
            self.messages.pop()
            raise

    @property
    def last_tool_calls(self) -> list[dict[str, Any]]:
        """The calls the last reply made (OpenAI's form), if any."""
        last = self.messages[-1] if self.messages else {}
        return list(last.get("tool_calls") or []) if last.get("role") == "assistant" else []

    def _tool_grammar(self) -> Any:
        """With tools whose calls open with a control token (Qwen's <tool_call>):
        free text, or calls that follow the functions' schemas."""
        from . import grammar, tool_calls

        tools = self.settings.tools
        tok = self.model.tokenizer
        if not tools or tool_calls.format_for(tok.chat_template.source).name != "hermes":
            return None
        i = tok.piece_to_id("<tool_call>") if hasattr(tok, "piece_to_id") else None
        if i is None or not tok.is_special(i):
            return None
        fmt = tool_calls.format_for(tok.chat_template.source)
        return grammar.lark(tool_calls.call_grammar(fmt, tools, None, True, lambda text: True, lazy=True))

    def _read_calls(self, reply: dict[str, Any]) -> None:
        """The reply's tool calls, if it made any, as the message's ``tool_calls``."""
        from . import tool_calls

        if not self.settings.tools:
            return
        fmt = tool_calls.format_for(self.model.tokenizer.chat_template.source)
        content, calls = tool_calls.read_calls(fmt, reply["content"])
        if calls:
            reply["content"] = content or ""
            reply["tool_calls"] = [c.openai() for c in calls]
            for c in reply["tool_calls"]:   # the template takes the arguments as an object
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
            self._text = None

    def _after(self, turn: TurnStats, comp, ids: list[int]) -> None:
        turn.cached_tokens, turn.prefilled_tokens = comp.cached_tokens, len(ids) - comp.cached_tokens
        turn.generated_tokens = len(comp.generated_ids)
        turn.decode_tok_s = comp.stats.as_dict()["decode_tok_s"]
        turn.stop_reason = comp.stop_reason or "interrupted"
        if turn.first_token_s == 0.0:
            turn.first_token_s = comp.stats.prefill_s
        # the reply's text is exactly its ids' unless a stop string cut a token short
        if comp.stop_reason in ("eos", "length"):
            tok = self.model.tokenizer
            end = tok.chat_special_text(comp.generated_ids[-1]) if comp.stop_reason == "eos" else ""
            self._text = self._rendered + comp.text + end
            self._ids = comp.context_ids   # ids + the reply's, unless a context shift dropped some

    def _keep(self) -> int | None:
        """With context shift: the tokens each shift keeps (the model's
        ``keep``, else the system prompt's: ``context_shift.chat_keep``);
        None without."""
        m = self.model
        if not getattr(m, "context_shift", False):
            return None
        if m.keep is not None:
            return m.keep
        return chat_keep(m.tokenizer, self.messages, self.settings.tools)

    @staticmethod
    def _count_shifts(turn: TurnStats, comp) -> None:
        turn.context_shifts = comp.stats.extra.get("context_shifts", 0)
        turn.shifted_tokens = comp.stats.extra.get("shifted_tokens", 0)

    def _fit(self, keep: int | None = None) -> tuple[list[int], int, int]:
        """Ids of the conversation with a generation prompt that leave room
        for a reply (a quarter of the context, or max_new_tokens if
        smaller): with context shift (``keep`` not None) its tokens are
        shifted to fit; else the oldest turns are dropped. Also the
        messages dropped and the tokens shifted out."""
        ctx = self.model.ctx
        room = min(self.settings.max_new_tokens, max(1, ctx // 4))
        dropped = 0
        if keep is not None:
            ids = self._prompt_ids()
            if len(ids) + room <= ctx:
                return ids, 0, 0
            ids, shifted = shift_tokens(ids, keep, ctx - room)
            return ids, 0, shifted
        while True:
            ids = self._prompt_ids()
            if len(ids) + room <= ctx:
                return ids, dropped, 0
            first = 1 if self.system else 0
            if len(self.messages) - first <= 1:
                raise RunError(f"the message is {len(ids)} tokens with the template; with room for a reply it "
                               f"does not fit the context of {ctx} (raise -c)")
            # drop the oldest turn: a user message and what answered it
            del self.messages[first]
            dropped += 1
            while len(self.messages) > first + 1 and self.messages[first]["role"] != "user":
                del self.messages[first]
                dropped += 1

    def _prompt_ids(self) -> list[int]:
        tok = self.model.tokenizer
        kw = {"tools": self.settings.tools} if self.settings.tools else {}
        text, pieces = tok.chat_prompt(self.messages, add_generation_prompt=True, **kw)
        self._rendered = text
        old = self._text
        if old is not None and text.startswith(old) and self._ids:
            # the old ids as they were run, then the new text's (its pieces past the old text)
            cut, new = len(old), []
            at = 0
            for piece, special in pieces:
                lo, hi = max(at, cut), at + len(piece)
                if hi > lo:
                    new.append((piece[lo - at:], special))
                at = hi
            return self._ids + tok.chat_encode(new, bos=False)
        return tok.chat_encode(pieces)

    def stats(self) -> list[dict[str, Any]]:
        return [asdict(t) for t in self.turns]


def read_messages(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A conversation from a JSON file: a list of {"role", "content"} (or
    {"messages": [...]}, as an OpenAI request body). One-line errors."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise RunError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: not JSON ({str(e).splitlines()[0][:100]})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in data):
        raise RunError(f"{path}: expected a JSON list of {{\"role\": ..., \"content\": ...}} messages")
    return data
