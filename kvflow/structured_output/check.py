"""Checks of a constraint before it enters the engine (API process / LLM.generate).

A schema bomb (deep nesting, huge enums, a long text) is refused by counting, before any
grammar work; then xgrammar parses the constraint without the vocabulary (milliseconds),
which finds an invalid schema, an unknown ``$ref``, a regex or grammar that does not
compile. Everything raises InvalidParameterError naming the field.
"""

from __future__ import annotations

import json
import re

# Imported with this module (at server start): a first import takes seconds, which the
# first constrained request must not pay before its 400.
import xgrammar as xgr

from kvflow.errors import InvalidParameterError
from kvflow.structured_output.limits import DEFAULT_LIMITS, ConstraintLimits
from kvflow.sampling_params import StructuredOutputsParams

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _refuse(param: str, message: str) -> None:
    raise InvalidParameterError(f"{param} {message}", param=param)


def _count(value, param: str, limits: ConstraintLimits) -> None:
    """Walk a schema iteratively (no recursion for a hostile depth to exhaust)."""
    stack = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            _refuse(param, f"is too large: more than {limits.max_nodes} JSON values")
        if depth > limits.max_depth:
            _refuse(param, f"is nested too deeply: more than {limits.max_depth} levels")
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > limits.max_enum:
                _refuse(param, f"has an enum of {len(enum)} values; at most "
                        f"{limits.max_enum} are allowed")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def check_constraint(so: StructuredOutputsParams, limits: ConstraintLimits = DEFAULT_LIMITS,
                     param: str | None = None) -> None:
    """Refuse a constraint the engine must not try to compile.

    ``param`` names the field in the error (e.g. ``response_format.json_schema.schema``);
    default ``structured_outputs.<kind>``.
    """
    kind = so.kind
    param = param or f"structured_outputs.{kind}"
    if kind == "json_object":
        return
    if kind == "choice":
        if len(so.choice) > limits.max_enum:
            _refuse(param, f"has {len(so.choice)} choices; at most {limits.max_enum} are "
                    f"allowed")
        if sum(map(len, so.choice)) > limits.max_chars:
            _refuse(param, f"is longer than {limits.max_chars} characters in all")
        return
    text = so.key()[1]
    if len(text) > limits.max_chars:
        _refuse(param, f"is longer than {limits.max_chars} characters ({len(text)})")
    try:
        if kind == "json":
            _count(json.loads(text), param, limits)
            xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except InvalidParameterError:
        raise
    except Exception as e:  # xgrammar's parse errors: RuntimeError / ValueError
        what = {"json": "is not a JSON schema the grammar engine accepts",
                "regex": "is not a regular expression the grammar engine accepts",
                "grammar": "is not a GBNF grammar the grammar engine accepts"}[kind]
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        detail = _LOG_PREFIX.sub("", lines[0])[:300] if lines else type(e).__name__
        raise InvalidParameterError(f"{param} {what}: {detail}", param=param) from None
