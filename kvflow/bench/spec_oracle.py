"""BENCH AND TEST ONLY: a proposer that knows the answer.

``OracleProposer`` proposes the target's own greedy continuation, read from the outputs
of an earlier plain greedy run (``references``: each request's prompt + output tokens).
Every draft it proposes is accepted, so a step's cost at k drafts and the best speedup
speculation could give at that k can be measured, with any weights (random ones
included: there acceptance of real proposers means nothing). It is not a speculation
method: nothing outside benchmarks and tests installs it (``install_oracle`` replaces the
proposer of a running engine's SpecDecoder), and ``--speculative-config`` cannot name it.

With a candidate tree the oracle fills one root-to-leaf path with the right tokens and
every other node with wrong ones, so tree steps are costed at full size and the accepted
path's K/V has to be moved into place (``place="random"`` picks the path at random each
step: tests use it to exercise the K/V move from any branch).

"Right" only holds while the verification forward reproduces the plain run bit for bit.
With random weights it does not: a k + 1-row forward (other GEMM tilings, the prefill
attention launch) differs from the 1-row decode in the last bf16 bits, near-ties in the
near-uniform logits flip, and the target rejects the first draft of almost every step.
So for cost measurements ``install_oracle(..., accept_all=True)`` also sets the BENCH-ONLY
verdict override (``SpecDecoder.accept_all``): the whole verification runs as usual, but
every draft is kept, so a chain step of k drafts emits k + 1 tokens and a tree step keeps
a full-depth path. The output is then not the target's (it is a cost measurement, and
the result JSON says so); tests that check output equality leave it off.
"""

from __future__ import annotations

import random

import numpy as np

from kvflow.spec_decode.proposer import Proposer
from kvflow.spec_decode.tree import DraftTree


class OracleProposer(Proposer):
    def __init__(self, references: list[list[int]], num_speculative_tokens: int,
                 tree: DraftTree | None = None, place: str = "first", vocab_size: int = 0,
                 seed: int = 0) -> None:
        self.refs = [list(r) for r in references]
        self.num_speculative_tokens = num_speculative_tokens
        self.tree = tree
        self.place = place
        self.vocab = vocab_size
        self.rng = random.Random(seed)

    def _continuation(self, tokens: np.ndarray, n: int) -> list[int]:
        """The next up to ``n`` reference tokens after ``tokens`` (none off reference)."""
        t = tokens.tolist()
        for ref in self.refs:
            if len(ref) > len(t) and ref[: len(t)] == t:
                return ref[len(t): len(t) + n]
        return []

    def _wrong(self, avoid: int) -> int:
        tok = self.rng.randrange(max(self.vocab, 2))
        return tok if tok != avoid else (tok + 1) % max(self.vocab, 2)

    def propose(self, token_ids, max_drafts, req_ids=None, params=None, **kw):
        out = []
        for tokens, m in zip(token_ids, max_drafts):
            if not m:
                out.append([])
                continue
            if self.tree is None:
                # Off the reference (the target's greedy path differs from the plain
                # run's, e.g. bf16 near-ties of random weights between the decode and
                # the verification kernels) the drafts are wrong ones: every step still
                # verifies k drafts, so its cost is measured either way.
                k = self.num_speculative_tokens
                right = self._continuation(tokens, k)
                out.append(right + [self._wrong(-1) for _ in range(k - len(right))]
                           if k else [])
                continue
            t = self.tree
            right = self._continuation(tokens, t.max_depth)
            deepest = [n for n in range(t.num_nodes) if t.depth[n] == t.max_depth]
            leaf = deepest[0] if self.place == "first" else self.rng.choice(deepest)
            path = set(t.ancestors[leaf])
            nodes = []
            for n in range(t.num_nodes):
                d = int(t.depth[n]) - 1
                want = right[d] if d < len(right) else -1
                nodes.append(want if n in path and want >= 0 else self._wrong(want))
            out.append(nodes)
        return out


def install_oracle(llm, references: list[list[int]], k: int, tree: DraftTree | None = None,
                   place: str = "first", seed: int = 0,
                   accept_all: bool = False) -> OracleProposer:
    """Replace the proposer of ``llm``'s (in-process) engine: drafts from ``references``,
    verified as a chain of k drafts or as ``tree``'s nodes. ``accept_all``: keep every
    draft whatever the target says (bench cost measurement, see the module docstring)."""
    runner = llm.engine.core.executor.runner
    spec = runner.spec
    if spec is None:
        raise RuntimeError("install_oracle needs an engine started with a "
                           "speculative_config (any method)")
    oracle = OracleProposer(references, k, tree, place,
                            runner.model.config.vocab_size, seed)
    spec.proposer = oracle
    spec.wants_hidden = False
    spec.accept_all = accept_all
    spec.set_tree(tree)
    return oracle
