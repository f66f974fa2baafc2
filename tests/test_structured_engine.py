"""Constrained decoding in the engine (LLM.generate on the embedded model): outputs checked
by jsonschema / re, never by the grammar engine itself."""

import json
import re
import time

import jsonschema
import pytest
import torch

from kvflow.errors import InvalidParameterError
from kvflow.layers.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams as SO

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "maxItems": 2, "items": {"type": "string", "enum": ["cat", "dog"]}}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "total": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "lines": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/line"}}},
    "required": ["id", "total", "lines"], "additionalProperties": False,
    "$defs": {"line": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                         "qty": {"type": "integer"}},
                       "required": ["sku", "qty"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llm():
    from kvflow import LLM

    # Few KV blocks, so a batch of constrained requests is preempted (swapped) mid-way;
    # overlapped steps, so a constrained row's previous token is still in flight.
    llm = LLM("smollm2-135m", device="cpu", max_model_len=256, num_gpu_blocks_override=20,
              preemption_mode="swap", swap_space="128MiB", async_scheduling=True)
    yield llm
    llm.shutdown()


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, W] int32 -> [M, vocab_size] bool (True: allowed), to read a filled mask."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


def test_bitmask_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    allowed = [[0, 31, 32, 63, 69], [5]]
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            word = int(bitmask[r, t // 32]) | (1 << (t % 32))
            bitmask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    got = apply_token_bitmask(logits.clone(), torch.tensor([1, 3]), bitmask)
    torch.testing.assert_close(got, apply_token_bitmask_ref(logits, [1, 3], allowed))


def test_mixed_batch_with_preemption_and_overlap(llm):
    p = llm.get_tokenizer()
    reqs = [
        (chat(llm, "Describe a person as JSON."), SamplingParams(
            temperature=0, max_tokens=60, structured_outputs=SO(json=PERSON))),
        (chat(llm, "Describe an order as JSON."), SamplingParams(
            temperature=0.8, seed=7, max_tokens=40, structured_outputs=SO(json=ORDER))),
        (chat(llm, "Is it sunny?"), SamplingParams(
            temperature=0.8, seed=3, max_tokens=8, structured_outputs=SO(choice=["yes", "no",
                                                                                 "maybe"]))),
        (chat(llm, "Give a code."), SamplingParams(
            temperature=0.8, seed=5, max_tokens=12, structured_outputs=SO(regex=r"[a-f]{3}-\d{2}"))),
        (chat(llm, "Count."), SamplingParams(
            temperature=0, max_tokens=20,
            structured_outputs=SO(grammar='root ::= "one" (", " num)*\nnum ::= [0-9]'))),
        (chat(llm, "Any JSON object."), SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=SO(json_object=True))),
        (chat(llm, "Tell me about cats."), SamplingParams(temperature=0, max_tokens=24)),
        (chat(llm, "Two people as JSON."), SamplingParams(
            n=2, temperature=1.0, seed=11, max_tokens=36, structured_outputs=SO(json=PERSON))),
    ]
    before = llm.engine.core.scheduler.num_preemptions
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > before  # the KV cache ran out
    texts = [[c.text for c in o.outputs] for o in outs]
    finish = [[c.finish_reason for c in o.outputs] for o in outs]
    assert finish[0] == ["stop"], texts[0]
    jsonschema.validate(json.loads(texts[0][0]), PERSON)
    if finish[1] == ["stop"]:
        jsonschema.validate(json.loads(texts[1][0]), ORDER)
    assert texts[2][0] in ("yes", "no", "maybe")
    assert re.fullmatch(r"[a-f]{3}-\d{2}", texts[3][0]), texts[3]
    assert re.fullmatch(r"one(, [0-9])*", texts[4][0]), texts[4]
    if finish[5] == ["stop"]:
        assert isinstance(json.loads(texts[5][0]), dict)
    assert len(texts[7]) == 2
    for text, why in zip(texts[7], finish[7]):
        if why == "stop":
            jsonschema.validate(json.loads(text), PERSON)
    # A free request in the batch is untouched by its constrained neighbours.
    alone = llm.generate([reqs[6][0]], [reqs[6][1]], use_tqdm=False)
    assert alone[0].outputs[0].text == texts[6][0]
    # Seeded constrained sampling gives the same output alone as in the batch.
    again = llm.generate([reqs[3][0]], [reqs[3][1]], use_tqdm=False)
    assert again[0].outputs[0].text == texts[3][0]
    stats = llm.engine.core.executor.runner.structured.stats()
    assert stats.num_masked_rows > 0 and stats.compile.num_cache_hits >= 1


def test_max_tokens_inside_a_value_finishes_with_length(llm):
    out = llm.generate([chat(llm, "A person.")], SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=SO(json=PERSON)), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(c.text)


@pytest.mark.parametrize("so, param", [
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "structured_outputs.json"),
    (SO(json={"type": "strnig"}), "structured_outputs.json"),
    (SO(regex="a(b"), "structured_outputs.regex"),
    (SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (SO(json={"enum": list(range(100_000))}), "structured_outputs.json"),
    (SO(json=json.dumps(nested(200))), "structured_outputs.json"),
])
def test_bad_constraints_are_refused_fast(llm, so, param):
    start = time.perf_counter()
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=so),
                     use_tqdm=False)
    assert e.value.param == param
    assert time.perf_counter() - start < 1.0
    assert not llm.engine.core.has_unfinished_requests()


def test_ngram_speculation_keeps_the_grammar(llm):
    """Constrained requests with ngram drafts: drafts are verified against the grammar at
    every position and the outputs validate. (Greedy text may differ from the plain
    engine's at near-ties: a k + 1-row verification forward is not bit-identical.)"""
    from kvflow import LLM

    prompts = [chat(llm, "Describe a person as JSON."), chat(llm, "List two people.")]
    schema2 = {"type": "array", "maxItems": 3, "items": PERSON}
    params = [SamplingParams(temperature=t, seed=1, max_tokens=70,
                             structured_outputs=SO(json=s))
              for s, t in ((PERSON, 0.0), (schema2, 0.8))]
    spec = LLM("smollm2-135m", device="cpu", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1})
    try:
        got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
        stats = spec.engine.core.scheduler.spec_stats
        so_stats = spec.engine.core.executor.runner.structured.stats()
    finally:
        spec.shutdown()
    assert stats.num_draft_tokens > 0 and so_stats.num_masked_rows > stats.num_drafts
    assert got[0].finish_reason == "stop"
    for c, s in zip(got, (PERSON, schema2)):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), s)


def test_medusa_tree_speculation_keeps_the_grammar(llm, tmp_path):
    """Constrained requests (JSON schema, choice) verified as Medusa candidate trees: greedy
    output equals the constrained engine's without speculation, token for token, and
    validates. First random heads (their top-k guesses are mostly forbidden: counted as
    grammar rejections, never accepted); then an oracle that puts the right continuation
    on a random branch and random tokens elsewhere, so whole paths are accepted and each
    bonus token comes from a deep node's row, which must carry its path's grammar state.
    A sampled request (exact tree acceptance draws at every row) validates too."""
    from kvflow import LLM
    from kvflow.bench.spec_oracle import install_oracle
    from kvflow.spec_decode.heads_config import MedusaHeadsConfig
    from kvflow.spec_decode.medusa import MedusaHeads
    from kvflow.spec_decode.tree import DraftTree

    heads = MedusaHeads(MedusaHeadsConfig(num_heads=3, num_layers=1, hidden_size=576,
                                          vocab_size=49152, shared_lm_head=True), 576, 49152)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    heads.save(str(tmp_path))
    choices = ["yes", "no", "maybe not"]
    prompts = [chat(llm, "Describe a person as JSON."),
               chat(llm, "Is the sky blue? Answer yes or no.")]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=10,
                             structured_outputs=SO(choice=choices))]
    want = llm.generate(prompts, params, use_tqdm=False)
    choice_tree = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]
    spec = LLM("smollm2-135m", device="cpu", max_model_len=256, speculative_config={
        "method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 3,
        "medusa_tree": choice_tree, "disable_by_batch_size": None})
    try:
        runner = spec.engine.core.executor.runner
        assert runner.spec.tree is not None and runner.spec.tree.num_nodes == 6
        got = spec.generate(prompts, params, use_tqdm=False)
        stats = spec.engine.core.scheduler.spec_stats
        rejected = runner.structured.stats().num_draft_rejections
        assert stats.num_draft_tokens > 0 and rejected > 0
        for a, b in zip(want, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        refs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in want]
        install_oracle(spec, refs, 3, DraftTree.from_choices(choice_tree), place="random")
        accepted = stats.num_accepted_tokens
        got = spec.generate(prompts, params, use_tqdm=False)
        assert stats.num_accepted_tokens - accepted > len(want[0].outputs[0].token_ids) // 2
        assert runner.structured.stats().num_draft_rejections > rejected
        for a, b in zip(want, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        sampled = spec.generate(prompts[:1], SamplingParams(
            temperature=0.8, seed=3, max_tokens=60, structured_outputs=SO(json=PERSON)),
            use_tqdm=False)[0].outputs[0]
    finally:
        spec.shutdown()
    c = got[0].outputs[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), PERSON)
    assert got[1].outputs[0].text in choices
    if sampled.finish_reason == "stop":
        jsonschema.validate(json.loads(sampled.text), PERSON)


def test_draft_walk_masks_every_position_and_rolls_back():
    """The verifier's mask rows: position i allows what the grammar allows after drafts[:i];
    the walk stops at a forbidden draft; the matcher ends where it began."""
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.models.registry import embedded_model_path
    from kvflow.structured_output.manager import StructuredOutputManager, _Req, _RowPlan

    path = embedded_model_path("smollm2-135m")
    tok = Tokenizer.from_path(path)
    mgr = StructuredOutputManager(path, 49152, [2])
    ids = tok.encode("yes please", add_special_tokens=False)
    bad = tok.encode("no", add_special_tokens=False)[0]
    req = _Req(mgr.compiler.submit(SO(choice=["yes please"])), [2])

    def fill(drafts, count):
        m = mgr._fill([_RowPlan(req, "r", [], 0, count, drafts)])
        return unpack_bitmask(m.bitmask, 49152)

    first = fill([], 1)
    rows = fill([ids[0], bad, ids[1]], 4)
    assert rows[0].tolist() == first[0].tolist() and rows[0, ids[0]] and not rows[0, bad]
    assert rows[1, ids[1]] and not rows[1, bad]  # after the accepted first draft
    assert mgr.stats().num_draft_rejections == 1
    assert req.num_fed == 0 and fill([], 1)[0].tolist() == first[0].tolist()  # rolled back
    done = fill(ids, len(ids) + 1)[len(ids)]  # after the whole choice: only EOS
    assert done.nonzero().flatten().tolist() == [2]
    mgr.shutdown()


def test_tree_fill_masks_each_node_with_its_path_and_rolls_back():
    """Medusa candidate trees: row 0 allows what the grammar allows now, row 1 + n what it
    allows after the path from the root to node n (a fresh matcher walked along that path
    is the reference); a node the grammar forbids at its parent's state is counted, and
    its row and its subtree's rows allow everything (they are never on an accepted path:
    the parent's row already gives the node probability 0); the matcher ends where it
    began. The plan hands the fill the first nd nodes' parents of the step's tree."""
    from types import SimpleNamespace

    import numpy as np
    import xgrammar as xgr

    from kvflow.models.registry import embedded_model_path
    from kvflow.spec_decode.tree import DraftTree
    from kvflow.structured_output.manager import StructuredOutputManager, _Req, _RowPlan

    path = embedded_model_path("smollm2-135m")
    mgr = StructuredOutputManager(path, 49152, [2])
    yes, please, sir, no, maybe, eos = 10407, 5361, 38061, 4607, 5196, 2  # smollm2 ids
    so = SO(choice=["yes please", "yes sir"])
    req = _Req(mgr.compiler.submit(so), [2])
    # (token, parent) in node order: allowed and forbidden branches, a twin of an allowed
    # node, a subtree under a forbidden node, a node after the grammar's end.
    nodes = [(yes, -1), (no, -1), (yes, -1), (please, 0), (maybe, 0), (yes, 1), (sir, 2),
             (eos, 3), (please, 5), (no, 7)]
    drafts, parents = [t for t, _ in nodes], [p for _, p in nodes]

    def reference(path_tokens):
        ref = xgr.GrammarMatcher(req.grammar.result(), override_stop_tokens=[2])
        want = xgr.allocate_token_bitmask(1, 49152)
        for t in path_tokens:
            if ref.is_terminated() or not ref.accept_token(t):
                return None  # forbidden on the way
        if ref.is_terminated():
            want.zero_()
            want[0, 0] = 1 << 2
        else:
            ref.fill_next_token_bitmask(want, 0)
        return unpack_bitmask(want, 49152)[0]

    def node_path(n):
        out = []
        while n >= 0:
            out.append(drafts[n])
            n = parents[n]
        return out[::-1]

    root = unpack_rows(mgr._fill([_RowPlan(req, "r", [], 0, 1, [])]))[0]
    m = mgr._fill([_RowPlan(req, "r", [], 3, len(nodes) + 1, drafts, parents)])
    assert m.rows.tolist() == list(range(3, 3 + len(nodes) + 1))
    rows = unpack_rows(m)
    assert torch.equal(rows[0], root) and torch.equal(reference([]), root)
    reached = []
    for n in range(len(nodes)):
        want = reference(node_path(n))
        if want is None:
            assert bool(rows[1 + n].all()), n  # never read on an accepted path
        else:
            assert torch.equal(rows[1 + n], want), n
            reached.append(n)
    assert reached == [0, 2, 3, 6, 7]
    assert rows[1 + 3, eos] and not rows[1 + 3, please]  # after "yes please": end only
    assert rows[1 + 7].nonzero().flatten().tolist() == [eos]  # a terminated path: EOS
    assert mgr.stats().num_draft_rejections == 3  # "no", " maybe", a token after EOS
    assert req.num_fed == 0 and torch.equal(
        unpack_rows(mgr._fill([_RowPlan(req, "r", [], 0, 1, [])]))[0], root)
    mt = req.matcher  # rolled back to the start: it takes a whole choice again
    assert all(mt.accept_token(t) for t in (yes, sir)) and mt.accept_token(eos)
    mt.rollback(3)

    # The plan: a request cut to 3 of the tree's nodes gets those nodes' parents.
    tree = DraftTree.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    mgr.reqs["r"] = req
    batch = SimpleNamespace(output_token_ids=lambda row: np.array([], dtype=np.int64))
    inputs = SimpleNamespace(req_ids=["r"], rows=np.array([0]), sample=SimpleNamespace(
        req_indices=np.array([0]), offsets=np.array([0, 4]), num_draft=[3],
        draft_token_ids=[yes, no, please]))
    (plan,) = mgr.plan(inputs, batch, tree)
    assert plan.parents == [-1, -1, 0] and plan.drafts == [yes, no, please]
    assert plan.count == 4 and mgr.plan(inputs, batch)[0].parents is None  # a chain
    rows = unpack_rows(mgr._fill([plan]))
    assert torch.equal(rows[3], reference([yes, please]))  # node 2 follows node 0
    mgr.shutdown()


def test_start_after_leaves_the_reasoning_free():
    """start_after: no mask rows until the tag's tokens appear; then the matcher starts
    right after them (the reasoning is never fed to it)."""
    from types import SimpleNamespace

    import numpy as np

    from kvflow.core.sched_output import NewRequestData, SchedulerOutput
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.models.registry import embedded_model_path
    from kvflow.structured_output.manager import StructuredOutputManager

    path = embedded_model_path("smollm2-135m")
    tok = Tokenizer.from_path(path)
    mgr = StructuredOutputManager(path, 49152, [2])
    so = SO(choice=["yes"], start_after="</answer>")
    mgr.update(SchedulerOutput(new_reqs=[NewRequestData(
        "r", [1, 2, 3], 3, SamplingParams(structured_outputs=so), [], 0, [2])],
        cached_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0))
    outputs = {"now": np.array(tok.encode("I think", add_special_tokens=False))}
    batch = SimpleNamespace(output_token_ids=lambda row: outputs["now"])
    inputs = SimpleNamespace(req_ids=["r"], rows=np.array([0]), sample=SimpleNamespace(
        req_indices=np.array([0]), offsets=np.array([0, 1]), num_draft=None))
    assert mgr.plan(inputs, batch) is None  # still thinking: sampled freely
    tag = tok.encode("</answer>", add_special_tokens=False)
    outputs["now"] = np.concatenate([outputs["now"], tag])
    plans = mgr.plan(inputs, batch)
    assert plans is not None and plans[0].new_tokens == []
    allowed = unpack_rows(mgr._fill(plans))
    assert allowed[0, tok.encode("yes", add_special_tokens=False)[0]]
    assert int(allowed[0].sum()) < 10  # the choice's first tokens only
    mgr.shutdown()


def unpack_rows(mask):

    return unpack_bitmask(mask.bitmask, 49152)


def test_batched_fill_equals_one_matcher_per_row():
    """A step's single-row requests are filled together by xgrammar's threads: each row
    equals its own matcher's fill, whatever the other rows' grammars and states (a
    finished grammar allows only EOS; a row with drafts keeps the walk)."""
    import xgrammar as xgr

    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.models.registry import embedded_model_path
    from kvflow.structured_output.manager import StructuredOutputManager, _Req, _RowPlan

    path = embedded_model_path("smollm2-135m")
    tok = Tokenizer.from_path(path)
    mgr = StructuredOutputManager(path, 49152, [2], fill_threads=2)
    cases = [(SO(json=PERSON), '{"name": "A'), (SO(choice=["yes", "no"]), ""),
             (SO(regex=r"[0-9]{3}-[a-z]+"), "12"), (SO(choice=["ok"]), "ok"),
             (SO(json=PERSON), ""), (SO(regex=r"(ab)+c"), "abab")]
    reqs, plans, refs, row = [], [], [], 0
    for so, text in cases:
        req = _Req(mgr.compiler.submit(so), [2])
        ids = tok.encode(text, add_special_tokens=False) if text else []
        drafts = ids[:1] if so.regex == r"(ab)+c" else []
        plans.append(_RowPlan(req, f"r{len(plans)}", ids, row, 1 + len(drafts), drafts))
        row += 1 + len(drafts)
        ref = xgr.GrammarMatcher(req.grammar.result(), override_stop_tokens=[2])
        for t in ids:
            assert ref.accept_token(t)
        want = xgr.allocate_token_bitmask(1 + len(drafts), 49152)
        if ref.is_terminated():
            want.zero_()
            want[0, 0] = 1 << 2
        else:
            ref.fill_next_token_bitmask(want, 0)
        refs.append(want[0])
    m = mgr._fill(plans)
    first_rows = [p.first_row for p in plans]
    assert m.rows.tolist() == list(range(row))
    for r, want in zip(first_rows, refs):
        assert torch.equal(m.bitmask[r], want)
    assert m.bitmask[first_rows[3]].nonzero().flatten().tolist() == [0]  # "ok": EOS only
    mgr.shutdown()


@pytest.mark.parametrize("isolate", [False, True])
def test_grammar_that_fails_to_compile_on_a_pipeline_rank_ends_its_request(isolate):
    """A grammar whose compile fails (or times out) raises in the step on the engine's own
    rank (fault isolation then fails that request alone); on a pipeline's sampling rank,
    whose exception would end every rank, the request's rows allow only the end of
    sequence instead, beside a healthy constrained request filled as usual."""
    from concurrent.futures import Future

    from kvflow.models.registry import embedded_model_path
    from kvflow.structured_output.manager import StructuredOutputManager, _Req, _RowPlan

    mgr = StructuredOutputManager(embedded_model_path("smollm2-135m"), 49152, [2],
                                  inline_fill=True, isolate_failures=isolate)
    bad: Future = Future()
    bad.set_exception(TimeoutError())
    good = _Req(mgr.compiler.submit(SO(choice=["yes", "no"])), [2])
    plans = [_RowPlan(_Req(bad, [2]), "bad", [], 0, 1, []),
             _RowPlan(good, "good", [], 1, 1, [])]
    if not isolate:
        with pytest.raises(TimeoutError):
            mgr._fill(plans)
        return
    mask = mgr._fill(plans)
    allowed = unpack_bitmask(mask.bitmask, 49152)
    assert mask.rows.tolist() == [0, 1]
    assert allowed[0].nonzero().flatten().tolist() == [2]
    assert allowed[1, 10407] and allowed[1, 4607] and allowed[1].sum() < 100  # yes / no
    assert plans[0].req.failed and mgr._fill(plans[:1]).bitmask.equal(mask.bitmask[:1])
