"""Tools through published chat templates (faithful copies of Qwen2.5's, Qwen3's,
Llama 3.1's and Mistral's, in tests/chat_templates/): kvflow's renderer, given what the
server passes (messages_for_template, ``tools``, chat_template_kwargs), must render exactly
what transformers' apply_chat_template renders from the same template and tokenizer."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvflow.engine.tokenizer import Tokenizer
from kvflow.entrypoints.tool_parsers import detect_tool_parser
from kvflow.entrypoints.tools import (messages_for_template, template_knows_tools)

TokenizersBackend = pytest.importorskip(
    "transformers.tokenization_utils_tokenizers").TokenizersBackend

HERE = os.path.join(os.path.dirname(__file__), "chat_templates")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def _history(call_id: str) -> list[dict]:
    """A tool round trip as the API receives it (arguments as JSON text)."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris? Grüße 😀"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 18}'},
        {"role": "user", "content": "And in Rome?"},
    ]


def _reference_history(call_id: str) -> list[dict]:
    """The same conversation as transformers' docs write it (arguments as an object)."""
    msgs = _history(call_id)
    msgs[2] = {**msgs[2], "tool_calls": [{**msgs[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    return msgs


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(["hello world weather tools"] * 4, trainers.BpeTrainer(
        vocab_size=300, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|bos|>", "<|eos|>"]))
    folder = tmp_path_factory.mktemp("tok")
    rust.save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return str(folder)


def _render_both(folder: str, template: str, messages: list[dict], ref_messages: list[dict],
                 tools: list[dict] | None, **kwargs) -> tuple[str, str]:
    mine = Tokenizer.from_path(folder)
    ref = TokenizersBackend.from_pretrained(folder)
    assert template_knows_tools(template)
    sent = messages_for_template(messages, tools, knows_tools=True)
    extra = {"tools": tools} if tools else {}
    text = mine.apply_chat_template(sent, chat_template=template, **extra, **kwargs)
    expected = ref.apply_chat_template(ref_messages, chat_template=template, tools=tools,
                                       tokenize=False, add_generation_prompt=True, **kwargs)
    return text, expected


@pytest.mark.parametrize("name,parser", [("qwen2_5", "hermes"), ("qwen3", "hermes"),
                                         ("llama3_1", "llama3_json"),
                                         ("mistral", "mistral")])
def test_tools_render_as_transformers_does(tokenizer_dir, name, parser):
    with open(os.path.join(HERE, f"{name}.jinja")) as f:
        template = f.read()
    assert detect_tool_parser(template) == parser
    call_id = "abc123XYZ"  # Mistral's template wants 9 characters
    history = _history(call_id)
    if name == "llama3_1":  # its template puts the tools into the first user message
        history, ref = history[1:], _reference_history(call_id)[1:]
    else:
        ref = _reference_history(call_id)
    text, expected = _render_both(tokenizer_dir, template, history, ref, TOOLS)
    assert text == expected
    assert '"get_weather"' in text and '"get_time"' in text and "Rome" in text
    assert '"city": "Paris"' in text  # the history's call, arguments as JSON
    # Without tools the template renders as plain chat, the same in both.
    plain = [{"role": "user", "content": "Hi"}]
    text, expected = _render_both(tokenizer_dir, template, plain, plain, None)
    assert text == expected and "get_weather" not in text


def test_qwen3_enable_thinking_passes_through(tokenizer_dir):
    with open(os.path.join(HERE, "qwen3.jinja")) as f:
        template = f.read()
    msgs = [{"role": "user", "content": "Hi"}]
    for flag in (True, False):
        text, expected = _render_both(tokenizer_dir, template, msgs, msgs, TOOLS,
                                      enable_thinking=flag)
        assert text == expected
        assert text.endswith("<think>\n\n</think>\n\n") is (not flag)
