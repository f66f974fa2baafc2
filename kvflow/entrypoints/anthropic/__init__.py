"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over kvflow's
chat machinery, with Anthropic's request, response, stream and error shapes."""
