"""Constrained outputs at the API: ``response_format`` (chat) and vLLM's
``structured_outputs`` field (chat and completions) -> StructuredOutputsParams.

The constraint is checked here, in the tokenizer pool, against the server's limits
(--max-structured-chars, ...), so a bad schema, regex or grammar is a 400 naming the
request field before anything reaches the engine core.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr

from kvflow.entrypoints.openai.protocol_base import _Request
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import StructuredOutputsParams


def request_models(lim) -> tuple[type, type]:
    """(ResponseFormat, StructuredOutputsRequest) pydantic models for one RequestLimits."""
    Text = Annotated[StrictStr, Field(min_length=1, max_length=lim.max_structured_chars)]

    class JsonSchemaFormat(_Request):
        """OpenAI's ``response_format.json_schema``."""

        name: Annotated[StrictStr, Field(min_length=1, max_length=64,
                                         pattern=r"^[A-Za-z0-9_-]+$")]
        description: Annotated[StrictStr, Field(max_length=4096)] | None = None
        schema_: dict[str, Any] | None = Field(
            default=None, alias="schema",
            description="the JSON Schema the output follows (none: any JSON object)")
        strict: StrictBool | None = None

    class ResponseFormat(_Request):
        """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

        type: Literal["text", "json_object", "json_schema"]
        json_schema: JsonSchemaFormat | None = None

    class StructuredOutputsRequest(_Request):
        """kvflow/vLLM extension (send it with ``extra_body``): exactly one of these."""

        json_: dict[str, Any] | Text | None = Field(
            default=None, alias="json", description="a JSON Schema (object or JSON text)")
        regex: Text | None = None
        choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(
            min_length=1, max_length=lim.max_structured_choices)] | None = None
        grammar: Text | None = Field(
            default=None, description="a GBNF grammar (llama.cpp's EBNF; start rule root)")
        json_object: StrictBool | None = None

    return ResponseFormat, StructuredOutputsRequest


def structured_params(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field that holds it (for error messages)."""
    rf = getattr(req, "response_format", None)
    so = getattr(req, "structured_outputs", None)
    out = None
    if rf is not None and rf.type != "text":
        if so is not None:
            raise InvalidParameterError("send either response_format or structured_outputs, "
                                        "not both", param="structured_outputs")
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if rf.json_schema is None:
            raise InvalidParameterError("response_format of type json_schema needs "
                                        "json_schema", param="response_format.json_schema")
        schema = rf.json_schema.schema_
        param = "response_format.json_schema.schema"
        out = StructuredOutputsParams(json_object=True) if schema is None else \
            _build(param, json=schema)
        return out, param
    if so is None:
        return None, None
    values = {"json": so.json_, "regex": so.regex, "choice": so.choice,
              "grammar": so.grammar, "json_object": bool(so.json_object)}
    out = _build("structured_outputs", **values)
    return out, f"structured_outputs.{out.kind}"


def _build(param: str, **values) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**values)
    except InvalidParameterError as e:
        name = e.param or param
        if param.startswith("response_format"):
            name = param
        raise InvalidParameterError(e.message.replace(e.param or "", name, 1)
                                    if e.param else e.message, param=name) from None


def constraint_limits(lim):
    """The engine-side ConstraintLimits for the server's RequestLimits."""
    from kvflow.structured_output.check import ConstraintLimits

    return ConstraintLimits(max_chars=lim.max_structured_chars,
                            max_depth=lim.max_structured_depth,
                            max_enum=lim.max_structured_choices)
