"""Triton kernels for the GPU path, one kernel per file.

Each module holds one fused operation and names the pure-torch reference it matches
(the references live beside the layers that use them, in ``kvflow.layers``):

- ``argmax``: the greedy sampler's row argmax, each row split over many programs.
- ``fused_moe``: routed tokens through their experts' gated MLPs (tokens sorted and padded
  per expert, two grouped GEMMs with SiLU-and-mul and the routing weight fused; int8
  experts too), reference ``fused_moe_ref`` beside it; launch rows per GPU in
  ``tuning/<gpu>.json`` (``fused_moe``).
- ``paged_attention``: flash-attention over the paged KV cache for mixed prefill/decode
  batches, with a split-KV (flash-decoding) path for long contexts at small batch; on
  decode-only steps it can also apply the rotary and write the new K/V itself.
- ``rms_norm``: RMSNorm and residual-add + RMSNorm over ``[..., hidden]``.
- ``rotary_kv``: rotary embedding of q and k fused with the KV-cache write.
- ``silu_and_mul``: ``silu(gate) * up`` on the merged gate/up projection.
- ``w4a16_gemm`` / ``w8a16_gemm``: weight-only int4 / int8 GEMMs (split-K for decode,
  tiled ``tl.dot`` for prefill; launch configurations in ``woq_config``), references
  beside them in the same files.

Every launch is free of host synchronisation (grid sizes come from tensor shapes and
Python ints the caller passes), so the kernels can be captured in CUDA graphs once they
have been compiled by a warm-up call. Tests run them under ``TRITON_INTERPRET=1`` on CPU.
"""
