"""Tools in a chat request: the checks past the schema, what the chat template gets, the
default tool prompt for templates that know no tools, and the grammar constraint that
enforces ``tool_choice`` "required" or a named function.

The default tool prompt (templates whose source never reads ``tools``, like SmolLM2's)
is a system-prompt section in the Hermes style Qwen2.5 uses: the tools as JSON lines
inside ``<tools></tools>``, and the instruction to answer with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. Such templates also
get the history in that style: an assistant turn's ``tool_calls`` become those blocks
after its text, and ``tool`` messages become a user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta

from kvflow.entrypoints.tool_parsers import (NamedCallParser, RequiredCallsParser,
                                             ToolParser, tool_parser_class)
from kvflow.errors import InvalidParameterError

MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of a tool's ``parameters`` schema (deeper ones are refused: bounded work
for the validator, the template and the grammar compiler)."""

DEFAULT_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_SCHEMA_DEPTH:
            return d
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def check_parameters_schema(schema: dict) -> dict:
    """A tool's ``parameters``: a JSON Schema (checked against its meta-schema) for an
    object, bounded in depth. Raises ValueError (pydantic reports it with the field)."""
    import jsonschema

    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"not a valid JSON Schema{f' at {where!r}' if where else ''}: "
                         f"{e.message}") from None
    except RecursionError:
        raise ValueError("the schema is too deeply nested") from None
    if schema.get("type", "object") != "object":
        raise ValueError("the parameters of a function must be a JSON Schema of type "
                         "'object'")
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this response."""

    tools: list[dict]
    """The request's tools as plain dicts (OpenAI's shape), for the chat template."""
    mode: str
    """'none', 'auto', 'required' or 'named'."""
    function: str | None = None
    """The function a named tool_choice forces."""
    parallel: bool = True
    """parallel_tool_calls: False allows one call per response."""

    @property
    def render_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def schema(self) -> dict | None:
        """The JSON Schema the output must follow (required, named), else None."""
        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "named":
            return by_name[self.function].get("parameters") or {"type": "object"}
        if self.mode != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": name},
                                 "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, f in by_name.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def parser(self, parser_name: str) -> ToolParser | None:
        if self.mode == "named":
            return NamedCallParser(self.function)
        if self.mode == "required":
            return RequiredCallsParser(self.max_calls)
        if self.mode == "auto" and self.tools:
            return tool_parser_class(parser_name)(self.max_calls)
        return None


def plan_tools(tools: list[dict] | None, tool_choice: str | dict | None,
               parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's tools and tool_choice, checked against each other (the schema of each
    was checked by the request model). None when the request has no tools."""
    tools = tools or []
    names = [t["function"]["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidParameterError(f"function names must be unique in tools; repeated: "
                                    f"{', '.join(dup)}", param="tools")
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise InvalidParameterError(
                f"tool_choice names the function {name!r}, which is not in tools"
                + (f" (functions: {', '.join(names)})" if names else " (no tools given)"),
                param="tool_choice")
        return ToolPlan(tools, "named", name, parallel)
    if tool_choice == "required" and not tools:
        raise InvalidParameterError("tool_choice 'required' needs tools", param="tool_choice")
    if not tools:
        return None
    return ToolPlan(tools, tool_choice or "auto", None, parallel)


@lru_cache(maxsize=16)
def template_variables(template: str | None) -> frozenset[str]:
    """The variables a chat template reads from its caller."""
    if not template:
        return frozenset()
    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment(
            extensions=["jinja2.ext.loopcontrols"]).parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def template_knows_tools(template: str | None) -> bool:
    return "tools" in template_variables(template)


def default_tool_prompt(tools: list[dict]) -> str:
    return DEFAULT_TOOL_PROMPT.format(
        tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def messages_for_template(messages: list[dict], tools: list[dict] | None,
                          knows_tools: bool) -> list[dict]:
    """The conversation as the template should see it. Templates with tools get the tool
    call arguments as objects (they write them with ``tojson``); others get the default
    tool prompt and the Hermes-style history (see the module docstring)."""
    if knows_tools:
        return [_with_parsed_arguments(m) for m in messages]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
            continue
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c.get("function", {}).get("name"),
                                  "arguments": json.loads(_safe_args(c))},
                                 ensure_ascii=False) for c in m.pop("tool_calls")]
            parts = [m["content"]] if m["content"] else []
            parts += [f"<tool_call>\n{b}\n</tool_call>" for b in blocks]
            m["content"] = "\n".join(parts)
        out.append(m)
    for m in out:
        m.pop("_tool_turn", None)
    if tools:
        prompt = default_tool_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _safe_args(call: dict) -> str:
    text = _arguments_text(call.get("function", {}).get("arguments", "{}"))
    try:
        json.loads(text)
        return text
    except ValueError:
        return json.dumps(text)


def _with_parsed_arguments(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}
