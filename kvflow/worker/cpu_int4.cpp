// The 4-bit GEMV of the C++ CPU decode step (cpu_step.cpp): y [M, N] = x [M, K] W^T for
// M <= 4 rows, float32 activations and float32 sums, straight from the packed weights.
//
// Why: the packed aten op (_weight_int4pack_mm_for_cpu) is fast only on bfloat16
// activations, and reaching it from the C++ step means a call back into Python per
// linear (a few microseconds each, 120 per step of SmolLM2) plus casts. Here the step
// reads the weights itself.
//
// Layout (built once at load from Int4Groups, packed.py ``gemv_layout``):
//   q  int32 [N, K2 / 8]: per block of 64 inputs, 8 words; word i holds input j * 8 + i
//      of the block in bits 4j..4j+3 (j = 0..7). Masking word & (15 << 4j) then gives
//      v * 16^j in 8 lanes at once, no byte shuffles (the bottleneck of unpacking bytes);
//      the 16^-j goes into a scaled copy of the input, exactly (a power of two);
//   sb float32 [N, K2 / group, 2]: (scale, bias) per group, w = v * scale + bias
//      (bias = zero - 8 scale of the Int4Groups convention w = (v - 8) scale + zero);
//   doubled (8-bit weights as two nibble halves): the input is read twice, K2 = 2K.
// Per half block (32 inputs, within one group) the kernel sums v * x in float32 and adds
// scale * that; bias * sum(x) per group, with sum(x) per group computed once per call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFLOW_INT4_AVX2 1
#endif

namespace kvflow {

namespace {

#ifdef KVFLOW_INT4_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows [n0, n1) for M input rows, R output rows at a time (enough independent
// FMA chains to hide their latency); xs [M, K2]: the input scaled per lane block.
template <int M, int R>
void rows_avx2(const float* xs, int64_t k2, const int32_t* q, const float* sb,
               int64_t group, int64_t j0, int64_t j1, float* tot_out) {
  const int64_t blocks = k2 / 64, groups = k2 / group;
  for (int64_t j = j0; j < j1; j += R) {
    __m256 tot[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) tot[r][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t ga = (b * 64) / group, gb = (b * 64 + 32) / group;
      __m256i word[R];
      for (int r = 0; r < R; ++r)
        word[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (j + r) * (k2 / 8) + b * 8));
      __m256 acc_a[R][M], acc_b[R][M];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc_a[r][m] = acc_b[r][m] = _mm256_setzero_ps();
#define KVFLOW_LANE(J, ACC, WORD_EXPR)                                                   \
      for (int r = 0; r < R; ++r) {                                                      \
        const __m256 w = _mm256_cvtepi32_ps(WORD_EXPR);                                  \
        for (int m = 0; m < M; ++m)                                                      \
          ACC[r][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs + m * k2 + b * 64 + J * 8),   \
                                      ACC[r][m]);                                        \
      }
      KVFLOW_LANE(0, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF)))
      KVFLOW_LANE(1, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF0)))
      KVFLOW_LANE(2, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF00)))
      KVFLOW_LANE(3, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF000)))
      KVFLOW_LANE(4, acc_b, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF0000)))
      KVFLOW_LANE(5, acc_b, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF00000)))
      KVFLOW_LANE(6, acc_b, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF000000)))
      // The top nibble as a signed int32 would be negative: shift it down by 4 first.
      KVFLOW_LANE(7, acc_b, _mm256_and_si256(_mm256_srli_epi32(word[r], 4),
                                             _mm256_set1_epi32(0xF000000)))
#undef KVFLOW_LANE
      for (int r = 0; r < R; ++r) {
        const float* sr = sb + (j + r) * groups * 2;
        const __m256 sa = _mm256_set1_ps(sr[2 * ga]), sbv = _mm256_set1_ps(sr[2 * gb]);
        for (int m = 0; m < M; ++m) {
          tot[r][m] = _mm256_fmadd_ps(acc_a[r][m], sa, tot[r][m]);
          tot[r][m] = _mm256_fmadd_ps(acc_b[r][m], sbv, tot[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) tot_out[m * (j1 - j0) + (j - j0) + r] = hsum(tot[r][m]);
  }
}
#endif

// The same sums in plain C++ (CPUs without AVX2/FMA), on the unscaled input.
[[maybe_unused]] void rows_scalar(int64_t mrows, const float* xe, int64_t k2,
                                  const int32_t* q, const float* sb, int64_t group,
                                  int64_t j0, int64_t j1, float* tot_out) {
  const int64_t groups = k2 / group;
  for (int64_t j = j0; j < j1; ++j) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + j * (k2 / 8));
    const float* sr = sb + j * groups * 2;
    for (int64_t m = 0; m < mrows; ++m) {
      const float* xr = xe + m * k2;
      float tot = 0.f;
      for (int64_t h = 0; h < k2 / 32; ++h) {  // half blocks: one group each
        float acc = 0.f;
        for (int jj = 4 * (h % 2); jj < 4 * (h % 2) + 4; ++jj)
          for (int i = 0; i < 8; ++i)
            acc += static_cast<float>((qr[(h / 2) * 8 + i] >> (4 * jj)) & 15u) *
                   xr[(h / 2) * 64 + jj * 8 + i];
        tot += acc * sr[2 * ((h * 32) / group)];
      }
      tot_out[m * (j1 - j0) + (j - j0)] = tot;
    }
  }
}

}  // namespace

// x [M, K] float32 (M <= 4), q [N, K2 / 8] int32, sb [N, K2 / group, 2] float32 -> y
// [M, N] float32 (written into `y`, which must be contiguous and of that shape).
void int4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sb, int64_t group,
               bool doubled, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0), k2 = doubled ? 2 * k : k;
  TORCH_CHECK(m >= 1 && m <= 4, "int4_gemv: 1 to 4 rows, got ", m);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "int4_gemv: x float32");
  TORCH_CHECK(q.scalar_type() == at::kInt && q.is_contiguous() && q.size(1) * 8 == k2 &&
                  k2 % 64 == 0, "int4_gemv: packed values [N, K2 / 8] int32, K2 % 64 == 0");
  TORCH_CHECK(group % 32 == 0 && k2 % group == 0, "int4_gemv: group ", group);
  TORCH_CHECK(sb.scalar_type() == at::kFloat && sb.is_contiguous() && sb.size(0) == n &&
                  sb.size(1) == k2 / group, "int4_gemv: scales [N, K2 / group, 2]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == m &&
                  y.size(1) == n, "int4_gemv: output [M, N] float32");
  const int64_t groups = k2 / group;
  const float* xp = x.data_ptr<float>();
  // xe: the input over K2 (read twice when doubled); xs: xe scaled by 16^-j in lane
  // block j of each 64 (2^-24 for j = 7, whose nibble is shifted down first).
  std::vector<float> xe(m * k2), xs(m * k2), xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k2; ++c) {
      const float v = xp[r * k + c % k];
      const int jj = static_cast<int>((c % 64) / 8);
      xe[r * k2 + c] = v;
      xs[r * k2 + c] = v * (jj == 7 ? 0x1p-24f : std::ldexp(1.f, -4 * jj));
    }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) s += xe[r * k2 + c];
      xsum[r * groups + g] = s;
    }
  const int32_t* qp = q.data_ptr<int32_t>();
  const float* sp = sb.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Tasks of whole 4-row tiles, enough of them per task (~64K weights) to pay for the
  // hand-off to another thread.
  const int64_t tiles = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(1, k2));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t j0 = t0 * 4, j1 = std::min(n, t1 * 4), cnt = j1 - j0;
    std::vector<float> tot(m * cnt);
#ifdef KVFLOW_INT4_AVX2
    const int64_t full = j0 + cnt / 4 * 4;  // whole 4-row tiles; the tail one row at a time
    auto run = [&](auto mc) {
      constexpr int M = decltype(mc)::value;
      constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
      // tot is [M, cnt]; rows_avx2 writes [M, j1' - j0'] for its own range: call it per
      // tile range with a pointer offset trick: one call over [j0, full), one per tail row.
      std::vector<float> part(M * cnt);
      if (full > j0) rows_avx2<M, R>(xs.data(), k2, qp, sp, group, j0, full, part.data());
      for (int64_t mm = 0; mm < M; ++mm)
        for (int64_t c = 0; c < full - j0; ++c) tot[mm * cnt + c] = part[mm * (full - j0) + c];
      for (int64_t jt = full; jt < j1; ++jt) {
        float one[M];
        rows_avx2<M, 1>(xs.data(), k2, qp, sp, group, jt, jt + 1, one);
        for (int64_t mm = 0; mm < M; ++mm) tot[mm * cnt + (jt - j0)] = one[mm];
      }
    };
    switch (m) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      default: run(std::integral_constant<int, 4>()); break;
    }
#else
    rows_scalar(m, xe.data(), k2, qp, sp, group, j0, j1, tot.data());
#endif
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = j0; j < j1; ++j) {
        const float* sr = sp + j * groups * 2;
        float bsum = 0.f;
        for (int64_t g = 0; g < groups; ++g) bsum += sr[2 * g + 1] * xsum[r * groups + g];
        yp[r * n + j] = tot[r * cnt + (j - j0)] + bsum;
      }
  });
}

// Whether this build has the AVX2/FMA kernel (else the plain loops).
bool int4_gemv_simd() {
#ifdef KVFLOW_INT4_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace kvflow
