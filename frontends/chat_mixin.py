"""What a tokenizer needs for chat: ``apply_chat_template`` and a settable ``chat_template``.

A module of its own so that loading a tokenizer does not import jinja2
(~30 ms): ``frontends.chat_template`` is imported on the first chat.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .chat_template import ChatTemplate

__all__ = ["ChatTemplateMixin"]


class ChatTemplateMixin:
    """``apply_chat_template`` and ``chat_template`` for a tokenizer class.

    The class sets ``model_chat_template`` (the template its file carries, or
    None) and gives ``chat_special_text(id)``, the text of a special token,
    which is what HF and llama.cpp pass as ``bos_token``/``eos_token``. The
    template is resolved on first use, so a model whose own template is
    broken still loads and generates; assigning ``chat_template`` (as
    ``--chat-template`` does) replaces it, and assigning None goes back to
    the model's own.
    """

    model_chat_template: str | None = None
    _chat_template: ChatTemplate | None = None

    def chat_special_text(self, token_id: int) -> str:
        raise NotImplementedError

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            from .chat_template import resolve_chat_template

            self._chat_template = resolve_chat_template(None, self.model_chat_template,
                                                        getattr(self, "name", "the model"))
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: ChatTemplate | None) -> None:
        from .chat_template import ChatTemplate

        if template is not None and not isinstance(template, ChatTemplate):
            raise TypeError(f"chat_template must be a ChatTemplate (see resolve_chat_template), "
                            f"not {type(template).__name__}")
        self._chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The rendered prompt text (HF's name and meaning, returning the string, not ids).

        Encode it with special tokens recognised (``encode(text,
        special=True)``) so that the template's markers become their ids;
        HF's string is returned even where llama.cpp would drop a leading
        BOS text because the vocabulary adds BOS itself."""
        kwargs.setdefault("bos_token", self.chat_special_text(getattr(self, "bos_id", -1)))
        kwargs.setdefault("eos_token", self.chat_special_text(getattr(self, "eos_id", -1)))
        return self.chat_template.render(messages, add_generation_prompt, **kwargs)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> tuple[str, list[tuple[str, bool]]]:
        """The rendered prompt and its pieces: ``(text, True)`` the template
        wrote, where control tokens count, and ``(text, False)`` a message's
        content, where they never do (a user who types ``<|im_end|>`` gets
        plain text; llama.cpp's server does not make that distinction)."""
        from .chat_template import checked_messages

        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        checked = checked_messages(messages, f"chat template {self.chat_template.label}")
        contents = [m["content"] for m in checked if isinstance(m.get("content"), str)]
        pieces = self._marked_pieces(text, checked, contents, add_generation_prompt, **kwargs)
        return text, pieces if pieces is not None else self._content_pieces(text, contents)

    def _marked_pieces(self, text: str, checked: list[dict[str, Any]], contents: list[str],
                       add_generation_prompt: bool, **kwargs: Any) -> list[tuple[str, bool]] | None:
        """The pieces, told apart by rendering the conversation again with a
        marker in place of each content: the template's own text is what
        lies between the markers. A search for the content in the rendered
        text could find it inside the template's text first (a message "a"
        in "<|im_start|>assistant"). None when the template does not print
        each marker once, in order, or its text around them differs from the
        real rendering (it looked at the content): the caller searches then."""
        marks = [f"\ue000lmc-content-{i}\ue001" for i in range(len(contents))]
        it = iter(marks)
        marked = [dict(m, content=next(it)) if isinstance(m.get("content"), str) else m for m in checked]
        try:
            mtext = self.apply_chat_template(marked, add_generation_prompt, **kwargs)
        except Exception:   # a template that inspects the content may fail on a marker
            return None
        pieces: list[tuple[str, bool]] = []
        cur = mcur = 0
        for mark, content in zip(marks, contents):
            at = mtext.find(mark, mcur)
            if at < 0 or mtext.count(mark) != 1:
                return None
            between = mtext[mcur:at]
            if not text.startswith(between, cur):
                return None
            cur += len(between)
            nxt = mtext.find("\ue000lmc-content-", at + len(mark))
            after = mtext[at + len(mark): nxt if nxt >= 0 else len(mtext)]
            for c in (content, content.strip()):   # as written, or trimmed, as templates often print them
                if text.startswith(c + after, cur) and (nxt >= 0 or cur + len(c) + len(after) == len(text)):
                    break
            else:
                return None
            pieces += [(between, True), (c, False)]
            cur += len(c)
            mcur = at + len(mark)
        if text[cur:] != mtext[mcur:]:
            return None
        pieces.append((text[cur:], True))
        return [p for p in pieces if p[0]]

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation (``chat_prompt``), BOS once."""
        _, pieces = self.chat_prompt(messages, add_generation_prompt, **kwargs)
        return self.chat_encode(pieces)

    def chat_encode(self, pieces: list[tuple[str, bool]], bos: bool = True) -> list[int]:
        """Ids of ``chat_prompt`` pieces; BOS is added when the vocabulary
        wants it and the template did not write it already (no double BOS)."""
        ids = self.encode_segments(pieces, bos=False)
        bos_id = getattr(self, "bos_id", -1)
        if bos and getattr(self, "add_bos", True) and bos_id >= 0 and ids[:1] != [bos_id]:
            ids.insert(0, bos_id)
        return ids

    def _content_pieces(self, text: str, contents: list[str]) -> list[tuple[str, bool]]:
        """Cut ``text`` into template text and the messages' contents, found in
        order (as written, or trimmed, as templates often print them). A
        content the template rewrote beyond that cannot be told apart: if it
        holds control-token text, refuse rather than let it become control."""
        from .chat_template import ChatTemplateError

        pieces: list[tuple[str, bool]] = []
        cur = 0
        for i, content in enumerate(contents):
            for c in (content, content.strip()):
                at = text.find(c, cur) if c else -1
                if at >= 0:
                    pieces += [(text[cur:at], True), (c, False)]
                    cur = at + len(c)
                    break
            else:
                if content and self.encode(content, bos=False, special=True) != self.encode(content, bos=False):
                    raise ChatTemplateError(f"chat template {self.chat_template.label}: message content {i} holds "
                                            f"control-token text and the template rewrites it, so it cannot be "
                                            f"kept as plain text")
        pieces.append((text[cur:], True))
        return [p for p in pieces if p[0]]
