"""The repetition guard: end a request whose output is stuck in an exact loop.

A small model sampled at a low temperature (or greedily) often falls into a cycle: one
stanza, one list item or one token repeated until the context is full. Nothing the model
writes after the third identical copy changes the answer, yet each copy costs the user
seconds and the server a slot. The guard ends such a request with finish_reason "stop"
and stop_reason "repetition" (see docs/generation-defaults.md for why those values).

The test: the output's last ``span`` tokens are one block of ``p`` tokens repeated
(token ``i`` equals token ``i - p`` throughout), where ``span`` is at least the
request's ``repetition_guard`` and at least ``MIN_CYCLES`` copies of the block. Only the
output is looked at (a prompt that repeats itself is the user's business), and only
every ``CHECK_EVERY`` output tokens, which keeps the cost per step negligible: a loop is
caught at most CHECK_EVERY tokens late.

Pure Python, no torch: the scheduler calls it.
"""

from __future__ import annotations

# Three identical copies in a row: two can be a refrain, three of a stanza or a sentence
# is a loop in practice.
MIN_CYCLES = 3
# Longest block looked for (a stanza of a poem is 30-80 tokens); longer cycles are rare
# and would need MIN_CYCLES * 256 = 768 repeated tokens before the guard could fire.
MAX_PERIOD = 256
CHECK_EVERY = 8
# The default span (--repetition-guard): a run of 64 identical tokens, or 3 copies of a
# block of 22+ tokens. A markdown rule or a table separator is far shorter.
DEFAULT_GUARD = 64


def loop_period(tokens: list[int], start: int, min_span: int) -> int | None:
    """The period of an exact loop that ends ``tokens``, looking only at
    ``tokens[start:]``: the smallest ``p`` such that the last ``max(min_span,
    MIN_CYCLES * p)`` tokens repeat with period ``p``; None when there is none."""
    n = len(tokens)
    avail = n - start
    if min_span <= 0 or avail < min_span:
        return None
    last = tokens[-1]
    for p in range(1, min(MAX_PERIOD, avail // MIN_CYCLES) + 1):
        span = max(min_span, MIN_CYCLES * p)
        if span > avail:
            break
        if tokens[n - 1 - p] != last:
            continue  # cheap filter: most periods fail on the last token already
        if tokens[n - span + p:] == tokens[n - span:n - p]:
            return p
    return None


def should_check(num_output_tokens: int) -> bool:
    return num_output_tokens % CHECK_EVERY == 0
