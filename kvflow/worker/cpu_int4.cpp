// The 4-bit GEMV of the C++ CPU decode step (cpu_step.cpp): y [M, N] = x [M, K] W^T for
// M <= 4 rows, float32 activations and float32 sums, straight from the packed weights.
//
// Why: the packed aten op (_weight_int4pack_mm_for_cpu) is fast only on bfloat16
// activations, and reaching it from the C++ step means a call back into Python per
// linear (a few microseconds each, 120 per step of SmolLM2) plus casts. Here the step
// reads the weights itself.
//
// Layout (built once at load from Int4Groups, packed.py ``Int4Rows``):
//   q  uint8 [N, K2 / 2]: per chunk of 32 inputs, byte j holds value j (low nibble) and
//      value j + 16 (high nibble), so both halves unpack to contiguous inputs;
//   sb float32 [N, K2 / group, 2]: (scale, bias) per group, w = v * scale + bias
//      (bias = zero - 8 scale of the Int4Groups convention w = (v - 8) scale + zero);
//   doubled (8-bit weights as two nibble halves): the input is read twice, K2 = 2K.
// Per group the kernel sums v * x in float32 and adds scale * that + bias * sum(x), with
// sum(x) per group computed once per call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

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

// Output rows [n0, n1) for M input rows; xe [M, K2] (the doubled input already expanded).
template <int M>
void rows_avx2(const float* xe, const float* xsum, int64_t k2, const uint8_t* q,
               const float* sb, int64_t group, int64_t n0, int64_t n1, int64_t n, float* y) {
  const int64_t groups = k2 / group;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t j = n0; j < n1; ++j) {
    const uint8_t* qr = q + j * (k2 / 2);
    const float* sr = sb + j * groups * 2;
    __m256 tot[M];
    float bsum[M];
    for (int m = 0; m < M; ++m) {
      tot[m] = _mm256_setzero_ps();
      bsum[m] = 0.f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      __m256 a[M], b[M];
      for (int m = 0; m < M; ++m) a[m] = b[m] = _mm256_setzero_ps();
      for (int64_t off = g * group; off < (g + 1) * group; off += 32) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + off / 2));
        const __m128i lo = _mm_and_si128(raw, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int m = 0; m < M; ++m) {
          const float* xr = xe + m * k2 + off;
          a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[m]);
          b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), b[m]);
          a[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a[m]);
          b[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), b[m]);
        }
      }
      const __m256 s = _mm256_set1_ps(sr[2 * g]);
      for (int m = 0; m < M; ++m) {
        tot[m] = _mm256_fmadd_ps(_mm256_add_ps(a[m], b[m]), s, tot[m]);
        bsum[m] += sr[2 * g + 1] * xsum[m * groups + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * n + j] = hsum(tot[m]) + bsum[m];
  }
}
#endif

// The same sums in plain C++ (CPUs without AVX2/FMA).
[[maybe_unused]] void rows_scalar(int64_t mrows, const float* xe, const float* xsum, int64_t k2,
                 const uint8_t* q, const float* sb, int64_t group, int64_t n0, int64_t n1,
                 int64_t n, float* y) {
  const int64_t groups = k2 / group;
  for (int64_t j = n0; j < n1; ++j) {
    const uint8_t* qr = q + j * (k2 / 2);
    const float* sr = sb + j * groups * 2;
    for (int64_t m = 0; m < mrows; ++m) {
      const float* xr = xe + m * k2;
      float tot = 0.f, bsum = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.f;
        for (int64_t off = g * group; off < (g + 1) * group; off += 32)
          for (int i = 0; i < 16; ++i) {
            const uint8_t byte = qr[off / 2 + i];
            acc += static_cast<float>(byte & 15) * xr[off + i];
            acc += static_cast<float>(byte >> 4) * xr[off + 16 + i];
          }
        tot += acc * sr[2 * g];
        bsum += sr[2 * g + 1] * xsum[m * groups + g];
      }
      y[m * n + j] = tot + bsum;
    }
  }
}

}  // namespace

// x [M, K] float32 (M <= 4), q [N, K2 / 2] uint8, sb [N, K2 / group, 2] float32 -> y
// [M, N] float32 (written into `y`, which must be contiguous and of that shape).
void int4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sb, int64_t group,
               bool doubled, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0), k2 = doubled ? 2 * k : k;
  TORCH_CHECK(m >= 1 && m <= 4, "int4_gemv: 1 to 4 rows, got ", m);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "int4_gemv: x float32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) * 2 == k2,
              "int4_gemv: packed values [N, K2 / 2] uint8");
  TORCH_CHECK(group % 32 == 0 && k2 % group == 0, "int4_gemv: group ", group);
  TORCH_CHECK(sb.scalar_type() == at::kFloat && sb.is_contiguous() && sb.size(0) == n &&
                  sb.size(1) == k2 / group, "int4_gemv: scales [N, K2 / group, 2]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == m &&
                  y.size(1) == n, "int4_gemv: output [M, N] float32");
  const int64_t groups = k2 / group;
  const float* xp = x.data_ptr<float>();
  std::vector<float> xe_buf;
  const float* xe = xp;
  if (doubled) {  // [M, K] -> [M, 2K]
    xe_buf.resize(m * k2);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k2; ++c) xe_buf[r * k2 + c] = xp[r * k + c % k];
    xe = xe_buf.data();
  }
  std::vector<float> xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) s += xe[r * k2 + c];
      xsum[r * groups + g] = s;
    }
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = sb.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Enough rows per task that a split pays for the thread hand-off (~64K weights).
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(1, k2));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
#ifdef KVFLOW_INT4_AVX2
    switch (m) {
      case 1: return rows_avx2<1>(xe, xsum.data(), k2, qp, sp, group, n0, n1, n, yp);
      case 2: return rows_avx2<2>(xe, xsum.data(), k2, qp, sp, group, n0, n1, n, yp);
      case 3: return rows_avx2<3>(xe, xsum.data(), k2, qp, sp, group, n0, n1, n, yp);
      default: return rows_avx2<4>(xe, xsum.data(), k2, qp, sp, group, n0, n1, n, yp);
    }
#else
    rows_scalar(m, xe, xsum.data(), k2, qp, sp, group, n0, n1, n, yp);
#endif
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
