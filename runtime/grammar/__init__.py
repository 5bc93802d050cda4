"""Structured output: generation constrained to a JSON schema, a Lark
grammar or a regex, enforced token by token in the sampler (llguidance
computes the allowed tokens; the native sampler masks the rest)."""
from .constraint import Constraint, ConstraintError, json_object, json_schema, lark, regex
from .matcher import GrammarMatcher

__all__ = ["Constraint", "ConstraintError", "GrammarMatcher", "json_object", "json_schema", "lark", "regex"]
