r"""A jinja2 sandbox for untrusted templates, bounded in time, size and memory.

Chat templates come from model files someone downloaded. The environment is
the one Hugging Face's ``apply_chat_template`` renders with (jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and
the ``loopcontrols`` extension; HF's ``tojson`` filter without HTML escaping;
the globals ``raise_exception`` and ``strftime_now``), so that well-behaved
templates render exactly as there, plus bounds so that a hostile one cannot
read files, run for ever or take the process down. Every failure is a
``SandboxError`` whose message is one line (with the template line where
known):

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
  machine's memory. The hooks: ``intercepted_binops`` and ``call_binop``,
  the sandbox's ``call``, wrapped filters, ``finalize``, the environment's
  ``concat`` (used by captured blocks and macros), and a code generator
  whose ``~`` calls a checked join;
* memory: values a template keeps (a list or namespace that grows every
  iteration) are caught by watching the process's anonymous resident memory
  (``/proc/self/statm``), sampled every 64 template lines and after every
  8 MiB of checked values; growth past ``memory_limit`` during one render is
  an error. Being process-wide, a large allocation by another thread during
  a render could be blamed on the template (renders take milliseconds).

What is not bounded: a single built-in operation is not interrupted while it
runs; those whose cost can grow faster than their input are bounded by the
predictions above, the rest are linear in values that are themselves
bounded. Compiling is bounded by the source size only.
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

__all__ = ["MAX_MEMORY_GROWTH", "MAX_OUTPUT_CHARS", "MAX_RENDER_SECONDS", "SandboxError", "compile_template",
           "render_bounded"]

#: default bounds of one render
MAX_OUTPUT_CHARS = 1 << 20
MAX_RENDER_SECONDS = 2.0
MAX_MEMORY_GROWTH = 256 << 20

_TEMPLATE_FILENAME = "<template>"   # co_filename of code compiled by Environment.from_string
_SAMPLE_EVERY_LINES = 64
_SAMPLE_EVERY_CHARS = 8 << 20


class SandboxError(Exception):
    """A template that cannot be compiled or rendered; the message is one line."""


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
    return _environment().from_string(source)


def compile_template(source: str) -> jinja2.Template:
    """Compiled once per source (a chat renders its template every turn)."""
    try:
        return _compile(source)
    except Exception as e:  # syntax errors, unknown filters, recursion in the parser ...
        raise SandboxError(_describe(e)) from None


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


def render_bounded(template: jinja2.Template, variables: dict[str, Any], max_output_chars: int = MAX_OUTPUT_CHARS,
                   time_limit: float = MAX_RENDER_SECONDS, memory_limit: int = MAX_MEMORY_GROWTH) -> str:
    """Render a compiled template within the bounds (see the module doc)."""
    guard = _RenderGuard(max_output_chars, time_limit, memory_limit)
    outer_guard = getattr(_active, "guard", None)
    outer_trace = sys.gettrace()
    chunks: list[str] = []
    total = 0
    _active.guard = guard
    sys.settrace(guard.trace_calls)
    stream = None
    try:
        stream = template.generate(**variables)
        for chunk in stream:
            total += len(chunk)
            if total > max_output_chars:
                raise _Refused(f"the output is longer than {max_output_chars} characters")
            chunks.append(chunk)
    except Exception as e:
        raise SandboxError(_describe(e)) from None
    finally:
        sys.settrace(outer_trace)
        _active.guard = outer_guard
        if stream is not None:
            try:
                stream.close()
            except Exception:
                pass
    return "".join(chunks)
