"""Prompt-lookup proposer and --speculative-config validation."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.config import SpeculativeConfig
from kvflow.engine.args import EngineArgs, parse_speculative_config
from kvflow.errors import InvalidParameterError
from kvflow.spec_decode import make_proposer
from kvflow.spec_decode.ngram import NgramProposer


def test_longest_then_latest_match():
    p = NgramProposer(3, 1, 3)
    #                 0  1  2  3  4  5  6  7  8  9 10
    toks = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # Suffix 3-gram (3, 6, 7) never occurred; 2-gram (6, 7) at 1 and 6: latest is 6 -> 2, 3, 6.
    assert p.propose_one(toks, 3) == [2, 3, 6]
    assert p.propose_one(toks, 1) == [2]
    toks = np.array([1, 2, 3, 4, 9, 9, 2, 3, 4])  # 3-gram (2, 3, 4) at 1 -> 9, 9, 2
    assert p.propose_one(toks, 3) == [9, 9, 2]
    # The continuation may run into the suffix itself, and stops at the end.
    assert p.propose_one(np.array([4, 4, 4]), 3) == [4]


def test_no_match_and_limits():
    p = NgramProposer(4, 2, 3)
    assert p.propose_one(np.array([1, 2, 3, 4, 5]), 4) == []  # nothing recurs
    assert p.propose_one(np.array([1, 2, 1, 2]), 0) == []
    assert p.propose_one(np.array([7]), 4) == []
    assert p.propose([np.array([1, 2, 3, 1, 2]), np.array([9])], [4, 4]) == [[3, 1, 2], []]
    assert p.propose([np.array([1, 2, 3, 1, 2])], [1]) == [[3]]


def test_make_proposer_from_config():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, '
                                   '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    p = make_proposer(cfg)
    assert (p.num_speculative_tokens, p.min_n, p.max_n) == (2, 2, 5)


@pytest.mark.parametrize("value, match", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', r"in \[1, 16\]"),
    ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}',
     "unknown option.*lookahead"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_max must be"),
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_config(value, match):
    with pytest.raises(InvalidParameterError, match=match) as e:
        parse_speculative_config(value)
    assert e.value.param.startswith("speculative_config")


def test_engine_args_turn_async_scheduling_off():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = EngineArgs(load_format="dummy", device="cpu", speculative_config=spec,
                     max_model_len=256).create_engine_config()
    assert cfg.speculative == SpeculativeConfig("ngram", 3)
    assert not cfg.scheduler.async_scheduling
    with pytest.raises(InvalidParameterError, match="async_scheduling cannot"):
        EngineArgs(load_format="dummy", device="cpu", speculative_config=spec,
                   async_scheduling=True).create_engine_config()
