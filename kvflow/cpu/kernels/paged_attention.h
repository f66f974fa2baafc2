// Paged decode attention on CPU that reads the KV cache where it lies: int8 (one float
// scale per token and KV head), fp8 E4M3 (one scale per layer for K and one for V) or
// float32, straight from the cache blocks through the block table, with no gathered or
// dequantized copy of the context (the torch path materializes one per layer and step;
// at CPU-B that copy was ~0.9 GB per step in fp32).
//
// One new token per item (a sequence; in the C++ step, a token). Work items are (item,
// KV heads): the query heads that share a KV head (GQA group, G of them) are done
// together, so each key and value row is loaded and widened once for all G queries.
// Two passes over the item's context: every score (q . k over the stored integers,
// times the token's scale after the dot) into a row per query head, one softmax per
// row, then V accumulated block by block with each probability times the value row's
// scale. Float32 math throughout.
//
// This header holds the kernel itself (namespace kvflow::paged, no torch headers): it is
// compiled into paged_attention.cpp's plain C library (ctypes, the torch backend's
// decodes) and into the C++ decode step (kvflow/cpu/step.cpp), so eager decodes
// and the step's attention are one piece of code. Multiply-adds are written as fma8 /
// fmadd (fused where the CPU has FMA, whatever -ffp-contract the including build uses),
// so both builds round alike. Loops are written for the auto-vectorizer (-O3; `omp
// simd` marks the reductions it may reorder).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace kvflow::paged {

// Eight floats: one AVX register, or two SSE ones (GCC vector extensions keep the source
// free of ISA-specific intrinsics; -march=native picks the instructions).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));
typedef uint8_t v8u __attribute__((vector_size(8)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// a * b + c, rounded once where the CPU has FMA (twice without: then no build fuses).
inline v8f fma8(v8f a, v8f b, v8f c) {
#ifdef __FMA__
  return reinterpret_cast<v8f>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                               reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

inline float fmadd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

#ifdef __AVX2__
// GCC lowers a byte-vector conversion to lane-by-lane inserts: use the widening loads.
inline float hsum(v8f v) {
  const __m256 x = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline v8i load8i(const int8_t* p) {
  return reinterpret_cast<v8i>(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline v8i load8i(const uint8_t* p) {
  return reinterpret_cast<v8i>(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
inline float hsum(v8f v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

inline v8i load8i(const int8_t* p) {
  v8b b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, v8i);
}

inline v8i load8i(const uint8_t* p) {
  v8u b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, v8i);
}
#endif

// Widen 8 stored values to float (without their scale).
inline v8f widen8(const float* p) { return load8(p); }

inline v8f widen8(const int8_t* p) { return __builtin_convertvector(load8i(p), v8f); }

#if defined(__AVX2__) && defined(__F16C__)
// E4M3 (float8_e4m3fn) bytes -> floats / 256, exactly: sign and the 7 other bits moved
// into a half float's places (its exponent bias is 8 more than E4M3's, subnormals
// included), then the hardware's half -> float conversion. 0x7f/0xff (NaN) never occur:
// cache writes saturate. The 1 / 256 is folded into the per-tensor scales (kFp8Widen).
constexpr float kFp8Widen = 1.0f / 256;

inline v8f widen8(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  return reinterpret_cast<v8f>(_mm256_cvtph_ps(_mm_or_si128(mag, sign)));
}
#else
// E4M3 (float8_e4m3fn) bytes -> floats, exactly: sign, 4 exponent bits (bias 7), 3
// mantissa bits; exponent 0 is subnormal (m * 2^-9). 0x7f/0xff (NaN) never occur:
// cache writes saturate.
constexpr float kFp8Widen = 1.0f;

inline v8f widen8(const uint8_t* p) {
  const v8i x = load8i(p);
  const v8i e = (x >> 3) & 15, m = x & 7;
  const v8i zero = {};
  const v8i mant = e != zero ? (m | 8) : m;
  const v8i ee = e != zero ? e : zero + 1;
  const v8f pow2 = reinterpret_cast<v8f>((ee + 117) << 23);  // 2^(ee - 10)
  const v8i v = reinterpret_cast<v8i>(__builtin_convertvector(mant, v8f) * pow2);
  return reinterpret_cast<v8f>(v | ((x & 0x80) << 24));
}
#endif

inline float bits_to_float(uint32_t u) { return __builtin_bit_cast(float, u); }

// exp(x) for x <= 0, in place: 2^(x log2 e) split into 2^n * 2^f with |f| <= 1/2 and a
// degree-6 polynomial for 2^f (relative error ~1e-7); vectorizes, unlike calls to expf.
inline void exp_inplace(float* x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    float t = std::max(x[i], -87.0f) * 1.4426950408889634f;
    float fi = std::floor(t + 0.5f);
    float f = (t - fi) * 0.6931471805599453f;  // f ln 2, |.| <= 0.347
    float p = fmadd(f, 1.0f / 720, 1.0f / 120);
    p = fmadd(f, p, 1.0f / 24);
    p = fmadd(f, p, 1.0f / 6);
    p = fmadd(f, p, 0.5f);
    p = fmadd(f, p, 1.0f);
    p = fmadd(f, p, 1.0f);
    x[i] = p * bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23);
  }
}

// One cache block's rows of one KV head as floats: float caches are read in place
// (rows ``tok`` floats apart), others widened into ``buf`` (rows D apart).
inline const float* rows(const float* p, int64_t, int64_t, int64_t tok, float*,
                         int64_t& stride) {
  stride = tok;
  return p;
}

template <typename KV>
inline const float* rows(const KV* p, int64_t n, int64_t d, int64_t tok, float* buf,
                         int64_t& stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; c += 8) store8(buf + t * d + c, widen8(p + t * tok + c));
  stride = d;
  return buf;
}

// Ask for a region's cache lines ahead of use (the next block: its address comes from
// the block table, which the hardware prefetcher cannot follow).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// DC: D / 8 when it is a compile-time constant (the accumulators of one query head then
// stay in registers), 0 for a head dim known only at run time.
//
// Item b (a query token) attends to the first lens[b] positions of block-table row
// row_of[b] (row_of null: row b); its H query heads start at q + b * q_stride and its
// output at out + b * H * D. The C entry below passes one item per sequence; the C++
// step one per token (a prefill chunk's tokens share their request's row, each with its
// own causal length) and its fused qkv rows (q_stride = (H + 2 KVH) D).
//
// Candidate trees (Medusa verification): with ``mask_from`` and ``mask_bits`` given, item
// b sees position p >= mask_from[b] only if bit p - mask_from[b] of mask_bits[b] is set
// (the tree's root is at mask_from[b]; bits past 63 count as set, so -1 sees all).
//
// Sliding windows and soft-capped scores (the C++ step's windowed layers, Mistral, Phi-3,
// Gemma): with ``first`` given, item b sees only positions first[b] .. lens[b] - 1, and
// the blocks before the one holding first[b] are never read (their table entries may
// be stale: the KV cache manager frees blocks behind an all-windowed model's window);
// with ``softcap`` > 0 each score s (q . k times the scales) becomes
// tanh(s / softcap) * softcap before the mask, as transformers' Gemma 2 attention does.
template <int DC, typename KV>
void decode(float* out, const float* q, int64_t q_stride, const KV* cache,
            const float* scales, const int32_t* tables, const int32_t* row_of,
            const int32_t* lens, int64_t b_count, int64_t h, int64_t kvh, int64_t d,
            int64_t nb, int64_t bs, int64_t w, float sm_scale, float k_scale,
            float v_scale, int threads, const int32_t* mask_from = nullptr,
            const int64_t* mask_bits = nullptr, const int32_t* first = nullptr,
            float softcap = 0.0f) {
  const int64_t g_count = h / kvh;
  const int64_t dc = DC ? DC : d / 8;
  const int64_t tok = kvh * d;  // stride between tokens of one block
  const int64_t half = nb * bs * tok;  // K is cache[0], V is cache[1]
  const int64_t shalf = nb * bs * kvh;  // the same for the scales
  // Work items: a sequence with a range of its KV heads. Whole sequences when there
  // are enough of them (a block's K, then V, is then one contiguous run of memory);
  // split by KV head when there are few sequences, so every thread has work.
  const int64_t split = b_count >= 4 * threads ? 1 : kvh;
  const int64_t heads_per = kvh / split;
  int64_t max_len = 0;
  for (int64_t b = 0; b < b_count; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
  const int64_t row_len = (max_len + 7) / 8 * 8;  // a query head's scores, padded
#pragma omp parallel num_threads(threads)
  {
    // Per thread: one block's widened K and V rows of one KV head [BS, D], the scores
    // of the item's query heads over its whole context [heads_per * G, row_len], and
    // the accumulators of one KV head's query heads [G, D].
    std::vector<float> kbuf(bs * d), vbuf(bs * d), s(heads_per * g_count * row_len);
    std::vector<float> acc(g_count * d), vscale(bs), inv_sum(heads_per * g_count);
    // Dynamic: contexts differ in length, so equal shares of work items are not
    // equal work.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < b_count * split; ++task) {
      const int64_t b = task / split;
      const int64_t h0 = (task % split) * heads_per, h1 = h0 + heads_per;
      const int64_t len = lens[b];
      // The window's first key and the first block read; positions lo .. from - 1 of
      // that block are in the score rows but weigh exactly 0.
      const int64_t from = first ? std::clamp<int64_t>(first[b], 0, len) : 0;
      const int64_t j0 = from / bs, lo = j0 * bs;
      const int32_t* table = tables + (row_of ? row_of[b] : b) * w;
      const int64_t bytes = ((bs - 1) * tok + (h1 - h0) * d) * sizeof(KV);
      // Two passes over the context (no online softmax: its per-block running max,
      // exp of the correction and rescaled accumulators cost more than the whole
      // score row kept in L1/L2): 1. every score q . k, the token's scale after the
      // dot; 2. one softmax per query head; 3. V accumulated with p times the value
      // row's scale.
      for (int64_t j = j0; j * bs < len; ++j) {
        const int64_t blk = table[j];
        const int64_t n = std::min(bs, len - j * bs);
        if ((j + 1) * bs < len) prefetch(cache + table[j + 1] * bs * tok + h0 * d, bytes);
        for (int64_t hk = h0; hk < h1; ++hk) {
          const KV* kp = cache + blk * bs * tok + hk * d;
          const float* ksp = scales ? scales + blk * bs * kvh + hk : nullptr;
          const float* qh = q + b * q_stride + hk * g_count * d;  // [G, D] of this KV head
          float* sh = s.data() + (hk - h0) * g_count * row_len + j * bs;  // [G, row_len]
          if (DC) {
            // Each key row widened once, in registers, for all G query heads.
            for (int64_t t = 0; t < n; ++t) {
              const float ks = (ksp ? ksp[t * kvh] : k_scale) * sm_scale;
              v8f kv[DC ? DC : 1];
              for (int c = 0; c < DC; ++c) kv[c] = widen8(kp + t * tok + 8 * c);
              for (int64_t gi = 0; gi < g_count; ++gi) {
                const float* qr = qh + gi * d;
                v8f a0 = load8(qr) * kv[0], a1 = load8(qr + 8) * kv[1];  // two chains
                for (int c = 2; c < DC; c += 2) {
                  a0 = fma8(load8(qr + 8 * c), kv[c], a0);
                  a1 = fma8(load8(qr + 8 * c + 8), kv[c + 1], a1);
                }
                sh[gi * row_len + t] = hsum(a0 + a1) * ks;
              }
            }
          } else {
            int64_t kst;
            const float* kr = rows(kp, n, d, tok, kbuf.data(), kst);
            for (int64_t gi = 0; gi < g_count; ++gi) {
              const float* qr = qh + gi * d;
              for (int64_t t = 0; t < n; ++t) {
                const float* k = kr + t * kst;
                v8f a = load8(qr) * load8(k);
                for (int64_t c = 1; c < dc; ++c) a = fma8(load8(qr + 8 * c), load8(k + 8 * c), a);
                sh[gi * row_len + t] = hsum(a) * ((ksp ? ksp[t * kvh] : k_scale) * sm_scale);
              }
            }
          }
        }
      }
      // Softmax of each query head's scores; the 1 / sum is applied to the output.
      // Keys a tree token may not see score -inf (out of the max) and weigh exactly 0.
      const int64_t mfrom = mask_from ? std::clamp<int64_t>(mask_from[b], 0, len) : len;
      const uint64_t mbits = mask_bits ? static_cast<uint64_t>(mask_bits[b]) : ~0ull;
      auto hidden = [&](int64_t t) { return t - mfrom < 64 && !((mbits >> (t - mfrom)) & 1); };
      for (int64_t r = 0; r < heads_per * g_count; ++r) {
        float* sr = s.data() + r * row_len;
        if (softcap > 0.0f)
          for (int64_t t = from; t < len; ++t) sr[t] = std::tanh(sr[t] / softcap) * softcap;
        for (int64_t t = lo; t < from; ++t) sr[t] = -INFINITY;
        for (int64_t t = mfrom; t < len; ++t)
          if (hidden(t)) sr[t] = -INFINITY;
        v8f mx8 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                   -INFINITY, -INFINITY};
        int64_t t = lo;
        for (; t + 8 <= len; t += 8) {
          const v8f x = load8(sr + t);
          mx8 = x > mx8 ? x : mx8;
        }
        float mx = -INFINITY;
        for (int i = 0; i < 8; ++i) mx = std::max(mx, mx8[i]);
        for (; t < len; ++t) mx = std::max(mx, sr[t]);
        for (t = lo; t < len; ++t) sr[t] -= mx;
        exp_inplace(sr + lo, static_cast<int>(len - lo));
        for (int64_t t = lo; t < from; ++t) sr[t] = 0.0f;
        for (int64_t t = mfrom; t < len; ++t)
          if (hidden(t)) sr[t] = 0.0f;
        v8f sum8 = {};
        for (t = lo; t + 8 <= len; t += 8) sum8 += load8(sr + t);
        float sum = hsum(sum8);
        for (; t < len; ++t) sum += sr[t];
        inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;  // empty context: zeros
      }
      for (int64_t hk = h0; hk < h1; ++hk) {
        // Block by block: its V rows widened once (a float cache is read in place),
        // then each query head's accumulator [D] loaded, fed the block's rows, stored.
        std::fill(acc.begin(), acc.end(), 0.0f);
        const float* ph = s.data() + (hk - h0) * g_count * row_len;  // [G, row_len]
        for (int64_t j = j0; j * bs < len; ++j) {
          const int64_t blk = table[j];
          const int64_t n = std::min(bs, len - j * bs);
          if (hk == h0 && (j + 1) * bs < len)
            prefetch(cache + half + table[j + 1] * bs * tok + h0 * d, bytes);
          const float* vsp = scales ? scales + shalf + blk * bs * kvh + hk : nullptr;
          for (int64_t t = 0; t < n; ++t) vscale[t] = vsp ? vsp[t * kvh] : v_scale;
          int64_t vst;
          const float* vr = rows(cache + half + blk * bs * tok + hk * d, n, d, tok,
                                 vbuf.data(), vst);
          for (int64_t gi = 0; gi < g_count; ++gi) {
            const float* pr = ph + gi * row_len + j * bs;
            float* ag = acc.data() + gi * d;
            if (DC) {
              v8f a[DC ? DC : 1];
              for (int c = 0; c < DC; ++c) a[c] = load8(ag + 8 * c);
              for (int64_t t = 0; t < n; ++t) {
                const float p = pr[t] * vscale[t];
                const v8f pv = {p, p, p, p, p, p, p, p};
                const float* v = vr + t * vst;
                for (int c = 0; c < DC; ++c) a[c] = fma8(pv, load8(v + 8 * c), a[c]);
              }
              for (int c = 0; c < DC; ++c) store8(ag + 8 * c, a[c]);
            } else {
              for (int64_t t = 0; t < n; ++t) {
                const float p = pr[t] * vscale[t];
                const v8f pv = {p, p, p, p, p, p, p, p};
                const float* v = vr + t * vst;
                for (int64_t c = 0; c < dc; ++c)
                  store8(ag + 8 * c, fma8(pv, load8(v + 8 * c), load8(ag + 8 * c)));
              }
            }
          }
        }
        for (int64_t gi = 0; gi < g_count; ++gi) {
          const float inv = inv_sum[(hk - h0) * g_count + gi];
          const float* ag = acc.data() + gi * d;
          float* o = out + (b * h + hk * g_count + gi) * d;
          for (int64_t i = 0; i < d; ++i) o[i] = ag[i] * inv;
        }
      }
    }
  }
}

template <typename KV>
void dispatch(int64_t d, float* out, const float* q, int64_t q_stride, const KV* cache,
              const float* scales, const int32_t* tables, const int32_t* row_of,
              const int32_t* lens, int64_t b, int64_t h, int64_t kvh, int64_t nb,
              int64_t bs, int64_t w, float sm_scale, float k_scale, float v_scale,
              int threads, const int32_t* mask_from = nullptr,
              const int64_t* mask_bits = nullptr, const int32_t* first = nullptr,
              float softcap = 0.0f) {
  if constexpr (std::is_same_v<KV, uint8_t>) {  // fp8: widened values are x kFp8Widen
    k_scale /= kFp8Widen;  // a power of two: the products round as without it
    v_scale /= kFp8Widen;
  }
  auto run = [&](auto dc) {
    decode<decltype(dc)::value>(out, q, q_stride, cache, scales, tables, row_of, lens, b,
                                h, kvh, d, nb, bs, w, sm_scale, k_scale, v_scale, threads,
                                mask_from, mask_bits, first, softcap);
  };
  switch (d) {
    case 32: run(std::integral_constant<int, 4>{}); break;
    case 64: run(std::integral_constant<int, 8>{}); break;
    case 128: run(std::integral_constant<int, 16>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace kvflow::paged
