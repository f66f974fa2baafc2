"""A chat request's tools and reasoning: what the template gets, how sampling changes, and
the parser of each choice's output (the glue between serving_chat and
kvflow/entrypoints/tools.py, tool_parsers/ and reasoning_parsers.py)."""

from __future__ import annotations

from kvflow.entrypoints.openai.chat_parsing import ChoiceParser
from kvflow.entrypoints.openai.server_args import ServerArgs
from kvflow.entrypoints.reasoning_parsers import reasoning_parser_class
from kvflow.entrypoints.tool_parsers import detect_tool_parser, tool_parser_class
from kvflow.entrypoints.tools import (ToolPlan, messages_for_template, plan_tools,
                                      template_knows_tools)
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams


class ChatTools:
    def __init__(self, tokenizer, args: ServerArgs, req) -> None:
        self.args = args
        tools = getattr(req, "tools", None)
        tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        choice = getattr(req, "tool_choice", None)
        if hasattr(choice, "model_dump"):
            choice = choice.model_dump()
        self.plan: ToolPlan | None = plan_tools(tools, choice,
                                                getattr(req, "parallel_tool_calls", None))
        templates = getattr(tokenizer, "chat_templates", {}) or {}
        template = templates.get("default")
        if self.plan is not None and self.plan.render_tools and "tool_use" in templates:
            template = templates["tool_use"]
        self.knows_tools = template_knows_tools(template)
        self.parser_name = args.tool_call_parser or (
            detect_tool_parser(template) if self.knows_tools else "hermes")
        self.tokenizer = tokenizer
        self.drop: tuple[str, ...] = ()
        """Special-token texts to remove from the output (see sampling_params)."""
        self.prompt = ""
        """The rendered prompt (the reasoning parser reads whether it opened a think
        block)."""

    def template_input(self, messages: list[dict], template_kwargs: dict | None
                       ) -> tuple[list[dict], dict | None]:
        """(messages, template variables) for the chat template."""
        render = self.plan is not None and self.plan.render_tools
        messages = messages_for_template(messages, self.plan.tools if render else None,
                                         self.knows_tools)
        if render and self.knows_tools:
            template_kwargs = {**(template_kwargs or {}), "tools": self.plan.tools}
        return messages, template_kwargs

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        if self.plan is None or self.plan.mode == "none":
            return params
        schema = self.plan.schema()
        if schema is not None:  # required / named: the grammar engine enforces the call
            if params.structured_outputs is not None:
                raise InvalidParameterError(
                    f"tool_choice {self.plan.mode!r} constrains the output to tool calls "
                    f"and cannot be combined with another constraint (response_format, "
                    f"structured_outputs)", param="tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=schema)
            return params
        if self.plan.mode == "auto" and tool_parser_class(self.parser_name) \
                .needs_special_tokens and params.skip_special_tokens:
            # The format's markers are special tokens; the end-of-turn ones that now reach
            # the text too are dropped again by the choice parser.
            params.skip_special_tokens = False
            self.drop = tuple(t for t in (self.tokenizer.decode([i], skip_special_tokens=False)
                                          for i in sorted(self.tokenizer.eos_token_ids)) if t)
        return params

    def choice_parser(self) -> ChoiceParser | None:
        """A parser for one choice's output, or None when the text is all content."""
        reasoning = reasoning_parser_class(self.args.reasoning_parser)(self.prompt) \
            if self.args.reasoning_parser else None
        tools = self.plan.parser(self.parser_name) if self.plan is not None else None
        if reasoning is None and tools is None:
            return None
        return ChoiceParser(reasoning, tools, self.drop)
