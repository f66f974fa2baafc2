"""Tool-call and reasoning parsers on text: every format whole and streamed one character
at a time (the deltas must add up to the whole result), malformed calls kept as content,
and the tools checks (schemas against the JSON Schema meta-schema, tool_choice)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvflow.entrypoints.openai.chat_parsing import ChoiceParser
from kvflow.entrypoints.reasoning_parsers import (DeepSeekR1ReasoningParser,
                                                  Qwen3ReasoningParser)
from kvflow.entrypoints.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                             MistralToolParser, NamedCallParser,
                                             RequiredCallsParser, detect_tool_parser)
from kvflow.entrypoints.tools import (check_parameters_schema, messages_for_template,
                                      plan_tools)
from kvflow.errors import InvalidParameterError

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
W_ARGS = '{"city": "Paris", "days": [1, 2]}'
T = '{"name": "get_time", "arguments": {"tz": "a \\"quoted\\" } brace"}}'
T_ARGS = '{"tz": "a \\"quoted\\" } brace"}'

CASES = [
    # (parser factory, model output, content, [(name, arguments)])
    (HermesToolParser, f"Let me check.\n<tool_call>\n{W}\n</tool_call>",
     "Let me check.", [("get_weather", W_ARGS)]),
    (HermesToolParser, f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>\n",
     None, [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (HermesToolParser, "No tools needed: 2 < 3 and <b>bold</b>  \n",
     "No tools needed: 2 < 3 and <b>bold</b>  \n", []),
    (HermesToolParser, "<tool_call>not json</tool_call> ok",
     "<tool_call>not json</tool_call> ok", []),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
     None, [("f", '{"a": 1}')]),
    (HermesToolParser, '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     None, [("f", '{"a": 1}')]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
     '{"name": "g", "parameters": {}}', None, [("f", '{"x": 1}'), ("g", "{}")]),
    (Llama3JsonToolParser, ' {"name": "f", "parameters": {"x": "y"}}', None,
     [("f", '{"x": "y"}')]),
    (Llama3JsonToolParser, '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonToolParser, "The answer is {x}.", "The answer is {x}.", []),
    (MistralToolParser, f"Sure. [TOOL_CALLS][{W}, {T}]", "Sure.",
     [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (MistralToolParser, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    (RequiredCallsParser, f"[{W}, {T}]", None,
     [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (lambda: RequiredCallsParser(max_calls=1), f"[{W}, {T}]", None,
     [("get_weather", W_ARGS)]),
    (lambda: HermesToolParser(max_calls=1),
     f"<tool_call>{W}</tool_call><tool_call>{T}</tool_call>", None,
     [("get_weather", W_ARGS)]),
    (lambda: NamedCallParser("get_weather"), W_ARGS, None, [("get_weather", W_ARGS)]),
]


def _run(parser, pieces: list[str]) -> tuple[str | None, list, list[dict]]:
    """Stream ``pieces`` through a ChoiceParser: (content, calls, deltas)."""
    p = ChoiceParser(None, parser)
    deltas = [p.feed(x) for x in pieces[:-1]] + [p.finish(pieces[-1])]
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:  # a call's first delta: id, type and name together
                assert c["type"] == "function"
                assert c["index"] not in calls
                calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                assert "name" not in c["function"]
                calls[c["index"]][1] += c["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize("factory,text,content,calls", CASES)
def test_parsers_whole_and_streamed(factory, text, content, calls):
    whole = ChoiceParser(None, factory()).message(text)
    assert whole["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in whole["tool_calls"]] == calls
    for c in whole["tool_calls"]:  # Mistral's templates take back 9-character ids only
        assert len(c["id"]) == 9 if factory is MistralToolParser else \
            c["id"].startswith("call_")
    for args in (a for _, a in calls):
        json.loads(args)
    # Every character its own delta, as a byte-level stream can deliver them.
    got_content, got_calls, deltas = _run(factory(), list(text) + [""])
    assert (got_content, got_calls) == (content, calls)
    if calls:  # nothing of the markup reaches content
        for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
            assert marker not in (got_content or "")


def test_finish_reason_is_tool_calls_only_with_calls():
    p = ChoiceParser(None, HermesToolParser())
    p.message(f"<tool_call>{W}</tool_call>")
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    p = ChoiceParser(None, HermesToolParser())
    p.message("plain")
    assert p.finish_reason("stop") == "stop"


@pytest.mark.parametrize("cls,prompt,text,reasoning,content", [
    (Qwen3ReasoningParser, "", "<think>\nWhy?\n</think>\n\nBecause.", "\nWhy?\n",
     "Because."),
    (Qwen3ReasoningParser, "", "Plain answer, no <think> here", None,
     "Plain answer, no <think> here"),
    (Qwen3ReasoningParser, "<|im_start|>assistant\n<think>\n", "hm</think>ok", "hm", "ok"),
    (Qwen3ReasoningParser, "", "<think>cut short", "cut short", None),
    (DeepSeekR1ReasoningParser, "", "no opening tag</think>Answer", "no opening tag",
     "Answer"),
    (DeepSeekR1ReasoningParser, "", "<think>x</think>y", "x", "y"),
    (DeepSeekR1ReasoningParser, "", "all thinking", "all thinking", None),
])
def test_reasoning_parsers(cls, prompt, text, reasoning, content):
    whole = ChoiceParser(cls(prompt), None).message(text)
    assert (whole["reasoning_content"], whole["content"]) == (reasoning, content)
    p = ChoiceParser(cls(prompt), None)
    deltas = [p.feed(ch) for ch in text] + [p.finish()]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")


def test_tool_calls_after_reasoning():
    text = f"<think>The user wants weather.</think>\n\nChecking.\n<tool_call>{W}</tool_call>"
    for pieces in ([text], list(text)):
        p = ChoiceParser(Qwen3ReasoningParser(""), HermesToolParser())
        deltas = [p.feed(x) for x in pieces] + [p.finish()]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == \
            "The user wants weather."
        assert "".join(d.get("content", "") for d in deltas) == "Checking."
        args = "".join(c["function"]["arguments"] for d in deltas
                       for c in d.get("tool_calls", []))
        assert args == W_ARGS and p.called


def test_detect_tool_parser():
    assert detect_tool_parser("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_tool_parser(None) == "hermes"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
TOOL_G = {"type": "function", "function": {"name": "g"}}


@pytest.mark.parametrize("schema,says", [
    ({"type": 5}, "not a valid JSON Schema"),
    ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "not a valid JSON Schema"),
    ({"type": "array"}, "type 'object'"),
    ({"type": "object", "properties": {"a": {"items": {"items": {"items": {}}}}}},
     None),
])
def test_parameters_schema_check(schema, says):
    if says is None:
        assert check_parameters_schema(schema) is schema
        return
    with pytest.raises(ValueError, match=says):
        check_parameters_schema(schema)
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="deeper"):
        check_parameters_schema(deep)


def test_plan_tools_checks_tool_choice():
    with pytest.raises(InvalidParameterError) as e:
        plan_tools([TOOL], {"type": "function", "function": {"name": "nope"}}, None)
    assert e.value.param == "tool_choice" and "nope" in e.value.message
    with pytest.raises(InvalidParameterError) as e:
        plan_tools(None, "required", None)
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidParameterError) as e:
        plan_tools([TOOL, TOOL], "auto", None)
    assert e.value.param == "tools"
    assert plan_tools(None, "auto", None) is None
    assert plan_tools([TOOL], "none", None).parser("hermes") is None
    assert plan_tools([TOOL], None, None).mode == "auto"


def test_required_and_named_schemas_accept_only_valid_calls():
    plan = plan_tools([TOOL, TOOL_G], "required", False)
    schema = plan.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "f", "arguments": {"a": 1}}]
    jsonschema.validate(ok, schema)
    jsonschema.validate([{"name": "g", "arguments": {"any": "thing"}}], schema)
    for bad in ([], [{"name": "f", "arguments": {"a": "x"}}], [{"name": "h", "arguments": {}}],
                ok + ok):  # two calls with parallel_tool_calls false
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = plan_tools([TOOL, TOOL_G], {"type": "function", "function": {"name": "f"}}, None)
    assert named.schema() == TOOL["function"]["parameters"]


def test_default_tool_prompt_and_history_for_templates_without_tools():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "warm"}]
    out = messages_for_template(msgs, [TOOL], knows_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOL) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                 "<tool_response>\nwarm\n</tool_response>")
    # Templates with tools get the arguments as objects (they write them with tojson).
    out = messages_for_template(msgs, [TOOL], knows_tools=True)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[3] == msgs[3]


def test_end_of_turn_tokens_kept_for_special_markers_are_dropped():
    # llama3_json and mistral keep special tokens in the text (their markers are special
    # tokens), so the end-of-turn token reaches the text and must not break the call.
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}<|eom_id|>'
    for pieces in ([text], ['<|python_tag|>', '{"name": "f", ', '"parameters": {"x": 1}}',
                            "<|eom_id|>"]):
        p = ChoiceParser(None, Llama3JsonToolParser(), drop=("<|eot_id|>", "<|eom_id|>"))
        deltas = [p.feed(x) for x in pieces] + [p.finish()]
        assert not any("content" in d for d in deltas)
        assert "".join(c["function"]["arguments"] for d in deltas
                       for c in d.get("tool_calls", [])) == '{"x": 1}'
    p = ChoiceParser(None, Llama3JsonToolParser(), drop=("<|eot_id|>",))
    assert p.message("Hello.<|eot_id|>")["content"] == "Hello."
