r"""Chat templates: turn a conversation into the prompt text a model was trained on.

Rendering follows Hugging Face's ``apply_chat_template`` (transformers'
``_compile_jinja_template`` and ``render_jinja_template``), because that is
what a model's own template (GGUF ``tokenizer.chat_template``) is written
for and what llama.cpp's jinja mode reproduces: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and
the ``loopcontrols`` extension; HF's ``tojson`` filter (no HTML escaping,
``indent``/``separators``/``sort_keys``); the globals ``raise_exception`` and
``strftime_now``; the variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``tools`` and ``documents`` (None when not
given) plus any extra keywords. Two deliberate differences, both about input
HF passes through unchecked: messages are validated (a list of dicts with a
string ``role`` and a string ``content``; ``None`` content only for an
assistant's tool calls), and list-of-parts content (``[{"type": "text",
"text": ...}]``) is joined into one string with ``"\n"`` between parts, as
llama.cpp does for templates that expect string content; other part types
(images, audio) are refused.

A template is untrusted input (it comes from a model file someone
downloaded): it is compiled and rendered by ``frontends.template_sandbox``,
bounded in time (2 s), output and value size (1 MiB) and memory growth, with
no file access. Every failure, of the template or of the messages, is one
line: ``ChatTemplateError("chat template NAME: problem")``.

Named templates are for models that carry none (``--chat-template NAME``):
``chatml``, ``llama2``, ``llama3``, ``gemma``, ``phi3`` follow each family's
official format, and ``plain`` (the fallback) is a readable transcript::

    System: You are terse.

    User: Hi

    Assistant:

(one ``Role: content`` paragraph per message, the role capitalised, a blank
line after each; the generation prompt is ``Assistant:`` with no trailing
space, so the model's reply starts with its own space token).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .template_sandbox import (MAX_MEMORY_GROWTH, MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS, SandboxError,
                               compile_template, render_bounded)

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "NAMED_TEMPLATES",
    "MAX_TEMPLATE_BYTES",
    "resolve_chat_template",
]

#: largest template source (a file or a model's metadata string)
MAX_TEMPLATE_BYTES = 1 << 20


class ChatTemplateError(ValueError):
    """A chat template that cannot be read, compiled or rendered, or messages it cannot take."""


# --------------------------------------------------------------------------
# messages


def _text_of_parts(parts: Any, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"{where}: content part {j}: only text parts "
                                    f"({{'type': 'text', 'text': ...}}) are supported, not {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def checked_messages(messages: Any, prefix: str) -> list[dict]:
    """Plain dicts with a string role and content (see the module doc for what is accepted)."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"{prefix}: messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                                f"not {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        where = f"{prefix}: message {i}"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"{where} has no 'role' string")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            content = _text_of_parts(content, where)
        elif content is None and role == "assistant":
            pass   # tool calls only
        elif not isinstance(content, str):
            got = "no 'content'" if "content" not in m else f"a {type(content).__name__} 'content'"
            raise ChatTemplateError(f"{where} ({role}) has {got}; it must be a string")
        msg = dict(m)
        msg["content"] = content
        out.append(msg)
    return out


# --------------------------------------------------------------------------
# templates


class ChatTemplate:
    """A compiled chat template with the bounds it renders under.

    ``name`` says where it came from (``"model"``, a named template such as
    ``"chatml"``, or a file path); ``label`` is how errors name it.
    Compiling happens here, so a broken template fails when chosen, not at
    the first turn of a chat.
    """

    def __init__(self, source: str, name: str = "custom", *, label: str | None = None,
                 max_output_chars: int = MAX_OUTPUT_CHARS, time_limit: float = MAX_RENDER_SECONDS,
                 memory_limit: int = MAX_MEMORY_GROWTH) -> None:
        self.name = name
        self.label = label or name
        self.source = source
        self.max_output_chars = max_output_chars
        self.time_limit = time_limit
        self.memory_limit = memory_limit
        if not isinstance(source, str):
            raise ChatTemplateError(f"{self._prefix}: the template must be text, not {type(source).__name__}")
        if len(source.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"{self._prefix}: the template is larger than {MAX_TEMPLATE_BYTES >> 20} MiB")
        try:
            self._template = compile_template(source)
        except SandboxError as e:
            raise ChatTemplateError(f"{self._prefix}: {e}") from None

    @property
    def _prefix(self) -> str:
        return f"chat template {self.label}"

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
               bos_token: str = "", eos_token: str = "", tools: list[dict[str, Any]] | None = None,
               **extra: Any) -> str:
        """The prompt text for ``messages``, as HF's apply_chat_template renders it.

        ``add_generation_prompt`` appends the opening of the assistant's
        turn (a chat wants it; rendering a finished conversation does not).
        Extra keywords reach the template as variables (``documents``,
        ``enable_thinking``, ``date_string``, ...)."""
        variables = dict(extra)
        variables.setdefault("documents", None)
        variables.update(messages=checked_messages(messages, self._prefix),
                         add_generation_prompt=bool(add_generation_prompt),
                         bos_token=bos_token, eos_token=eos_token, tools=tools)
        try:
            return render_bounded(self._template, variables, self.max_output_chars, self.time_limit,
                                  self.memory_limit)
        except SandboxError as e:
            raise ChatTemplateError(f"{self._prefix}: {e}") from None


# Each follows the family's published format. Whitespace control ({%- -%})
# keeps the layout readable without changing the output.

_CHATML = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Meta's Llama 2 chat format: the system prompt inside the first [INST]
# between <<SYS>> markers, every exchange wrapped in BOS ... EOS; turns
# alternate strictly. The reply follows "[/INST]" directly, so
# add_generation_prompt changes nothing.
_LLAMA2 = r"""
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Llama 2 conversations alternate user and assistant turns, starting with the user (after an optional system message)') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message %}
            {{- bos_token + '[INST] <<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] | trim + ' [/INST]' }}
        {%- else %}
            {{- bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] | trim + ' ' + eos_token }}
    {%- endif %}
{%- endfor %}
"""

_LLAMA3 = r"""
{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Gemma has no system role: the system text opens the first user turn
# (as Gemma 2 and 3's own templates do), and the assistant is "model".
_GEMMA = r"""
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Gemma conversations alternate user and assistant turns, starting with the user (after an optional system message)') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""

# Phi-3 (and 3.5): <|role|>, newline, content, <|end|>. No BOS, and no EOS
# after a finished conversation (llama.cpp's built-in phi3 format), so that
# a conversation's rendering is a prefix of the next turn's.
_PHI3 = r"""
{%- for message in messages %}
    {{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
{%- endif %}
"""

_PLAIN = r"""
{%- for message in messages %}
    {{- message['role'] | capitalize + ': ' + message['content'] + '\n\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- 'Assistant:' }}
{%- endif %}
"""

#: templates chosen by name (``--chat-template NAME``), for models that carry none
NAMED_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML.strip("\n"),
    "llama2": _LLAMA2.strip("\n"),
    "llama3": _LLAMA3.strip("\n"),
    "gemma": _GEMMA.strip("\n"),
    "phi3": _PHI3.strip("\n"),
    "plain": _PLAIN.strip("\n"),
}


def _read_template_file(path: str) -> str:
    prefix = f"chat template {path}"
    names = ", ".join(NAMED_TEMPLATES)
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except FileNotFoundError:
        raise ChatTemplateError(f"{prefix}: no such file (and not a named template: {names})") from None
    except IsADirectoryError:
        raise ChatTemplateError(f"{prefix}: is a directory, not a template file") from None
    except OSError as e:
        raise ChatTemplateError(f"{prefix}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{prefix}: the file is larger than {MAX_TEMPLATE_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{prefix}: not UTF-8 text (byte {e.start})") from None


def resolve_chat_template(spec: str | None, model_template: str | None, model_name: str) -> ChatTemplate:
    """The template a chat uses: the user's choice (``--chat-template NAME|FILE``),
    else the model's own (its metadata), else ``plain``, so every model can chat."""
    if spec:
        if spec in NAMED_TEMPLATES:
            return ChatTemplate(NAMED_TEMPLATES[spec], spec)
        return ChatTemplate(_read_template_file(spec), spec)
    if model_template:
        return ChatTemplate(model_template, "model", label=f"of {model_name}")
    return ChatTemplate(NAMED_TEMPLATES["plain"], "plain")
