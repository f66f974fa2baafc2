"""What an engine start keeps between starts (kvflow/layers/quantization/layout_cache.py,
kvflow/cpu/verdict.py): a GGUF model's packed layouts and the C++ step's
self-check verdict are written by the first start and used by the next, give the same
tokens as a start without them, and a damaged, stale or foreign entry is detected,
deleted and rebuilt, never used."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.quantization import layout_cache
from kvflow.cpu import step as cpu_step

pytestmark = pytest.mark.skipif(cpu_step.find_compiler() is None,
                                reason="needs a C++ compiler")

KW = dict(load_format="gguf", max_model_len=128, num_gpu_blocks_override=32, block_size=4,
          device="cpu", skip_tokenizer_init=True)
PROMPTS = [[5, 9, 3, 17, 2], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "layouts"
    monkeypatch.setattr(layout_cache, "cache_root", lambda: root)
    return root


def _start(path, caplog):
    """(greedy tokens, the start's log text)."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        llm = LLM(path, **KW)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    return out, caplog.text


def test_layouts_and_verdict_are_reused_and_damage_is_rebuilt(tiny_gguf, cache, caplog):
    first, log = _start(tiny_gguf, caplog)
    # 8 linears, the Q4_0 lm_head and the embedding; their int8-activation layouts
    assert "weights: 0 packed layouts read from the cache, 10 written" in log
    assert "self-check passed: recorded" in log
    entries = sorted(cache.glob("*.safetensors"))
    records = sorted((cache.parent / "checks").glob("*.json"))
    assert entries and len(records) == 1

    second, log = _start(tiny_gguf, caplog)
    assert second == first
    assert "weights: 10 packed layouts read from the cache, 0 written" in log
    assert "recorded at an earlier start" in log and "self-check passed" not in log

    # Damage: flipped tensor bytes, a truncated file, another key's entry under this
    # name, a record whose figures fail the tolerance. Each is refused and rebuilt.
    flipped, cut, swapped = entries[0], entries[1], entries[2]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-7])
    swapped.write_bytes(entries[3].read_bytes())
    rec = json.loads(records[0].read_text())
    records[0].write_text(json.dumps({**rec, "error": 5.0}))
    third, log = _start(tiny_gguf, caplog)
    assert third == first
    assert log.count("is damaged or stale") >= 4, log
    assert "self-check passed: recorded" in log  # checked again, recorded again
    for path in (flipped, cut, swapped):  # rewritten whole
        assert layout_cache.get(path.stem, None) is not None


def test_a_changed_configuration_checks_again(tiny_gguf, cache, caplog):
    _start(tiny_gguf, caplog)
    with caplog.at_level(logging.INFO):
        caplog.clear()
        llm = LLM(tiny_gguf, **{**KW, "block_size": 8})
        llm.shutdown()
    assert "self-check passed: recorded" in caplog.text


def test_entry_round_trip_and_key(cache):
    t = {"a": torch.arange(10, dtype=torch.int32), "b": torch.randn(3, 4)}
    name = layout_cache.key("test", b"source", 7)
    assert name != layout_cache.key("test", b"source", 8)
    assert name != layout_cache.key("test", b"sourcf", 7)
    layout_cache.put(name, t, {"x": "1"})
    got, meta = layout_cache.get(name, ("a", "b"))
    assert meta["x"] == "1" and all(torch.equal(got[k], t[k]) for k in t)
    assert layout_cache.get(name, ("a",)) is None  # holds other tensors: refused, deleted
    assert not (cache / f"{name}.safetensors").exists()


def test_model_identity_follows_the_file(tiny_gguf, tmp_path):
    import os
    import shutil

    from kvflow.cpu import verdict as cpu_verdict

    copy = str(tmp_path / "copy.gguf")
    shutil.copy(tiny_gguf, copy)
    first = cpu_verdict.model_identity(copy, "gguf")
    assert first == cpu_verdict.model_identity(copy, "gguf")
    assert cpu_verdict.model_identity(copy, "dummy") is None  # no files: never recorded
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched
    assert cpu_verdict.model_identity(copy, "gguf") != first
    assert cpu_verdict.model_identity(tiny_gguf, "gguf") != first  # another path
