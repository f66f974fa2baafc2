// Per-token int8 quantization of a few activation rows in one call: the W8A8 methods'
// ``quantize_int8_rows`` (kvflow/layers/quantization/int8_gemm.py), which is nine torch
// ops; at decode (1-16 rows of 576-1536 values) their dispatch costs far more than the
// arithmetic, once per linear layer and step.
//
// Bit for bit what the torch ops compute (finite inputs): amax = max |x| per row;
// inv = (1 / amax) * 127 (torch evaluates ``127 / t`` as ``t.reciprocal() * 127``), 1
// where amax is 0;
// q = clamp(round_half_even(x * inv), -127, 127); scale = 1 / inv. Built with
// -ffp-contract=off (build.py), so nothing fuses into a different rounding.
//
// Plain C ABI (ctypes, cpu/kernels/quant_rows.py), no torch headers.

#include <cmath>
#include <cstdint>

extern "C" {

// x [M, K] float32 with row stride ``ld`` -> q [M, K] int8 (contiguous), scale [M].
void kvflow_quantize_int8_rows(const float* x, int64_t m, int64_t k, int64_t ld, int8_t* q,
                               float* scale) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * ld;
    // Comparisons rather than fmax/fmin/nearbyint, whose NaN and errno rules keep the
    // loops scalar: max/min instructions and one rounding instruction per vector.
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) {
      const float a = std::fabs(xr[i]);
      amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? (1.0f / amax) * 127.0f : 1.0f;
    int8_t* qr = q + r * k;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      float v = __builtin_rintf(xr[i] * inv);  // half to even (the default mode)
      v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
      qr[i] = static_cast<int8_t>(static_cast<int32_t>(v));
    }
    scale[r] = 1.0f / inv;
  }
}

}  // extern "C"
