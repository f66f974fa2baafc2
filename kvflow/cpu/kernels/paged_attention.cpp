// Paged decode attention on CPU, reading float32 / int8 / fp8 E4M3 KV blocks in place:
// the plain C entry the torch backend calls through ctypes (paged_attention.py). The
// kernel itself is in paged_attention.h (shared with the C++ decode step).
//
// Plain C ABI with raw pointers: no torch headers, so the library builds in about a
// second.

#include "paged_attention.h"

extern "C" {

// kind: 0 float32, 1 int8 (scales [2, NB, BS, KVH] float32), 2 fp8 E4M3 (bytes).
// out, q [B, H, D] float32 contiguous, D a multiple of 8; cache [2, NB, BS, KVH, D]
// contiguous; tables [B, W] int32 (row stride W); lens [B] int32.
// Returns 0, 1 for a bad kind, 2 for a head dim that is not a multiple of 8.
int kvflow_paged_decode(int kind, float* out, const float* q, const void* cache,
                        const float* scales, const int32_t* tables, const int32_t* lens,
                        int64_t b, int64_t h, int64_t kvh, int64_t d, int64_t nb,
                        int64_t bs, int64_t w, float sm_scale, float k_scale,
                        float v_scale, int threads) {
  using kvflow::paged::dispatch;
  if (d % 8 != 0) return 2;
  switch (kind) {
    case 0:
      dispatch(d, out, q, h * d, static_cast<const float*>(cache), nullptr, tables,
               nullptr, lens, b, h, kvh, nb, bs, w, sm_scale, 1.0f, 1.0f, threads);
      return 0;
    case 1:
      dispatch(d, out, q, h * d, static_cast<const int8_t*>(cache), scales, tables,
               nullptr, lens, b, h, kvh, nb, bs, w, sm_scale, 1.0f, 1.0f, threads);
      return 0;
    case 2:
      dispatch(d, out, q, h * d, static_cast<const uint8_t*>(cache), nullptr, tables,
               nullptr, lens, b, h, kvh, nb, bs, w, sm_scale, k_scale, v_scale, threads);
      return 0;
    default:
      return 1;
  }
}

}  // extern "C"
