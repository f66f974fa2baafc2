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
