"""Structured output: a request's `grammar` (GBNF), `json_schema` or `response_format` -> one GBNF grammar.

JSON schemas become GBNF with llama-cpp-python's converter (`llama_grammar.SchemaConverter` of its Python layer, the
Python port of llama.cpp's converter, with llama.cpp's rule for a string's characters); every grammar is parsed once
here by llama.cpp's own parser (`llama_sampler_init_grammar`), so a bad one is a 400 that quotes the parser's
message, before the engine sees the request. The engine's sampler then applies the grammar to generated tokens only
(never the prompt).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from .._llama_cpp.llama_grammar import BuiltinRule, SchemaConverter
from .._runtime import llama_cpp as lc
from .errors import invalid_request

log = logging.getLogger(__name__)

_parse_lock = threading.Lock()


def check_grammar(vocab: lc.llama_vocab_p, grammar: str, field: str) -> None:
    """Parse `grammar` with llama.cpp's parser; 400 naming `field` and quoting the parser's error if it fails.

    The parser prints its error with fprintf(stderr) (not through llama.cpp's log callback), so stderr (fd 2) is
    pointed at a temporary file for the parse, under a lock, and whatever it holds is written back to stderr."""
    with _parse_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            smpl = lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        printed = tmp.read().decode("utf-8", "replace")
    if smpl:
        lc.llama_sampler_free(smpl)
        if printed:
            sys.stderr.write(printed)
        return
    log.info("grammar refused: %s", printed.strip())
    why = [ln.split("error parsing grammar:", 1)[1].strip() for ln in printed.splitlines()
           if "error parsing grammar:" in ln]
    msg = why[0] if why else "llama.cpp could not parse it"
    raise invalid_request(f"\"{field}\": invalid grammar: {msg[:300]}")


# JSON-schema keywords the converter turns into grammar rules; any other keyword would be silently dropped by it,
# so a schema using one is refused (400 naming it) rather than answered with output that may not validate.
_ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
             "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern",
             "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
                "writeOnly", "deprecated", "strict", "discriminator"}
_FORMATS = {"uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5", "date", "time", "date-time"}
_MAX_ENUMERATED = 10000  # an integer range [min, max] of at most this many values becomes alternatives


def _check_schema(node: Any, path: str) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError(f"{path or 'the schema'} must be an object")
    for k in node:
        if k not in _ENFORCED and k not in _ANNOTATIONS:
            raise ValueError(f"keyword \"{k}\" at {path or '/'} is not supported (the grammar cannot enforce it)")
    fmt = node.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise ValueError(f"\"format\": \"{fmt}\" at {path or '/'} is not supported")
    bounds = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node]
    if bounds and node.get("type") != "integer":
        raise ValueError(f"\"{bounds[0]}\" at {path or '/'} is supported for integers only")
    for k in ("properties", "$defs", "definitions"):
        for name, sub in (node.get(k) or {}).items():
            _check_schema(sub, f"{path}/{k}/{name}")
    for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for i, sub in enumerate(node.get(k) or []):
            _check_schema(sub, f"{path}/{k}/{i}")
    for k in ("items", "additionalProperties"):
        sub = node.get(k)
        if isinstance(sub, list):
            for i, x in enumerate(sub):
                _check_schema(x, f"{path}/{k}/{i}")
        elif sub is not None:
            _check_schema(sub, f"{path}/{k}")


def _int_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    lo = schema.get("minimum")
    hi = schema.get("maximum")
    if "exclusiveMinimum" in schema:
        lo = math.floor(schema["exclusiveMinimum"]) + 1
    if "exclusiveMaximum" in schema:
        hi = math.ceil(schema["exclusiveMaximum"]) - 1
    return (None if lo is None else math.ceil(lo)), (None if hi is None else math.floor(hi))


# A JSON string's character as llama.cpp's converter writes it (common/json-schema-to-grammar.cpp): no raw control
# character (U+0000-U+001F) or DEL, which JSON forbids inside strings; llama-cpp-python's port allows any character
# but '"' and '\\', so a sampled control character made the answer invalid JSON (a tool call then read as content)
JSON_CHAR = BuiltinRule(r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})', [])


class Converter(SchemaConverter):
    """llama-cpp-python's converter, plus integer bounds (which it ignores): a bounded range becomes its
    values as alternatives, `minimum` 0 or 1 alone a digit pattern; other bounds are refused. A string's
    characters follow llama.cpp's rule (JSON_CHAR)."""

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return str(SchemaConverter._add_primitive(self, name, JSON_CHAR if name == "char" else rule))

    def visit(self, schema: dict[str, Any], name: str) -> str:
        if isinstance(schema, dict) and schema.get("type") == "integer" and any(
                k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            lo, hi = _int_bounds(schema)
            rule_name = name or "root"
            if lo is not None and hi is not None:
                if hi < lo:
                    raise ValueError(f"integer range [{lo}, {hi}] at {name or '/'} is empty")
                if hi - lo + 1 > _MAX_ENUMERATED:
                    raise ValueError(f"integer range [{lo}, {hi}] is too wide (at most {_MAX_ENUMERATED} values)")
                alts = " | ".join(f'"{v}"' for v in range(lo, hi + 1))
                return str(self._add_rule(rule_name, f"({alts}) space"))
            if hi is None and lo in (0, 1):
                digits = "[1-9] [0-9]{0,15}" + (' | "0"' if lo == 0 else "")
                return str(self._add_rule(rule_name, f"({digits}) space"))
            raise ValueError("integer bounds are supported as a [minimum, maximum] range or minimum 0 or 1")
        # the base's visit, named by its class (as super() would find it) so that mypy sees llama-cpp-python's
        # unannotated method, whose calls pyproject's untyped_calls_exclude admits
        return str(SchemaConverter.visit(self, schema, name))

    def visit_checked(self, schema: Any, name: str) -> str:
        """The rule name for `schema` (checked for keywords the grammar cannot enforce, $refs resolved)."""
        _check_schema(schema, "")
        return self.visit(self.resolve_refs(schema, "input"), name)


def schema_converter() -> Converter:
    return Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def schema_to_grammar(schema: Any, field: str, rule: str = "") -> str:
    """GBNF for `schema`; its rule is `root`, or `rule` where the grammar goes inside another."""
    if not isinstance(schema, dict):
        raise invalid_request(f"\"{field}\" must be a JSON schema object")
    if not schema:
        schema = {"type": "object"}  # llama-server: an empty schema means any object
    try:
        conv = schema_converter()
        conv.visit_checked(schema, rule)
        return str(conv.format_grammar())
    except Exception as e:  # noqa: BLE001 - the converter asserts on what it cannot convert
        raise invalid_request(f"\"{field}\": cannot convert this JSON schema to a grammar: {e}") from None


ANSWER_RULE = "answer"  # the schema's rule where `think` puts reasoning in front of it


def grammar_from(body: dict[str, Any], vocab: lc.llama_vocab_p,
                 think: Callable[[str, str], str] | None = None) -> str | None:
    """The request's grammar, if it asks for one (llama-server's rules: `json_schema` and `grammar` exclude each
    other; `response_format` {json_object [, schema]} or {json_schema: {schema}}; "text" is no constraint).
    `think(answer_rule, grammar)`: on a thinking template, a schema's grammar with the reasoning the model may
    write before the JSON (reasoning.think_first); a `grammar` given as GBNF is the request's own and is taken
    as it is, as llama-server does."""
    grammar = body.get("grammar")
    schema = body.get("json_schema")
    if grammar is not None and not isinstance(grammar, str):
        raise invalid_request("\"grammar\" must be a string (GBNF)")
    if schema is not None and grammar:
        raise invalid_request("Cannot use both json_schema and grammar")
    field = "json_schema"
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise invalid_request("\"response_format\" must be an object")
        kind = rf.get("type")
        if kind == "json_object":
            if "schema" in rf or schema is None:
                schema, field = rf.get("schema") or {}, "response_format.schema"
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if not isinstance(wrapper, dict):
                raise invalid_request("\"response_format.json_schema\" must be an object with a \"schema\"")
            schema, field = wrapper.get("schema") or {}, "response_format.json_schema.schema"
        elif kind not in (None, "text"):
            raise invalid_request(f"response_format type must be one of \"text\", \"json_object\" or "
                                  f"\"json_schema\", but got: {kind}")
        if schema is not None and grammar:
            raise invalid_request("Cannot use both response_format and grammar")
    if schema is not None:
        g = schema_to_grammar(schema, field) if think is None else \
            think(ANSWER_RULE, schema_to_grammar(schema, field, ANSWER_RULE))
        check_grammar(vocab, g, field)
        return g
    if grammar:
        check_grammar(vocab, grammar, "grammar")
        return grammar
    return None
