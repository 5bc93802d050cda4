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
