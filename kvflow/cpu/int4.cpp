// The 4-bit GEMV of the C++ CPU decode step (cpu/step.cpp): y [M, N] = x [M, K] W^T for
// M <= 16 rows in one pass over the weights, float32 activations and float32 sums,
// straight from the packed weights.
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
#include <ATen/ops/from_blob.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_INT4_AVX2 1
#endif

namespace kvflow {

namespace {

#ifdef HAVE_INT4_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows [n0, n1) for M input rows, R output rows at a time (enough independent
// FMA chains to hide their latency); xs [M, K2]: the input scaled per lane block.
// Writes out[m * ld + (j - j0)] for output j.
template <int M, int R>
void rows_avx2(const float* xs, int64_t k2, const int32_t* q, const float* sb,
               int64_t group, int64_t j0, int64_t j1, float* out, int64_t ld) {
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
#define Q4_LANE(J, ACC, WORD_EXPR)                                                   \
      for (int r = 0; r < R; ++r) {                                                      \
        const __m256 w = _mm256_cvtepi32_ps(WORD_EXPR);                                  \
        for (int m = 0; m < M; ++m)                                                      \
          ACC[r][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs + m * k2 + b * 64 + J * 8),   \
                                      ACC[r][m]);                                        \
      }
      Q4_LANE(0, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF)))
      Q4_LANE(1, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF0)))
      Q4_LANE(2, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF00)))
      Q4_LANE(3, acc_a, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF000)))
      Q4_LANE(4, acc_b, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF0000)))
      Q4_LANE(5, acc_b, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF00000)))
      Q4_LANE(6, acc_b, _mm256_and_si256(word[r], _mm256_set1_epi32(0xF000000)))
      // The top nibble as a signed int32 would be negative: shift it down by 4 first.
      Q4_LANE(7, acc_b, _mm256_and_si256(_mm256_srli_epi32(word[r], 4),
                                             _mm256_set1_epi32(0xF000000)))
#undef Q4_LANE
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
      for (int m = 0; m < M; ++m) out[m * ld + (j - j0) + r] = hsum(tot[r][m]);
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

// x [M, K] float32 (M <= 16), q [N, K2 / 8] int32, sb [N, K2 / group, 2] float32 -> y
// [M, N] float32 (written into `y`, which must be contiguous and of that shape).
//
// One pass over the weights for all M rows: each task walks its output rows in spans of
// kSpan and runs every chunk of up to 4 activation rows over a span before moving on, so
// the span's weights come from DRAM once and from L1 for the later chunks (the step's
// multi-token verify rows cost compute, not another read of the layer). Per (row, output)
// the sums run in the same order whatever M and the chunking are: a row's result does not
// depend on the rows beside it (greedy speculative verification needs that).
void int4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sb, int64_t group,
               bool doubled, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0), k2 = doubled ? 2 * k : k;
  TORCH_CHECK(m >= 1 && m <= 16, "int4_gemv: 1 to 16 rows, got ", m);
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
  // Output rows per span: 16 of them are 4-12 KiB of weights at K2 = 576-1536 (L1).
  constexpr int64_t kSpan = 16;
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t j0 = t0 * 4, j1 = std::min(n, t1 * 4), cnt = j1 - j0;
    std::vector<float> tot(m * cnt);  // [M, cnt]
#ifdef HAVE_INT4_AVX2
    // Chunk [m0, m0 + M) over outputs [s0, s1): whole 4-row tiles, the tail one at a time.
    auto run = [&](auto mc, int64_t m0, int64_t s0, int64_t s1) {
      constexpr int M = decltype(mc)::value;
      constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
      const float* xm = xs.data() + m0 * k2;
      float* out = tot.data() + m0 * cnt - j0;  // out[mm * cnt + j]
      const int64_t full = s0 + (s1 - s0) / 4 * 4;
      if (full > s0) rows_avx2<M, R>(xm, k2, qp, sp, group, s0, full, out + s0, cnt);
      for (int64_t jt = full; jt < s1; ++jt)
        rows_avx2<M, 1>(xm, k2, qp, sp, group, jt, jt + 1, out + jt, cnt);
    };
    for (int64_t s0 = j0; s0 < j1; s0 += kSpan) {
      const int64_t s1 = std::min(j1, s0 + kSpan);
      for (int64_t m0 = 0; m0 < m; m0 += 4) {
        switch (std::min<int64_t>(4, m - m0)) {
          case 1: run(std::integral_constant<int, 1>(), m0, s0, s1); break;
          case 2: run(std::integral_constant<int, 2>(), m0, s0, s1); break;
          case 3: run(std::integral_constant<int, 3>(), m0, s0, s1); break;
          default: run(std::integral_constant<int, 4>(), m0, s0, s1); break;
        }
      }
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
#ifdef HAVE_INT4_AVX2
  return true;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------
// int8 activations: integer dot products (AVX512-VNNI, or AVX2's vpmaddubsw), up to 256
// rows (a whole C++ step).
//
// Why: the float32 GEMV above spends ~3 instructions per 8 weights and row (mask,
// convert, FMA) and is bound by them, not by memory (the 30 layers of SmolLM2 read 80 MB
// per token in 7.6 ms, a fifth of this machine's bandwidth). Rounding each activation
// row once per call to int8 in blocks of 32 (scale d = max|x| / 127) turns a block of 64
// weights times one row into one vpdpbusd (64 u8 x s8 products summed in int32 lanes).
//
// Layout (packed.py ``q8_layout``): w uint8 [N, K / 64 * B], per block of 64 inputs
// B bytes: the values (bits 4: 32 bytes, byte i = u[i] | u[i + 32] << 4; bits 8: 64
// bytes, one per input, 0..255), then (scale_a, bias_a, scale_b, bias_b) in float16 for
// its two halves of 32, the weight being u * scale + bias (B = 40 or 72: 0.625 or 1.125
// bytes per weight, as GGUF Q4_1 / Q8_0 themselves). One stream per row: the prefetcher
// keeps up, where separate scale arrays cost ~20% (measured on the 30 layers of SmolLM2).
// Activations: q = round(x / d) in -127..127 and s = d * sum(q) per row and block; then
//   y[m, n] = sum_b scale[n, b] d[m, b] dot(u[n, b], q[m, b]) + bias[n, b] s[m, b],
// the exact product of the weights with the dequantized activations q * d (the dot is
// exact in int32), up to float32 rounding of the sums.

namespace {

// Up to 256 rows per call (q8_gemv takes more in pieces of 256): per tile of output rows
// the kernels run every chunk of activation rows, so the layer is read once per call.
constexpr int64_t kMaxQ8Rows = 256;

// f(std::integral_constant<int, MC>()) for the run-time row count mc in 1..MAX: the SIMD
// kernels' tiles take their number of activation rows as a template argument.
template <int MAX, class F>
void with_rows(int64_t mc, F&& f) {
  if constexpr (MAX > 1) {
    if (mc < MAX) return with_rows<MAX - 1>(mc, f);
  }
  f(std::integral_constant<int, MAX>());
}

// The quantized rows: q [M, K] int8 and per row and block of 64 inputs (two of 32)
// (d_a, d_b, s_a / 8, s_b / 8): the / 8 because the SIMD kernel adds s over 8 lanes.
struct QRows {
  std::vector<int8_t> q;
  std::vector<float> ds;  // [M, K / 64, 4]
};

void quantize_rows(const float* x, int64_t m, int64_t k, QRows& a) {
  a.q.resize(m * k);
  a.ds.resize(m * (k / 64) * 4);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / 32; ++b) {
      const float* xb = x + r * k + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      int8_t* qb = a.q.data() + r * k + b * 32;
      for (int i = 0; i < 32; ++i) {
        // nearbyint: half to even under the default rounding mode, as torch.round.
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
        qb[i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
        sum += qb[i];
      }
      float* ds = a.ds.data() + (r * (k / 64) + b / 2) * 4;
      ds[b % 2] = d;
      ds[2 + b % 2] = d * static_cast<float>(sum) * 0.125f;
    }
}

// The same sums in plain C++ (builds without AVX512-VNNI; the tests' second opinion).
inline int64_t q8_block_bytes(int64_t bits) { return bits == 4 ? 40 : 72; }

inline float half_to_float(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

void q8_rows_scalar(const QRows& a, int64_t m, int64_t k, const uint8_t* w, int bits,
                    int64_t j0, int64_t j1, float* y, int64_t n) {
  const int64_t bb = q8_block_bytes(bits), wrow = k / 64 * bb, nb = k / 32;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t r = 0; r < m; ++r) {
      float tot = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        const int8_t* qb = a.q.data() + r * k + b * 32;
        for (int i = 0; i < 32; ++i) {
          const int64_t c = b * 32 + i;  // input index
          const uint8_t* blk = w + j * wrow + (c / 64) * bb;
          const int64_t o = c % 64;
          // 4-bit: inputs o and o + 32 of a block share byte o % 32.
          const int32_t u = bits == 8 ? blk[o] : o < 32 ? blk[o] & 15 : blk[o - 32] >> 4;
          dot += u * qb[i];
        }
        const float* ds = a.ds.data() + (r * (k / 64) + b / 2) * 4;
        const uint16_t* sh = reinterpret_cast<const uint16_t*>(
            w + j * wrow + (b / 2) * bb + (bits == 4 ? 32 : 64)) + 2 * (b % 2);
        tot += half_to_float(sh[0]) * ds[b % 2] * static_cast<float>(dot) +
               half_to_float(sh[1]) * ds[2 + b % 2] * 8.f;
      }
      y[r * n + j] = tot;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_Q8_VNNI 1

// MC activation rows [m0, m0 + MC) times R output rows [j, j + R), into y [M, N].
// Registers: R * MC accumulators + 3 R for the weights' values, scales and biases.
template <int MC, int R, int BITS>
void q8_tile_vnni(const QRows& a, int64_t m0, int64_t k, const uint8_t* w, int64_t j, float* y,
                  int64_t n) {
  constexpr int64_t BB = BITS == 4 ? 40 : 72, VB = BB - 8;  // block bytes, value bytes
  const int64_t blocks = k / 64, wrow = blocks * BB;
  // Lanes 0-7 sum the first 32 inputs of a block of 64, lanes 8-15 the second 32:
  // permutes of (scale_a, bias_a, scale_b, bias_b) and of (d_a, d_b, s_a, s_b).
  const __m512i i_scale = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i i_bias = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i i_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i i_s = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(),
                                                  _mm256_set1_epi16(4), 1);
  __m512 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int mm = 0; mm < MC; ++mm) acc[r][mm] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wv[R];
    __m512 sw[R], bw[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* wp = w + (j + r) * wrow + b * BB;
      if constexpr (BITS == 4) {
        // The 32 bytes in both halves, the upper half shifted down a nibble: low nibbles
        // (inputs 0-31) then high ones (32-63) in three instructions.
        const __m512i p = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
        wv[r] = _mm512_and_si512(_mm512_srlv_epi16(p, nibble_shift), _mm512_set1_epi8(0x0F));
      } else {
        wv[r] = _mm512_loadu_si512(wp);
      }
      const __m512 s4 = _mm512_castps128_ps512(_mm_cvtph_ps(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + VB))));
      sw[r] = _mm512_permutexvar_ps(i_scale, s4);
      bw[r] = _mm512_permutexvar_ps(i_bias, s4);
    }
    for (int mm = 0; mm < MC; ++mm) {
      const int64_t row = m0 + mm;
      const __m512i xv = _mm512_loadu_si512(a.q.data() + row * k + b * 64);
      const __m512 ds4 = _mm512_castps128_ps512(_mm_loadu_ps(a.ds.data() + (row * blocks + b) * 4));
      const __m512 dv = _mm512_permutexvar_ps(i_d, ds4), sv = _mm512_permutexvar_ps(i_s, ds4);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), dv);
        acc[r][mm] = _mm512_fmadd_ps(t, sw[r], acc[r][mm]);
        acc[r][mm] = _mm512_fmadd_ps(bw[r], sv, acc[r][mm]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int mm = 0; mm < MC; ++mm) y[(m0 + mm) * n + j + r] = _mm512_reduce_add_ps(acc[r][mm]);
}

// Output rows [j0, j1) for all M rows: per tile of 4 output rows, chunks of up to 8
// activation rows (the tile's weights stay in L1 for the second chunk).
template <int BITS>
void q8_rows_vnni(const QRows& a, int64_t m, int64_t k, const uint8_t* w, int64_t j0,
                  int64_t j1, float* y, int64_t n) {
  auto chunk = [&](auto mc, int64_t m0, int64_t t0, int64_t t1) {
    constexpr int MC = decltype(mc)::value;
    constexpr int R = MC <= 2 ? 4 : 2;
    int64_t j = t0;
    for (; j + R <= t1; j += R) q8_tile_vnni<MC, R, BITS>(a, m0, k, w, j, y, n);
    for (; j < t1; ++j) q8_tile_vnni<MC, 1, BITS>(a, m0, k, w, j, y, n);
  };
  for (int64_t t0 = j0; t0 < j1; t0 += 4) {
    const int64_t t1 = std::min(j1, t0 + 4);
    for (int64_t m0 = 0; m0 < m; m0 += 8)
      with_rows<8>(std::min<int64_t>(8, m - m0), [&](auto mc) { chunk(mc, m0, t0, t1); });
  }
}
#endif

#if !defined(HAVE_Q8_VNNI) && defined(HAVE_INT4_AVX2) && defined(__F16C__)
#define HAVE_Q8_AVX2 1

// AVX2 without VNNI: vpmaddubsw multiplies 32 u8 weights by 32 s8 activations and adds
// neighbours into 16 int16, vpmaddwd widens those to 8 int32: exact, since a pair of
// 4-bit products stays below 2 * 15 * 127 (8-bit weights: below 2 * 128 * 127, see
// below). A block of 64 is two such halves with scales of their own; one vphaddd puts
// both halves' sums into one vector (lanes 0, 1, 4, 5: the first 32 inputs; 2, 3, 6, 7:
// the second), so the float part (convert, scale, bias) runs once per block and row.
// 8-bit weights u (0..255) times q would overflow the int16 pairs: they run as
// s = u - 128 with the sign trick (|s| as the unsigned operand, q with s's sign), and the
// 128 u-offset moves into the bias: u * scale + bias = s * scale + (bias + 128 scale).
template <int MC, int R, int BITS>
void q8_tile_avx2(const QRows& a, int64_t m0, int64_t k, const uint8_t* w, int64_t j, float* y,
                  int64_t n) {
  constexpr int64_t BB = BITS == 4 ? 40 : 72, VB = BB - 8;  // block bytes, value bytes
  const int64_t blocks = k / 64, wrow = blocks * BB;
  // Permutes of (scale_a, bias_a, scale_b, bias_b) and of (d_a, d_b, s_a / 8, s_b / 8)
  // onto the lanes' halves. Each half's s / 8 lands on 4 lanes, not 8: the bias vector
  // carries the missing factor 2.
  const __m256i i_scale = _mm256_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2);
  const __m256i i_bias = _mm256_setr_epi32(1, 1, 3, 3, 1, 1, 3, 3);
  const __m256i i_d = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
  const __m256i i_s = _mm256_setr_epi32(2, 2, 3, 3, 2, 2, 3, 3);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int mm = 0; mm < MC; ++mm) acc[r][mm] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i lo[R], hi[R];  // the two halves' weights (8-bit: |s|)
    __m256i slo[R], shi[R];  // 8-bit: s itself, whose signs go onto the activations
    __m256 sw[R], bw[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* wp = w + (j + r) * wrow + b * BB;
      if constexpr (BITS == 4) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        lo[r] = _mm256_and_si256(p, low4);
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
      } else {
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        slo[r] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)),
                                  flip);
        shi[r] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32)), flip);
        lo[r] = _mm256_abs_epi8(slo[r]);  // -128 -> 0x80, read as the unsigned 128
        hi[r] = _mm256_abs_epi8(shi[r]);
      }
      const __m256 s4 = _mm256_castps128_ps256(_mm_cvtph_ps(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + VB))));
      sw[r] = _mm256_permutevar8x32_ps(s4, i_scale);
      __m256 bias = _mm256_permutevar8x32_ps(s4, i_bias);
      if constexpr (BITS == 8) bias = _mm256_fmadd_ps(sw[r], _mm256_set1_ps(128.f), bias);
      bw[r] = _mm256_add_ps(bias, bias);
    }
    for (int mm = 0; mm < MC; ++mm) {
      const int64_t row = m0 + mm;
      const int8_t* xq = a.q.data() + row * k + b * 64;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
      const __m256 ds4 = _mm256_castps128_ps256(_mm_loadu_ps(a.ds.data() + (row * blocks + b) * 4));
      const __m256 dv = _mm256_permutevar8x32_ps(ds4, i_d);
      const __m256 sv = _mm256_permutevar8x32_ps(ds4, i_s);
      for (int r = 0; r < R; ++r) {
        __m256i p0, p1;
        if constexpr (BITS == 4) {
          p0 = _mm256_maddubs_epi16(lo[r], x0);
          p1 = _mm256_maddubs_epi16(hi[r], x1);
        } else {
          p0 = _mm256_maddubs_epi16(lo[r], _mm256_sign_epi8(x0, slo[r]));
          p1 = _mm256_maddubs_epi16(hi[r], _mm256_sign_epi8(x1, shi[r]));
        }
        const __m256i dot = _mm256_hadd_epi32(_mm256_madd_epi16(p0, ones),
                                              _mm256_madd_epi16(p1, ones));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dv);
        acc[r][mm] = _mm256_fmadd_ps(t, sw[r], acc[r][mm]);
        acc[r][mm] = _mm256_fmadd_ps(bw[r], sv, acc[r][mm]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int mm = 0; mm < MC; ++mm) y[(m0 + mm) * n + j + r] = hsum(acc[r][mm]);
}

// Output rows [j0, j1) for all M rows: per tile of 4 output rows, chunks of up to 4
// activation rows (16 registers: fewer rows per chunk than the VNNI kernel's 8).
template <int BITS>
void q8_rows_avx2(const QRows& a, int64_t m, int64_t k, const uint8_t* w, int64_t j0,
                  int64_t j1, float* y, int64_t n) {
  auto chunk = [&](auto mc, int64_t m0, int64_t t0, int64_t t1) {
    constexpr int MC = decltype(mc)::value;
    constexpr int R = MC == 1 ? 4 : 2;
    int64_t j = t0;
    for (; j + R <= t1; j += R) q8_tile_avx2<MC, R, BITS>(a, m0, k, w, j, y, n);
    for (; j < t1; ++j) q8_tile_avx2<MC, 1, BITS>(a, m0, k, w, j, y, n);
  };
  // Chunks as even as possible (5 rows: 3 + 2, not 4 + 1).
  const int64_t chunks = (m + 3) / 4;
  for (int64_t t0 = j0; t0 < j1; t0 += 4) {
    const int64_t t1 = std::min(j1, t0 + 4);
    for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
      const int64_t mc = (m - m0) / (chunks - c);
      with_rows<4>(mc, [&](auto rows) { chunk(rows, m0, t0, t1); });
      m0 += mc;
    }
  }
}
#endif

}  // namespace

// x [M, K] float32, w in q8_layout -> y [M, N] float32 (into `y`). Over 256 rows, in
// pieces of 256 (the weights are read once per piece): a row's sums are its own either
// way, so any M gives each row what a 1-row call gives it.
void q8_gemv(const at::Tensor& x, const at::Tensor& w, int64_t bits, bool simd, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m >= 1, "q8_gemv: at least one row");
  if (m > kMaxQ8Rows) {
    TORCH_CHECK(y.is_contiguous() && y.size(0) == m, "q8_gemv: output [M, N] float32");
    for (int64_t r0 = 0; r0 < m; r0 += kMaxQ8Rows) {
      const int64_t rows = std::min(kMaxQ8Rows, m - r0);
      at::Tensor yr = y.narrow(0, r0, rows);
      q8_gemv(x.narrow(0, r0, rows), w, bits, simd, yr);
    }
    return;
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_gemv: x float32");
  TORCH_CHECK(bits == 4 || bits == 8, "q8_gemv: 4- or 8-bit weights, got ", bits);
  TORCH_CHECK(k % 64 == 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 2 && w.size(1) == k / 64 * q8_block_bytes(bits),
              "q8_gemv: weights uint8 [N, K / 64 * ", q8_block_bytes(bits), "], K % 64 == 0");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == m &&
                  y.size(1) == n, "q8_gemv: output [M, N] float32");
  QRows a;
  quantize_rows(x.data_ptr<float>(), m, k, a);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Tasks of whole 4-row tiles with enough weights (~64K) to pay for a thread hand-off.
  const int64_t tiles = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(1, k));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t j0 = t0 * 4, j1 = std::min(n, t1 * 4);
#ifdef HAVE_Q8_VNNI
    if (simd) {
      if (bits == 4) q8_rows_vnni<4>(a, m, k, wp, j0, j1, yp, n);
      else q8_rows_vnni<8>(a, m, k, wp, j0, j1, yp, n);
      return;
    }
#elif defined(HAVE_Q8_AVX2)
    if (simd) {
      if (bits == 4) q8_rows_avx2<4>(a, m, k, wp, j0, j1, yp, n);
      else q8_rows_avx2<8>(a, m, k, wp, j0, j1, yp, n);
      return;
    }
#endif
    q8_rows_scalar(a, m, k, wp, static_cast<int>(bits), j0, j1, yp, n);
  });
}

// The lm_head's logits y [M, N] of q8_gemv: per row, the k largest recomputed in float32
// from x [M, K] and the layout's dequantized rows (what sampling can pick then agrees
// with float32 inputs). One pass keeps the k best; ~0.03 ms for 49152 logits, where
// torch's topk + gather + einsum took ~0.3 ms per token.
void q8_refine_top(const at::Tensor& x, const at::Tensor& w, int64_t bits, at::Tensor& y,
                   int64_t top) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && y.scalar_type() ==
                  at::kFloat && y.is_contiguous() && y.size(0) == m && w.size(0) == n &&
                  w.scalar_type() == at::kByte && (bits == 4 || bits == 8) && k % 64 == 0 &&
                  w.size(1) == k / 64 * q8_block_bytes(bits),
              "q8_refine_top: x [M, K] and y [M, N] float32, w q8_layout [N, ...]");
  top = std::min(top, n);
  if (top <= 0) return;
  const int64_t bb = q8_block_bytes(bits), wrow = k / 64 * bb;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  std::vector<int64_t> best(top);
  for (int64_t r = 0; r < m; ++r) {
    float* yr = yp + r * n;
    // The k best so far (unordered) and the position of the smallest of them.
    for (int64_t i = 0; i < top; ++i) best[i] = i;
    auto smallest = [&] {
      int64_t s = 0;
      for (int64_t i = 1; i < top; ++i)
        if (yr[best[i]] < yr[best[s]]) s = i;
      return s;
    };
    int64_t lo = smallest();
    float floor = yr[best[lo]];
    for (int64_t j = top; j < n; ++j)
      if (yr[j] > floor) {
        best[lo] = j;
        lo = smallest();
        floor = yr[best[lo]];
      }
    const float* xr = xp + r * k;
    for (int64_t i = 0; i < top; ++i) {
      const uint8_t* row = wp + best[i] * wrow;
      double acc = 0.0;
      for (int64_t b = 0; b < k / 64; ++b) {
        const uint8_t* blk = row + b * bb;
        const uint16_t* sh = reinterpret_cast<const uint16_t*>(blk + bb - 8);
        for (int h = 0; h < 2; ++h) {
          const float scale = half_to_float(sh[2 * h]), bias = half_to_float(sh[2 * h + 1]);
          float part = 0.f;
          for (int o = 32 * h; o < 32 * h + 32; ++o) {
            const int32_t u = bits == 8 ? blk[o] : o < 32 ? blk[o] & 15 : blk[o - 32] >> 4;
            part += (static_cast<float>(u) * scale + bias) * xr[b * 64 + o];
          }
          acc += part;
        }
      }
      yr[best[i]] = static_cast<float>(acc);
    }
  }
}

// Whether this build has a SIMD kernel for q8_gemv, AVX512-VNNI or AVX2 (else it runs the
// plain loops), and which.
bool q8_gemv_simd() {
#if defined(HAVE_Q8_VNNI) || defined(HAVE_Q8_AVX2)
  return true;
#else
  return false;
#endif
}

std::string q8_gemv_isa() {
#if defined(HAVE_Q8_VNNI)
  return "AVX512-VNNI";
#elif defined(HAVE_Q8_AVX2)
  return "AVX2";
#else
  return "";
#endif
}

// uint8 [bytes] in 2 MiB pages where the kernel grants them (madvise; THP "madvise"
// mode gives none otherwise). The step copies every handed-over weight into one such
// arena in the order a step reads them: one long stream, no 4 KiB-page TLB miss every
// 4 KiB (measured: the 30 layers' 4-bit weights streamed at ~10 GB/s from separate
// allocations on one core, the 49152-row lm_head at ~22 GB/s).
at::Tensor q8_arena(int64_t bytes) {
  constexpr int64_t kPage = 2 << 20;
  const int64_t size = std::max<int64_t>(kPage, (bytes + kPage - 1) / kPage * kPage);
  void* p = std::aligned_alloc(kPage, static_cast<size_t>(size));
  TORCH_CHECK(p != nullptr, "q8_arena: out of memory (", size, " bytes)");
#ifdef __linux__
  madvise(p, static_cast<size_t>(size), MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
  return at::from_blob(p, {bytes}, [](void* q) { std::free(q); },
                       at::TensorOptions().dtype(at::kByte));
}

// The GEMV of a layer that handed its weights to the step: ``kind`` 0 is int4_gemv's
// float32 layout (all rows in one pass), 4 or 8 q8_gemv's (int8 activations).
void quant_gemv(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t group,
                bool doubled, int64_t kind, at::Tensor& y) {
  if (kind != 0) return q8_gemv(x, a, kind, q8_gemv_simd(), y);  // b: unused
  int4_gemv(x, a, b, group, doubled, y);  // all rows in one pass over the weights
}

}  // namespace kvflow
