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

A template is untrusted input: it comes from a model file someone
downloaded. Rendering it must not read files, run for ever, or take the
process down, and every failure is one line, ``ChatTemplateError("chat
template NAME: problem")``:

* the sandbox refuses unsafe attributes (``__class__``, ``__globals__``, ...)
  and mutation of lists and dicts; an unsafe access is an error at once
  (jinja would render it as an empty string);
* there is no loader: ``include``, ``import`` and ``extends`` are errors;
* time: ``sys.settrace`` watches only frames compiled from a template (their
  ``co_filename`` is ``<template>``) and raises on a 'line' event past the
  deadline, so a loop without output (nested ``range`` loops) stops; the
  previous trace function is restored afterwards, and it works in any
  thread (a trace function is per thread);
* size: the output is consumed chunk by chunk from ``Template.generate`` and
  refused past ``max_output_chars``; every value a template *makes* (the
  ``*``, ``**``, ``+`` and ``%`` operators, ``~`` concatenation, captured
  blocks and macro bodies, filter and method results, printed values) is
  checked against the same bound, predicted *before* the work where one step
  can grow without limit (``'x' * 10**9``, ``2 ** 10**9``, ``s.center(10**9)``,
  ``s.replace('', s)``, ``'%999999999d' % 1``, ``|indent``, ``|join``,
  ``|tojson(indent=...)``, ``|wordwrap``, ``|urlize``, ``|sum`` of lists), so
  doubling a string in a loop stops at the bound instead of at the
  machine's memory;
* memory: values a template keeps (a list or namespace that grows every
  iteration) are caught by watching the process's anonymous resident memory
  (``/proc/self/statm``), sampled every 64 template lines and after every
  8 MiB of checked values; growth past ``memory_limit`` during one render is
  an error. Being process-wide, a large allocation by another thread during
  a render could be blamed on the template (renders take milliseconds).

What is not bounded: a single built-in operation is not interrupted while it
runs; those whose cost can grow faster than their input are bounded by the
predictions above, the rest are linear in values that are themselves
bounded.

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

import functools
import json
import os
import re
import string
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "NAMED_TEMPLATES",
    "MAX_TEMPLATE_BYTES",
    "resolve_chat_template",
]

#: largest template source (a file or a model's metadata string)
MAX_TEMPLATE_BYTES = 1 << 20
#: default bounds of one render
MAX_OUTPUT_CHARS = 1 << 20
MAX_RENDER_SECONDS = 2.0
MAX_MEMORY_GROWTH = 256 << 20

_TEMPLATE_FILENAME = "<template>"   # co_filename of code compiled by Environment.from_string
_SAMPLE_EVERY_LINES = 64
_SAMPLE_EVERY_CHARS = 8 << 20


class ChatTemplateError(ValueError):
    """A chat template that cannot be read, compiled or rendered, or messages it cannot take."""


class _Refused(Exception):
    """A bound was hit inside the sandbox (time, size or memory)."""


class _TemplateRaised(TemplateError):
    """The template called raise_exception(message)."""


# --------------------------------------------------------------------------
# the bounds of one render


class _RenderGuard:
    """Deadline and memory watch of one render, checked from the template's own frames."""

    def __init__(self, max_chars: int, time_limit: float, memory_limit: int) -> None:
        self.max_chars = max_chars
        self.time_limit = time_limit
        self.deadline = time.monotonic() + time_limit
        self.memory_limit = memory_limit
        self.memory_base = _anon_rss()
        self.lines = 0
        self.unsampled = 0

    def trace_calls(self, frame: Any, event: str, arg: Any) -> Callable | None:
        """Global trace function: follow lines in template code only (cheap elsewhere)."""
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            return self.trace_lines
        return None

    def trace_lines(self, frame: Any, event: str, arg: Any) -> Callable:
        if event == "line":
            if time.monotonic() > self.deadline:
                raise _Refused(f"rendering took longer than {self.time_limit:g} s")
            self.lines += 1
            if self.lines % _SAMPLE_EVERY_LINES == 0:
                self.check_memory()
        return self.trace_lines

    def produced(self, nchars: int) -> None:
        self.unsampled += nchars
        if self.unsampled > _SAMPLE_EVERY_CHARS:
            self.unsampled = 0
            self.check_memory()

    def check_memory(self) -> None:
        if self.memory_base is None:
            return
        now = _anon_rss()
        if now is not None and now - self.memory_base > self.memory_limit:
            raise _Refused(f"rendering used more than {self.memory_limit >> 20} MiB of memory")


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _anon_rss() -> int | None:
    """Resident memory not backed by files (mapped model weights do not count); None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return None


_active = threading.local()   # .guard: the _RenderGuard of the render running in this thread


def _limit() -> int:
    guard = getattr(_active, "guard", None)
    return guard.max_chars if guard is not None else MAX_OUTPUT_CHARS


def _size(value: Any, limit: int) -> int:
    """About how many characters str(value) takes; stops counting once past ``limit``."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, Mapping):
        items: Any = (x for kv in value.items() for x in kv)
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return 1
    total = len(value) + 1
    for item in items:
        if total > limit:
            break
        total += _size(item, limit - total)
    return total


def _refuse_size(nchars: int, limit: int, what: str) -> None:
    """``what`` says which operation, e.g. "'*' would make a value" (predicted)."""
    if nchars > limit:
        raise _Refused(f"{what} of more than {limit} characters")


def _account(value: Any, op: str) -> Any:
    """Check a value the template made, and count it towards the memory watch."""
    limit = _limit()
    n = _size(value, limit)
    _refuse_size(n, limit, f"{op} made a value")
    guard = getattr(_active, "guard", None)
    if guard is not None:
        guard.produced(n)
    return value


# -- predictions for the operations that can grow much faster than their input

_LONG_NUMBER = re.compile(r"\d{7,}")


def _check_format(fmt: str, values: Any, limit: int, braces: bool) -> None:
    """Widths and precisions in a format string (``%`` or ``str.format``) stay within the bound.

    Scanned in linear time (a format string may itself be a megabyte): for
    ``%`` any long number in the string counts as a width, and ``*`` makes
    every integer argument one; for ``str.format`` the C parser gives the
    field specs, and a nested ``{...}`` in one makes the arguments widths."""
    vals = list(values.values()) if isinstance(values, Mapping) else (
        list(values) if isinstance(values, (tuple, list)) else [values])
    if braces:
        try:
            specs = [spec for _, field, spec, _ in string.Formatter().parse(fmt) if field is not None and spec]
        except ValueError:
            return   # str.format will refuse it
        dynamic = any("{" in spec for spec in specs)
        numbers = [m.group() for spec in specs for m in _LONG_NUMBER.finditer(spec)]
    else:
        dynamic = "*" in fmt
        numbers = [m.group() for m in _LONG_NUMBER.finditer(fmt)]
    if (any(len(d) > 9 or int(d) > limit for d in numbers)
            or dynamic and any(isinstance(v, int) and v > limit for v in vals)):
        raise _Refused(f"a format width of more than {limit} characters")


_SEQUENCES = (str, bytes, bytearray, list, tuple)


def _as_text(x: Any) -> Any:
    """Bytes as text of the same length, so that the string predictions apply to them."""
    return x.decode("latin-1") if isinstance(x, (bytes, bytearray)) else x


def _predict_replace(s: str, old: Any, new: Any, count: Any, limit: int) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        n = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _refuse_size(len(s) + n * (len(new) - len(old)), limit, "replace would make a value")


def _predict_join(items: Any, sep: Any, limit: int) -> None:
    if isinstance(items, (list, tuple)) and isinstance(sep, str):
        _refuse_size(_size(items, limit) + len(sep) * len(items), limit, "join would make a value")


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict, limit: int) -> None:
    """Before a method of a string runs: the ones whose output can outgrow their input."""
    arg = args[0] if args else None
    would = f"{name}() would make a value"
    if name in ("center", "ljust", "rjust", "zfill"):
        width = arg if args else kwargs.get("width")
        if isinstance(width, int):
            _refuse_size(width, limit, would)
    elif name == "expandtabs":
        tab = arg if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _refuse_size(len(s) + s.count("\t") * tab, limit, would)
    elif name == "replace" and len(args) >= 2:
        _predict_replace(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1), limit)
    elif name == "join":
        _predict_join(arg, s, limit)
    elif name in ("format", "format_map"):
        _check_format(s, list(args) + list(kwargs.values()) if name == "format" else arg, limit, braces=True)
    elif name == "translate" and isinstance(arg, Mapping):
        longest = max((len(v) for v in arg.values() if isinstance(v, str)), default=1)
        _refuse_size(len(s) * longest, limit, would)


def _json_shape(value: Any, depth: int = 0) -> tuple[int, int]:
    """(nodes, deepest level) of a JSON-like value, for what indentation adds."""
    if isinstance(value, Mapping):
        children: Any = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return 1, depth
    nodes, deepest = 1, depth
    for child in children:
        n, d = _json_shape(child, depth + 1)
        nodes, deepest = nodes + n, max(deepest, d)
    return nodes, deepest


def _width(x: Any) -> int:
    return len(x) if isinstance(x, str) else (x if isinstance(x, int) and x > 0 else 0)


def _check_tojson(limit: int, value: Any, *args: Any, **kwargs: Any) -> None:
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
    seps = kwargs.get("separators", args[2] if len(args) > 2 else None)
    extra = _width(indent)
    if isinstance(seps, (list, tuple)):
        extra += sum(_width(s) for s in seps if isinstance(s, str))
    if extra:
        nodes, deepest = _json_shape(value)
        _refuse_size(_size(value, limit) + nodes * (extra * (deepest + 1) + 1), limit, "|tojson would make a value")


def _check_indent(limit: int, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    width = kwargs.get("width", width)
    if isinstance(s, str):
        _refuse_size(len(s) + (s.count("\n") + 1) * _width(width), limit, "|indent would make a value")


def _check_replace(limit: int, s: Any, old: Any = None, new: Any = None, count: Any = None, **kwargs: Any) -> None:
    if isinstance(s, str):
        _predict_replace(s, old, new, -1 if count is None else count, limit)


def _check_join(limit: int, value: Any, d: Any = "", *args: Any, **kwargs: Any) -> None:
    _predict_join(value, kwargs.get("d", d), limit)


def _check_format_filter(limit: int, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        _check_format(value, kwargs or args, limit, braces=False)


def _check_wordwrap(limit: int, s: Any, width: Any = 79, break_long_words: Any = True,
                    wrapstring: Any = None, *args: Any, **kwargs: Any) -> None:
    wrap = kwargs.get("wrapstring", wrapstring)
    if isinstance(s, str) and isinstance(wrap, str):
        _refuse_size(len(s) * (1 + len(wrap)), limit, "|wordwrap would make a value")


def _check_urlize(limit: int, s: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(s, str):
        extra = sum(_size(a, limit) for a in list(args) + list(kwargs.values()) if isinstance(a, (str, list, tuple)))
        _refuse_size(len(s) * 3 + (s.count(" ") + s.count("\n") + 1) * (extra + 64), limit,
                     "|urlize would make a value")


def _check_sum(limit: int, iterable: Any, *args: Any, **kwargs: Any) -> None:
    """Summing lists copies the running total at every step: quadratic time in C."""
    if isinstance(iterable, (list, tuple)) and any(isinstance(x, (list, tuple)) for x in iterable):
        if len(iterable) * _size(iterable, limit) > 16 * limit:
            raise _Refused(f"summing {len(iterable)} lists is too much work")


# filter name -> check(limit, value, *args, **kwargs), run before the filter
_FILTER_PREDICTIONS: dict[str, Callable[..., None]] = {
    "tojson": _check_tojson, "indent": _check_indent, "replace": _check_replace, "join": _check_join,
    "format": _check_format_filter, "wordwrap": _check_wordwrap, "urlize": _check_urlize, "sum": _check_sum,
}


def _bounded_filter(name: str, func: Callable) -> Callable:
    """A filter whose inputs and result are checked, and whose counts and widths are bounded."""
    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1   # context, eval_ctx or environment first
    predict = _FILTER_PREDICTIONS.get(name)

    @functools.wraps(func)   # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        limit = _limit()
        data = args[skip:]
        for a in list(data) + list(kwargs.values()):
            _refuse_size(_size(a, limit), limit, f"|{name} was given a value")
        if name != "format":   # its arguments are values, not counts
            for a in list(data[1:]) + list(kwargs.values()):
                if isinstance(a, int) and a > limit:
                    raise _Refused(f"|{name}: an argument of {a} (more than {limit})")
        if predict is not None and data:
            predict(limit, *data, **kwargs)
        return _account(func(*args, **kwargs), f"|{name}")

    return bounded


# --------------------------------------------------------------------------
# the environment (HF's, with the bounds)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """HF's tojson: jinja's own escapes HTML characters, which no chat template wants."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.wraps(generate_lorem_ipsum)
def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    limit = _limit()
    if isinstance(n, int) and isinstance(max, int):
        _refuse_size(n * max * 12, limit, "lipsum() would make a value")
    return generate_lorem_ipsum(n, html, min, max)


def _bounded_output(value: Any) -> Any:
    """jinja's finalize: a printed value is checked before str() builds it."""
    if not isinstance(value, str):
        _refuse_size(_size(value, _limit()), _limit(), "printing a value")
    return value


class _NoTemplateFiles(jinja2.BaseLoader):
    """A template from a model file must not read other files."""

    def get_source(self, environment: jinja2.Environment, template: str) -> Any:
        raise SecurityError(f"a chat template cannot include, import or extend other templates ({template!r})")


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` calls environment.join_strings (checked) instead of jinja's str_join."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.join_strings((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """HF's chat-template environment plus the size checks (see the module doc)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                         loader=_NoTemplateFiles(), finalize=_bounded_output, cache_size=0)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["lipsum"] = _bounded_lipsum

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = _limit()
        if operator == "**":
            if (isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
                    and left.bit_length() * right // 3 > limit):
                raise _Refused(f"a number of more than {limit} digits")
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                if (left.bit_length() + right.bit_length()) // 3 > limit:
                    raise _Refused(f"a number of more than {limit} digits")
            else:
                for seq, n in ((left, right), (right, left)):
                    if isinstance(n, int) and n > 0 and isinstance(seq, _SEQUENCES):
                        _refuse_size(_size(seq, limit) * n, limit, "'*' would make a value")
        elif operator == "+":
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                _refuse_size(_size(left, limit) + _size(right, limit), limit, "'+' would make a value")
        elif operator == "%" and isinstance(left, (str, bytes, bytearray)):
            _check_format(_as_text(left), right, limit, braces=False)
        return _account(self.binop_table[operator](left, right), f"'{operator}'")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        target = getattr(__obj, "__wrapped__", __obj)   # the sandbox wraps str.format
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "a call")
        if isinstance(owner, (str, bytes, bytearray)):
            _check_str_method(_as_text(owner), name, tuple(_as_text(a) for a in args), kwargs, _limit())
        return _account(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def join_strings(self, parts: tuple) -> str:
        """``~``: each operand checked before str() builds it, the total before joining."""
        limit = _limit()
        texts, total = [], 0
        for p in parts:
            if not isinstance(p, str):
                _refuse_size(_size(p, limit), limit, "'~' was given a value")
                p = str(p)
            total += len(p)
            _refuse_size(total, limit, "'~' would make a value")
            texts.append(p)
        return _account("".join(texts), "'~'")

    def concat(self, pieces: Any) -> str:  # type: ignore[override]
        """Captured blocks ({% set %}...{% endset %}, macros, filter blocks): checked before joining."""
        parts = pieces if isinstance(pieces, list) else list(pieces)
        _refuse_size(sum(map(len, parts)), _limit(), "a captured block or macro would make a value")
        return _account("".join(parts), "a captured block or macro")


@functools.lru_cache(maxsize=None)
def _environment() -> _ChatSandbox:
    return _ChatSandbox()


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    """Compiled once per source: a chat renders its template every turn."""
    return _environment().from_string(source)


def _template_line(tb: Any) -> int | None:
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe(e: BaseException) -> str:
    """What went wrong, in one line, with the template line where known."""
    if isinstance(e, TemplateSyntaxError):
        return f"line {e.lineno}: {_one_line(e.message or 'syntax error')}"
    if isinstance(e, _TemplateRaised):
        return _one_line(str(e)) or "the template raised an exception"
    if isinstance(e, (_Refused, TemplateError)):
        text = str(e) or type(e).__name__
    elif isinstance(e, RecursionError):
        text = "too deeply nested (recursion)"
    elif isinstance(e, MemoryError):
        text = "out of memory"
    else:
        text = f"{type(e).__name__}: {e}"
    line = _template_line(e.__traceback__)
    return _one_line(text) if line is None else f"line {line}: {_one_line(text)}"


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


def _checked_messages(messages: Any, prefix: str) -> list[dict]:
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
            self._template = _compile(source)
        except Exception as e:  # syntax errors, unknown filters, recursion in the parser ...
            raise ChatTemplateError(f"{self._prefix}: {_describe(e)}") from None

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
        variables.update(messages=_checked_messages(messages, self._prefix),
                         add_generation_prompt=bool(add_generation_prompt),
                         bos_token=bos_token, eos_token=eos_token, tools=tools)
        return self._render_bounded(variables)

    def _render_bounded(self, variables: dict[str, Any]) -> str:
        guard = _RenderGuard(self.max_output_chars, self.time_limit, self.memory_limit)
        outer_guard = getattr(_active, "guard", None)
        outer_trace = sys.gettrace()
        chunks: list[str] = []
        total = 0
        _active.guard = guard
        sys.settrace(guard.trace_calls)
        stream = None
        try:
            stream = self._template.generate(**variables)
            for chunk in stream:
                total += len(chunk)
                if total > self.max_output_chars:
                    raise _Refused(f"the output is longer than {self.max_output_chars} characters")
                chunks.append(chunk)
        except Exception as e:
            raise ChatTemplateError(f"{self._prefix}: {_describe(e)}") from None
        finally:
            sys.settrace(outer_trace)
            _active.guard = outer_guard
            if stream is not None:
                try:
                    stream.close()
                except Exception:
                    pass
        return "".join(chunks)


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
