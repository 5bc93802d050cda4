"""What a request constrains its output to: a JSON schema, any JSON object,
a Lark grammar or a regular expression, compiled by llguidance into the
grammar its matcher runs (``matcher.GrammarMatcher``).

Nothing is skipped silently: a schema keyword llguidance cannot enforce
(``not``, ``uniqueItems`` ...) and a malformed grammar or regex are errors
naming the keyword or carrying the library's message (a 400 over HTTP, one
line on the command line). A constraint is bounded: its text, the time and
memory its compilation and its matcher may take (``LIMITS``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from ..errors import ConstraintError

#: how JSON is spelled: one space after a comma and a colon, no other whitespace
#: (as ``json.dumps`` and OpenAI's strict outputs): a model cannot pad its JSON with
#: endless newlines (a schema's own ``x-guidance`` options may say otherwise)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: the largest schema, grammar or regex text accepted, in bytes
MAX_SOURCE_BYTES = 256 << 10
#: llguidance's limits on what one constraint may cost: lexer states and parser
#: items per token mask, and the fuel of its compilation (its defaults, made explicit)
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)
KINDS = ("json_schema", "json_object", "lark", "regex")


@dataclass(frozen=True)
class Constraint:
    """``kind`` (one of ``KINDS``) and its text: the schema as JSON, the Lark
    grammar or the regex (empty for json_object)."""

    kind: str
    source: str = ""
    #: the request field it comes from when not its kind's own (a tool call's grammar: ``tools``)
    field: str | None = None

    @property
    def param(self) -> str:
        """The OpenAI request field it comes from (an HTTP error's ``param``)."""
        return self.field or {"lark": "grammar", "regex": "regex"}.get(self.kind, "response_format")

    def grammar(self) -> str:
        """llguidance's grammar for this constraint, checked (ConstraintError)."""
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if len(self.source.encode()) > MAX_SOURCE_BYTES:
            raise ConstraintError(f"the {self.kind.replace('_', ' ')} is {len(self.source.encode())} bytes; "
                                  f"at most {MAX_SOURCE_BYTES} are accepted")
        M = llguidance.LLMatcher
        try:
            if self.kind == "json_object":
                g = M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif self.kind == "json_schema":
                g = M.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            elif self.kind == "lark":
                g = M.grammar_from_lark(self.source)
            else:
                g = M.grammar_from_regex(self.source)
        except ValueError as e:
            raise ConstraintError(f"{self.kind.replace('_', ' ')}: {e}") from None
        bad, msgs = M.validate_grammar_with_warnings(g, None, limits=parser_limits())
        if bad:
            raise ConstraintError(_one_line(self.kind, msgs[0] if msgs else "invalid"))
        return g


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def _one_line(kind: str, msg: str) -> str:
    """llguidance's message, on one line: ``Unimplemented keys: ["not"]`` says
    which schema keyword cannot be enforced."""
    first = " ".join(msg.strip().split())
    if "Unimplemented keys" in first:
        return f"JSON schema keyword not supported (it cannot be enforced): {first.split(':', 1)[1].strip()}"
    return f"{kind.replace('_', ' ')}: {first}"[:600]


def json_schema(schema: dict[str, Any] | str) -> Constraint:
    """A constraint from a JSON schema (a dict, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"a JSON schema is an object (or true/false), not {type(schema).__name__}")
    return Constraint("json_schema", json.dumps(schema))


def json_object() -> Constraint:
    return Constraint("json_object")


def lark(grammar: str, field: str | None = None) -> Constraint:
    return Constraint("lark", grammar, field)


def regex(pattern: str) -> Constraint:
    return Constraint("regex", pattern)
