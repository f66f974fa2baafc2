"""Benchmark workloads: random token prompts with exact input and output lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def length_range(mean: int, range_ratio: float, lo: int | None, hi: int | None
                 ) -> tuple[int, int]:
    """[mean * (1 - r), mean * (1 + r)], or explicit bounds when given."""
    a = lo if lo is not None else max(1, int(mean * (1 - range_ratio)))
    b = hi if hi is not None else max(a, int(mean * (1 + range_ratio)))
    if a < 1 or b < a:
        raise ValueError(f"bad length range [{a}, {b}]")
    return a, b


def random_requests(num_prompts: int, input_range: tuple[int, int],
                    output_range: tuple[int, int], vocab_size: int, seed: int = 0,
                    special_ids: set[int] | None = None) -> list[BenchRequest]:
    """Prompts of uniformly random length and uniformly random token ids (avoiding special
    tokens), with uniformly random output lengths; reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    banned = np.array(sorted(special_ids or ()), dtype=np.int64)
    reqs = []
    for n, m in zip(in_lens, out_lens):
        ids = rng.integers(0, vocab_size, size=int(n))
        if len(banned):
            bad = np.isin(ids, banned)
            while bad.any():
                ids[bad] = rng.integers(0, vocab_size, size=int(bad.sum()))
                bad = np.isin(ids, banned)
        reqs.append(BenchRequest(ids.tolist(), int(m)))
    return reqs


def shared_prefix_requests(num_prompts: int, prefix_len: int, unique_len: int,
                           output_len: int, vocab_size: int, seed: int = 0,
                           special_ids: set[int] | None = None) -> list[BenchRequest]:
    """Every prompt = one shared prefix (a long system prompt) + its own random suffix."""
    [prefix] = random_requests(1, (prefix_len, prefix_len), (1, 1), vocab_size, seed,
                               special_ids)
    tails = random_requests(num_prompts, (unique_len, unique_len),
                            (output_len, output_len), vocab_size, seed + 1, special_ids)
    return [BenchRequest(prefix.prompt_token_ids + t.prompt_token_ids, t.output_len)
            for t in tails]


# Text workloads for speculative decoding (written for kvflow). "chat": open questions,
# whose answers rarely repeat the prompt (prompt lookup finds little). "edit": a passage
# to copy back with small changes, where most of the answer is already in the prompt.
CHAT_PROMPTS = [
    "What are three good habits for staying focused while studying?",
    "Explain how a rainbow forms, in simple words.",
    "Give me a short recipe for a vegetable soup.",
    "Why do cats purr?",
    "Write a friendly note inviting my neighbours to a garden party.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain your choice.",
    "How does a bicycle stay upright when it moves?",
    "Describe a calm morning at the beach.",
    "What should I pack for a two-day hiking trip?",
    "Explain what a computer's memory does.",
    "Tell me a short story about a lost umbrella.",
    "How can I make my houseplants grow better?",
    "What are the benefits of learning a second language?",
    "Why is the sky dark at night even though there are many stars?",
    "Give three tips for writing a clear email.",
]

EDIT_PASSAGES = [
    "The village library opens at nine in the morning and closes at six in the evening. "
    "Children can borrow up to five books at a time, and adults can borrow up to ten. "
    "Every Saturday there is a reading hour for young readers, and once a month the "
    "library hosts a talk by a local author. Members who return books late pay a small "
    "fee, which helps the library buy new books.",
    "Our team meeting will take place on Thursday in the large room on the second floor. "
    "Please bring your notes from last week and a short update on your project. We will "
    "start with a review of the budget, then discuss the new schedule, and finish with "
    "questions. Coffee and biscuits will be served, and the meeting should end by noon.",
    "To plant a tree, first choose a sunny spot with enough space for the roots. Dig a "
    "hole twice as wide as the root ball and just as deep. Place the tree in the hole, "
    "fill it with soil, and press the soil down gently. Water the tree well, and keep "
    "watering it every week during the first summer so that the roots can grow strong.",
    "The train to the coast leaves the central station every hour, from six in the "
    "morning until ten at night. The journey takes about two hours and stops at four "
    "towns along the river. Tickets can be bought at the station or online, and children "
    "under twelve travel for half the price. Bicycles are allowed on every train.",
]

EDIT_INSTRUCTIONS = [
    "Rewrite the following text exactly, but replace every 'the' at the start of a "
    "sentence with 'This':\n\n",
    "Copy the following text, correcting nothing and changing nothing except writing "
    "numbers as digits:\n\n",
]


def text_requests(kind: str, num_prompts: int, output_len: int, tokenizer
                  ) -> list[BenchRequest]:
    """Chat-templated prompts of the ``chat`` or ``edit`` workload, cycled to
    ``num_prompts``; each generates exactly ``output_len`` tokens."""
    if kind == "chat":
        texts = CHAT_PROMPTS
    elif kind == "edit":
        texts = [i + p for p in EDIT_PASSAGES for i in EDIT_INSTRUCTIONS]
    else:
        raise ValueError(f"unknown text workload {kind!r}")
    reqs = []
    for i in range(num_prompts):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}])
        reqs.append(BenchRequest(tokenizer.encode(chat, add_special_tokens=False), output_len))
    return reqs
