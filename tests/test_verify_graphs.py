"""Keys of the CUDA graphs for speculative verification steps (worker/cuda_graphs.py):
which (batch size, query length) graphs exist and which one a step replays. The
replay itself runs on CPU in tests/gpu_paths/test_gpu_plumbing.py (Triton interpreter)
and on the GPU in tests/test_spec_graphs_gpu.py."""

from __future__ import annotations

from kvflow.worker.cuda_graphs import pick_verify_graph, verify_batch_sizes, verify_query_lens


def test_query_lens_cover_every_draft_count():
    assert verify_query_lens(1) == [2]
    assert verify_query_lens(3) == [2, 3, 4]
    assert verify_query_lens(8) == list(range(2, 10))
    assert verify_query_lens(16) == [2, 3, 4, 5, 6, 7, 8, 9, 13, 17]
    assert verify_query_lens(11) == [2, 3, 4, 5, 6, 7, 8, 9, 12]
    for k in range(1, 17):  # every step of d <= k drafts has a graph
        lens = verify_query_lens(k)
        assert all(any(q >= d + 1 for q in lens) for d in range(1, k + 1))


def test_batch_sizes_stop_where_speculation_switches_off():
    assert verify_batch_sizes(256, 8) == [1, 2, 4, 8]
    assert verify_batch_sizes(256, 5) == [1, 2, 4, 8]  # 5 is covered by 8
    assert verify_batch_sizes(256, None) == [1, 2, 4, 8, 16, 24, 32]
    assert verify_batch_sizes(4, 8) == [1, 2, 4]  # never more than max_num_seqs
    assert verify_batch_sizes(256, 0) == [1]


def test_pick_smallest_graph_that_holds_the_step():
    sizes, lens = [1, 2, 4, 8], verify_query_lens(4)  # 2..5
    assert pick_verify_graph(1, 5, sizes, lens) == (1, 5)
    assert pick_verify_graph(3, 2, sizes, lens) == (4, 2)
    assert pick_verify_graph(8, 4, sizes, lens) == (8, 4)
    assert pick_verify_graph(9, 2, sizes, lens) is None  # more requests than any graph
    assert pick_verify_graph(2, 6, sizes, lens) is None  # a longer chunk: eager
    assert pick_verify_graph(2, 1, sizes, lens) is None  # decodes: the decode graphs
    assert pick_verify_graph(1, 2, [], []) is None  # no speculation: none captured
