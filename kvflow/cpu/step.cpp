// The C++ CPU decode step: every decoder layer of a Llama-family model in one call.
//
// Why: on CPU a decode step of a small model is mostly host work. In eager PyTorch a
// layer is ~180 aten calls, each paying Python and dispatcher overhead; with hidden size
// 64 almost none of them does arithmetic. Here one call from Python runs all layers:
// RMSNorm, QKV projection, q/k norms (Qwen3, Gemma 3), rotary (each layer's own table),
// paged cache write, paged attention over the block tables (a layer's sliding window and
// soft cap included), o_proj, residual adds, post-norm, gate_up, SiLU-mul (Gemma:
// GeGLU) and down projection; Gemma's (1 + w) float32 norms and its norms of the
// attention and MLP outputs where the layer has them.
// Float32, int8 and fp8 KV caches are written (quantized as kv_quant.py does) and read
// by cpu/kernels/paged_attention.h, the eager decodes' kernel; bf16/fp16 caches by the
// loop in attention() below.
//
// The weights are handed over once (DecodeStep's constructor); per step only the small
// step tensors cross (hidden states after the embedding, positions, slots, query start
// offsets, context lengths, block tables). A linear layer whose weight is not a dense
// tensor (quantized through kvflow's quantization seam) is a Python callable instead,
// called back with the activations.
//
// Tensor layouts (T tokens, R requests, D head dim, H / KVH query / KV heads):
//   hidden [T, E]; positions, slots [T] int64; query_start_loc [R + 1] int32;
//   seq_lens [R] int32 (context length after this step); block_tables [R, W] int32;
//   a layer's cache [2, NB, BS, KVH, D]; rotary cos_sin [max_pos, D] float32 = (cos|sin).
//
// Built with -ffp-contract=off so element-wise math rounds like the eager ops (no fused
// multiply-adds unless written as std::fma): rotary, residual adds and the cache write
// are then bit-exact with the torch backend; norms, SiLU, GEMVs (std::fma) and attention
// sum in another order (rounding differences only).

// Only the headers used (not torch/extension.h): the build takes a fraction of the time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// The paged attention kernel the torch backend's decodes also run (float32, int8 and
// fp8 caches read in place): one copy of that code, compiled into both libraries.
#include "kernels/paged_attention.h"

namespace py = pybind11;

namespace kvflow {  // cpu/int4.cpp
void int4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sb, int64_t group,
               bool doubled, at::Tensor& y);
bool int4_gemv_simd();
void quant_gemv(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t group,
                bool doubled, int64_t kind, at::Tensor& y);
bool q8_gemv_simd();
std::string q8_gemv_isa();
at::Tensor q8_arena(int64_t bytes);
void q8_refine_top(const at::Tensor& x, const at::Tensor& w, int64_t bits, at::Tensor& y,
                   int64_t top);
void q8_gemv(const at::Tensor& x, const at::Tensor& w, int64_t bits, bool simd, at::Tensor& y);
constexpr int64_t kMaxGemvRows = 16;
}  // namespace kvflow

namespace {

// A linear layer: a dense weight [N, K] (+ bias [N]) or a Python callable x -> y; a
// 4-bit layer may also hand its weights over for cpu/int4.cpp's GEMV (up to 16 rows on
// float32 activations, any number on int8 ones).
struct Linear {
  at::Tensor weight;
  at::Tensor wt;  // a small float32 weight transposed [K, N], else undefined
  c10::optional<at::Tensor> bias;
  py::object fn;  // None when dense
  at::Tensor q4, sb4;  // quant_gemv's values and (scale, bias) per group
  int64_t group4 = 0;
  bool doubled4 = false;
  int64_t kind4 = 0;  // 0: float32 activations (int4_gemv); 4, 8: int8 ones (q8_gemv)
  bool dense() const { return fn.is_none(); }
  bool int4() const { return q4.defined() && q4.numel() > 0; }
  int64_t out_features() const {
    return int4() ? q4.size(0) : dense() ? weight.size(0) : 0;
  }
};

// One adapted linear's LoRA slots: the live buffers of kvflow/lora/layers.py's
// LoRAWeights, which slots.py overwrites in place when an adapter moves into a slot (so
// these tensors share their storage; nothing is copied here). Slice i of the output is
// columns offsets[i] .. offsets[i] + sizes[i] (q/k/v, gate/up); its A rows are
// i * rank .. i * rank + r of a slot, its B columns 0 .. r (r: the slot's rank; both
// zero past it). The scale is folded into B.
struct LoraLinear {
  at::Tensor a;  // [S, slices * rank, K], the activation dtype
  at::Tensor b;  // [S, N, rank]
  std::vector<int64_t> offsets, sizes;
  int64_t rank = 0;
  bool on() const { return a.defined(); }
};

struct Layer {
  at::Tensor in_norm, post_norm;  // [E]: before attention, before the MLP
  // Optional (undefined: none): per-head q and k norms [D] (Qwen3, Gemma 3), and
  // Gemma's norms of the attention and MLP outputs [E] before their residual adds.
  at::Tensor q_norm, k_norm, attn_out_norm, mlp_out_norm;
  Linear qkv, o, gate_up, down;
  LoraLinear lora[4];  // the adapters' slots of qkv, o, gate_up, down (set_lora)
  at::Tensor cos_sin;  // this layer's rotary table [max_pos, D] float32 = (cos|sin)
  float scale = 1.f;  // the scores' scale (head_dim^-0.5, Gemma's query_pre_attn_scalar)
  int64_t window = 0;  // keys a query sees, itself included (0: all)
  float softcap = 0.f;  // scores become tanh(s / softcap) * softcap (0: none)
  at::Tensor cache;  // [2, NB, BS, KVH, D]
  // A quantized cache (set_kv_quant): int8's scales [2, NB, BS, KVH] float32, fp8's
  // per-tensor K and V scales.
  at::Tensor kv_scales;
  float k_scale = 1.f, v_scale = 1.f;
};

// How the cache of every layer is stored: the model dtype, or quantized (kv_quant.py).
enum class KVKind { kModel = 0, kInt8 = 1, kFp8 = 2 };

// One token's K (or V) heads [KVH, D] of the model dtype -> int8 [KVH, D] and one scale
// per head, as kv_quant.quantize_int8: s = max|x| / 127, q = round-half-away(x / s)
// clamped to 127 (an all-zero head keeps s = 0 and stores zeros).
template <typename T>
void quantize_int8_row(const T* x, int8_t* q, float* s, int64_t kvh, int64_t d) {
  for (int64_t hh = 0; hh < kvh; ++hh) {
    const T* xh = x + hh * d;
    float amax = 0.f;
    for (int64_t j = 0; j < d; ++j)
      amax = std::max(amax, std::fabs(static_cast<float>(xh[j])));
    const float scale = amax / 127.f;
    const float div = scale > 0.f ? scale : 1.f;
    for (int64_t j = 0; j < d; ++j) {
      const float y = static_cast<float>(xh[j]) / div;
      const float r = std::min(std::floor(std::fabs(y) + 0.5f), 127.f);
      q[hh * d + j] = static_cast<int8_t>(std::copysign(r, y));
    }
    s[hh] = scale;
  }
}

// n values of the model dtype -> float8_e4m3fn bytes of x * inv_scale saturated to
// +-448 (kv_quant.quantize_fp8: times the reciprocal, then torch's round-to-nearest-even
// conversion; a plain cast would overflow to NaN).
template <typename T>
void quantize_fp8_row(const T* x, uint8_t* q, float inv_scale, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float v = static_cast<float>(x[j]) * inv_scale;
    v = v < -448.f ? -448.f : v > 448.f ? 448.f : v;  // NaN stays NaN, as clamp_
    q[j] = c10::Float8_e4m3fn(v).x;
  }
}

// Dot product of two float rows with 8 independent partial sums (vectorizes without
// -ffast-math; the order is fixed, so results are deterministic).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] = std::fma(a[k + j], b[k + j], acc[j]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// e^x for x <= 0 (softmax numerators), in plain arithmetic the compiler vectorizes (a
// libm call per score is most of a small attention's time): x = n ln2 + r, |r| <= ln2/2,
// e^r by a degree-6 polynomial, 2^n through the exponent bits. About 1 ulp; 0 below -87.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.f);
  // Round to nearest with the 1.5 * 2^23 trick (vectorizes where nearbyint may not).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// q . k for a float query and a cache row of the model dtype, 8 partial sums.
template <typename T>
inline float dot_row(const float* q, const T* k, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) acc[u] = std::fma(q[j + u], static_cast<float>(k[j + u]), acc[u]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < n; ++j) s += q[j] * static_cast<float>(k[j]);
  return s;
}

// Weights up to this size also keep a transposed copy [K, N] for the GEMV below: with
// few inputs (hidden 64) a dot product per output is mostly its horizontal sum.
constexpr int64_t kTransposeBytes = 256 * 1024;

// y[r, j] = dot_f32(x row r, w row j) for R rows of x (row stride k) and J weight rows
// (stride k), in one pass: each (row, output) pair keeps dot_f32's 8 partial sums in one
// register, so its result is dot_f32's whatever R and J (a verify row gives exactly a
// one-row decode's numbers), and the R x J independent chains hide the FMA latency that
// bounds a single dot product. Per 8 inputs: R + J loads for R x J FMAs.
template <int R, int J>
inline void dot_f32_tile(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) v[r][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 wv[J];
    for (int j = 0; j < J; ++j) wv[j] = _mm256_loadu_ps(w + j * k + c);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + c);
      for (int j = 0; j < J; ++j) v[r][j] = _mm256_fmadd_ps(xv, wv[j], v[r][j]);
    }
  }
  alignas(32) float a[8];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      _mm256_store_ps(a, v[r][j]);
      float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
      for (int64_t i = c; i < k; ++i) s += x[r * k + i] * w[j * k + i];
      y[r * ldy + j] = s;
    }
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) y[r * ldy + j] = dot_f32(x + r * k, w + j * k, k);
#endif
}

// Tiles that fit the vector registers (accumulators R x J, plus J weights and a row):
// AVX-512 machines have 32, AVX2 ones 16. One weight row at a time (J = 1) takes up to
// 4 rows either way.
#if defined(__AVX512VL__)
constexpr int kTileRows = 4, kTileCols = 4;
#else
constexpr int kTileRows = 2, kTileCols = 4;
#endif

// Rows [0, r) of x times outputs [0, J) of w into y (row stride ldy); r at most 4 (J = 1)
// or kTileRows.
template <int J>
inline void dot_f32_rows(const float* x, int64_t r, const float* w, int64_t k, float* y,
                         int64_t ldy) {
  constexpr bool wide = J == 1 || kTileRows == 4;
  switch (r) {
    case 4: if constexpr (wide) return dot_f32_tile<4, J>(x, w, k, y, ldy); break;
    case 3: if constexpr (wide) return dot_f32_tile<3, J>(x, w, k, y, ldy); break;
    case 2: return dot_f32_tile<2, J>(x, w, k, y, ldy);
    default: return dot_f32_tile<1, J>(x, w, k, y, ldy);
  }
  TORCH_CHECK(false, "dot_f32_rows: ", r, " rows");
}

// Outputs [n0, n1) of y = x W^T for all t rows, J weight rows per tile.
template <int J>
void linear_span_f32(const float* xp, int64_t t, int64_t k, const float* wp, int64_t n0,
                     int64_t n1, float* yp, int64_t ldy) {
  constexpr int64_t rows = J == 1 ? 4 : kTileRows;
  for (int64_t j = n0; j < n1; j += J) {
    const int64_t cols = std::min<int64_t>(J, n1 - j);
    for (int64_t i = 0; i < t; i += rows) {
      const int64_t r = std::min<int64_t>(rows, t - i);
      float* y = yp + i * ldy + j;
      if (cols == J) dot_f32_rows<J>(xp + i * k, r, wp + j * k, k, y, ldy);
      else
        for (int64_t q = 0; q < cols; ++q)
          dot_f32_rows<1>(xp + i * k, r, wp + (j + q) * k, k, y + q, ldy);
    }
  }
}

// y [T, N] = x [T, K] W^T + b for float32 and up to kMaxGemvRows rows, into `y` (row
// stride ldy). Library GEMMs cost microseconds of setup per call at these sizes and at
// 2-16 rows read the weights as if compute-bound (SmolLM2's 30 dense layers, 2 threads:
// at::linear 38-52 ms for 5-16 rows, this 24-42 ms; one row 14 ms); here each weight row
// comes from memory once for all rows, and every (row, output) sum is dot_f32's. Up to
// 5 rows (a decode, a short verify step) walk one weight row at a time, which streams
// fastest; more rows take tiles of kTileCols weight rows (fewer loads per FMA).
void linear_rows_f32(const float* xp, int64_t t, int64_t k, const float* wp, const float* bp,
                     int64_t n, float* yp, int64_t ldy) {
  const int64_t grain = std::max<int64_t>(kTileCols, 32768 / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    if (t <= 5) linear_span_f32<1>(xp, t, k, wp, n0, n1, yp, ldy);
    else linear_span_f32<kTileCols>(xp, t, k, wp, n0, n1, yp, ldy);
    if (bp)
      for (int64_t i = 0; i < t; ++i)
        for (int64_t q = n0; q < n1; ++q) yp[i * ldy + q] += bp[q];
  });
}

// The same for a layer of the step: small weights (<= kTransposeBytes) use their
// transposed copy (with few inputs, hidden 64, a dot product per output would be mostly
// its horizontal sum).
void small_linear_f32(const at::Tensor& x, const Linear& l, at::Tensor& y) {
  const int64_t t = x.size(0), k = x.size(1), n = l.weight.size(0);
  const float* xp = x.data_ptr<float>();
  const float* bp = l.bias.has_value() ? l.bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (l.wt.defined()) {  // y[n] = sum_k x[k] Wt[k, n]: vectorized over n
    const float* wt = l.wt.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      float* yr = yp + i * n;
      const float* xr = xp + i * k;
      for (int64_t j = 0; j < n; ++j) yr[j] = 0.f;
      for (int64_t c = 0; c < k; ++c) {
        const float xv = xr[c];
        const float* w = wt + c * n;
        for (int64_t j = 0; j < n; ++j) yr[j] = std::fma(xv, w[j], yr[j]);
      }
      if (bp)
        for (int64_t j = 0; j < n; ++j) yr[j] += bp[j];
    }
    return;
  }
  linear_rows_f32(xp, t, k, l.weight.data_ptr<float>(), bp, n, yp, n);
}

// x [T, K] -> [T, N]: into `buf` (a [T, N] workspace) on the small float32 path, else a
// new tensor from ATen (at::linear, as F.linear) or the layer's Python method.
at::Tensor linear(const at::Tensor& x, const Linear& l, at::Tensor& buf) {
  if (l.int4() && (l.kind4 || x.size(0) <= kvflow::kMaxGemvRows)) {
    const bool f32 = x.scalar_type() == at::kFloat;
    at::Tensor xf = f32 ? x : x.to(at::kFloat);
    at::Tensor y = f32 && buf.size(1) == l.q4.size(0) ? buf
                       : at::empty({x.size(0), l.q4.size(0)}, xf.options());
    kvflow::quant_gemv(xf, l.q4, l.sb4, l.group4, l.doubled4, l.kind4, y);
    if (l.bias.has_value()) y.add_(*l.bias);
    return f32 ? y : y.to(x.scalar_type());
  }
  if (!l.dense()) return l.fn(x).cast<at::Tensor>().contiguous();
  if (x.scalar_type() == at::kFloat && l.weight.scalar_type() == at::kFloat &&
      x.size(0) <= kvflow::kMaxGemvRows) {
    small_linear_f32(x, l, buf);
    return buf;
  }
  return at::linear(x, l.weight, l.bias).contiguous();
}

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// 1 / sqrt(mean(x^2) + eps) over one row of width e, in float32.
template <typename T>
inline float inv_rms(const T* xr, int64_t e, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < e; ++i) {
    float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
  return 1.f / std::sqrt(ss / static_cast<float>(e) + eps);
}

// out = norm(x) * w, as the eager RMSNorm: normalize in float32, round to the model
// dtype, then scale in the model dtype. Rows of width e.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t e, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * e;
    const float inv = inv_rms(xr, e, eps);
    T* o = out + r * e;
    for (int64_t i = 0; i < e; ++i) {
      T normed = round_to<T>(static_cast<float>(xr[i]) * inv);
      o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
    }
  }
}

// Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight) all in float32, rounded
// to the model dtype once; w1 holds 1 + weight in float32.
template <typename T>
void gemma_norm_rows(const T* x, const float* w1, T* out, int64_t rows, int64_t e, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * e;
    const float inv = inv_rms(xr, e, eps);
    T* o = out + r * e;
    for (int64_t i = 0; i < e; ++i) o[i] = round_to<T>(static_cast<float>(xr[i]) * inv * w1[i]);
  }
}

// acc := a + acc in the model dtype (the residual stream), n elements.
template <typename T>
void add_into(const T* a, T* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    acc[i] = round_to<T>(static_cast<float>(a[i]) + static_cast<float>(acc[i]));
}

// A step's adapter rows grouped by slot (forward's lora_slots): each group's rows run
// one small GEMM pair per adapted linear.
struct LoraGroup {
  int64_t slot, rank;
  std::vector<int64_t> rows;  // ascending
  bool contiguous() const { return rows.back() - rows.front() + 1 == (int64_t)rows.size(); }
};

#if defined(__AVX2__) && defined(__FMA__)
// The horizontal sums of v[0..7], in that order, as one vector.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// out[j] = xa . b row j (rows ldb apart) for j in [0, n), over the first r of each:
// the expand of one LoRA row, r being tiny (the rank). With AVX2, 8 outputs at a time
// over r8 = r rounded up to 8 (the caller passes r8 <= ldb: A and B are zero past the
// slot's rank, so the extra products are exact zeros), their 8 sums reduced together.
inline void lora_expand_row(const float* xa, const float* b, int64_t ldb, int64_t r,
                            int64_t r8, int64_t n, float* out) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (r8 % 8 == 0 && r8 <= ldb)
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      for (int q = 0; q < 8; ++q) acc[q] = _mm256_setzero_ps();
      for (int64_t c = 0; c < r8; c += 8) {
        const __m256 xv = _mm256_loadu_ps(xa + c);
        for (int q = 0; q < 8; ++q)
          acc[q] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(b + (j + q) * ldb + c), acc[q]);
      }
      _mm256_storeu_ps(out + j, hsum8(acc));
    }
#endif
  for (; j < n; ++j) out[j] = dot_f32(xa, b + j * ldb, r);
}

// y [T, N] += each adapter row's delta from x [T, K] (both the activation dtype T):
// per group of rows of one slot, xa = x A_s^T (every slice, cut at the slot's rank) in
// float32, then per slice y[:, slice] += xa_i B_s,i^T, summed in float32 and rounded to
// T once (the eager path's add_lora_delta computes the same products in T).
template <typename T>
void add_lora(const LoraLinear& lo, const at::Tensor& x, at::Tensor& y,
              const std::vector<LoraGroup>& groups) {
  const int64_t k = x.size(1), n_out = y.size(1), ns = (int64_t)lo.sizes.size();
  const int64_t R = lo.rank, ld = ns * R;
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && k == lo.a.size(2) &&
                  n_out == lo.b.size(1) && y.size(0) == x.size(0),
              "DecodeStep: LoRA slots do not fit the layer's activations");
  TORCH_CHECK(lo.a.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "DecodeStep: LoRA slots of dtype ", lo.a.scalar_type(), " for activations of ",
              x.scalar_type());
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* a_all = lo.a.data_ptr<T>();
  const T* b_all = lo.b.data_ptr<T>();
  for (const LoraGroup& g : groups) {
    const int64_t n = (int64_t)g.rows.size(), r = g.rank;
    if (r == 0) continue;
    TORCH_CHECK(r <= R, "DecodeStep: a slot of rank ", r, " over LoRA slots of rank ", R);
    const int64_t r8 = std::min<int64_t>(R, (r + 7) / 8 * 8);
    // The group's rows of x and the slot's A and B as float32 (a float32 model: in place).
    std::vector<float> xbuf, abuf, bbuf;
    const float *xg, *ag, *bg;
    const T* as = a_all + g.slot * ld * k;
    const T* bs = b_all + g.slot * n_out * R;
    if constexpr (std::is_same_v<T, float>) {
      ag = as;
      bg = bs;
      if (g.contiguous()) xg = xp + g.rows.front() * k;
    } else {
      abuf.assign(as, as + ld * k);  // converted element by element
      bbuf.assign(bs, bs + n_out * R);
      ag = abuf.data();
      bg = bbuf.data();
    }
    if (!std::is_same_v<T, float> || !g.contiguous()) {
      xbuf.resize(n * k);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < k; ++c)
          xbuf[i * k + c] = static_cast<float>(xp[g.rows[i] * k + c]);
      xg = xbuf.data();
    }
    // Shrink: xa [n, ns * R] (zero past the rank), row blocks over the threads.
    std::vector<float> xa(n * ld, 0.f);
    const int64_t row_grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, k * ns * r));
    at::parallel_for(0, n, row_grain, [&](int64_t i0, int64_t i1) {
      // Every (row, rank) sum is dot_f32's whatever the tile: a row's delta is its own.
      for (int64_t s = 0; s < ns; ++s) {
        float* out = xa.data() + i0 * ld + s * R;
        if (i1 - i0 <= 5)
          linear_span_f32<1>(xg + i0 * k, i1 - i0, k, ag + s * R * k, 0, r, out, ld);
        else
          linear_span_f32<kTileCols>(xg + i0 * k, i1 - i0, k, ag + s * R * k, 0, r, out, ld);
      }
    });
    // Expand: per slice, blocks of 8 output columns over the threads.
    for (int64_t s = 0; s < ns; ++s) {
      const int64_t off = lo.offsets[s], cols = lo.sizes[s];
      const int64_t blocks = (cols + 7) / 8;
      const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 8 * n * r8));
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        const int64_t j0 = b0 * 8, j1 = std::min(cols, b1 * 8);
        std::vector<float> d(j1 - j0);
        for (int64_t i = 0; i < n; ++i) {
          lora_expand_row(xa.data() + i * ld + s * R, bg + (off + j0) * R, R, r, r8, j1 - j0,
                          d.data());
          T* yr = yp + g.rows[i] * n_out + off + j0;
          for (int64_t j = 0; j < j1 - j0; ++j)
            yr[j] = round_to<T>(static_cast<float>(yr[j]) + d[j]);
        }
      });
    }
  }
}

class DecodeStep {
 public:
  DecodeStep(std::vector<at::Tensor> norms, std::vector<at::Tensor> dense,
             std::vector<py::object> fns, std::vector<at::Tensor> int4,
             std::vector<int64_t> int4_meta, std::vector<at::Tensor> caches,
             at::Tensor final_norm, std::vector<at::Tensor> cos_sins, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double eps, std::vector<double> scales,
             std::vector<int64_t> windows, std::vector<double> softcaps,
             std::vector<at::Tensor> extra_norms, bool gemma, std::string act)
      : final_norm_(final_norm), h_(num_heads), kvh_(num_kv_heads), d_(head_dim), eps_(eps),
        gemma_(gemma), gelu_(act == "gelu_tanh") {
    // Per layer: norms [in, post]; dense [weight, bias or empty] x 4 linears (qkv, o,
    // gate_up, down); fns: the callable or None per linear; int4: [values, scales] per
    // linear (empty: none) and int4_meta [group, doubled, kind] per linear; its rotary
    // table, score scale, window (0: none) and soft cap (0: none); extra_norms [q, k,
    // attention output, MLP output] (empty: none). gemma: every norm weight is
    // 1 + weight in float32 (gemma_norm_rows); act: "silu" or "gelu_tanh" (GeGLU).
    const size_t nl = caches.size();
    TORCH_CHECK(norms.size() == 2 * nl && dense.size() == 8 * nl && fns.size() == 4 * nl &&
                    int4.size() == 8 * nl && int4_meta.size() == 12 * nl &&
                    cos_sins.size() == nl && scales.size() == nl && windows.size() == nl &&
                    softcaps.size() == nl && extra_norms.size() == 4 * nl,
                "DecodeStep: weights and caches disagree on the number of layers");
    TORCH_CHECK(d_ % 2 == 0 && h_ % kvh_ == 0, "DecodeStep: bad head layout");
    TORCH_CHECK(act == "silu" || act == "gelu_tanh", "DecodeStep: activation ", act);
    for (size_t i = 0; i < nl; ++i) {
      Layer L;
      L.in_norm = norms[2 * i];
      L.post_norm = norms[2 * i + 1];
      at::Tensor* extra[4] = {&L.q_norm, &L.k_norm, &L.attn_out_norm, &L.mlp_out_norm};
      for (int j = 0; j < 4; ++j)
        if (extra_norms[4 * i + j].numel()) *extra[j] = extra_norms[4 * i + j].contiguous();
      L.cos_sin = cos_sins[i].contiguous();
      TORCH_CHECK(L.cos_sin.scalar_type() == at::kFloat && L.cos_sin.dim() == 2 &&
                      L.cos_sin.size(1) == d_, "DecodeStep: rotary table of layer ", i,
                  " must be float32 [max_pos, head_dim]");
      L.scale = static_cast<float>(scales[i]);
      L.window = windows[i];
      L.softcap = static_cast<float>(softcaps[i]);
      TORCH_CHECK(L.window >= 0 && L.softcap >= 0.f, "DecodeStep: window and soft cap >= 0");
      Linear* lins[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
      for (int j = 0; j < 4; ++j) {
        lins[j]->fn = fns[4 * i + j];
        lins[j]->q4 = int4[8 * i + 2 * j];
        lins[j]->sb4 = int4[8 * i + 2 * j + 1];
        lins[j]->group4 = int4_meta[12 * i + 3 * j];
        lins[j]->doubled4 = int4_meta[12 * i + 3 * j + 1] != 0;
        lins[j]->kind4 = int4_meta[12 * i + 3 * j + 2];
        if (lins[j]->int4()) {
          const at::Tensor& b = dense[8 * i + 2 * j + 1];
          if (b.defined() && b.numel() > 0) lins[j]->bias = b.to(at::kFloat).contiguous();
        }
        if (lins[j]->dense()) {
          lins[j]->weight = dense[8 * i + 2 * j].contiguous();
          const at::Tensor& w = lins[j]->weight;
          if (w.scalar_type() == at::kFloat && w.numel() * 4 <= kTransposeBytes)
            lins[j]->wt = w.t().contiguous();
          const at::Tensor& b = dense[8 * i + 2 * j + 1];
          if (b.defined() && b.numel() > 0) lins[j]->bias = b.contiguous();
        }
      }
      L.cache = caches[i];
      TORCH_CHECK(L.cache.is_contiguous() && L.cache.dim() == 5 && L.cache.size(3) == kvh_ &&
                      L.cache.size(4) == d_, "DecodeStep: layer cache layout");
      layers_.push_back(std::move(L));
    }
  }

  // hidden [T, E] (after the embedding) -> final normed hidden states [T, E].
  // tree_bits [T] int64 and tree_start [R] int32 (both empty without candidate trees):
  // a Medusa verification step's tree masks, as AttentionMetadata.tree holds them. Token
  // j sees position p >= tree_start[its request] only if bit p - tree_start of
  // tree_bits[j] is set (-1: every position).
  //
  // prompt_rows [P] int64 (ascending; empty: none): the step's tokens that are prompt
  // tokens. With int8 activations they take each GGUF linear's own method (the eager
  // path's bfloat16-activation int4 GEMM) and only the other rows (decodes, drafts)
  // the int8-activation GEMV: a prompt is computed once and every later token attends
  // to its K/V, so its rows keep the finer rounding (on SmolLM2 int8 activations on the
  // prompt turn near ties of the first tokens, as they do in llama.cpp).
  //
  // lora_slots [T] int32 (empty: no adapter rows) and lora_ranks [S] int32: each row's
  // LoRA slot (-1: the base model) and each slot's rank; every adapted linear (set_lora)
  // adds its delta to the rows of a slot (add_lora).
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slots,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor block_tables,
                     at::Tensor tree_bits, at::Tensor tree_start, at::Tensor prompt_rows,
                     at::Tensor lora_slots, at::Tensor lora_ranks) {
    hidden = hidden.contiguous();
    block_tables = block_tables.contiguous();
    TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                    query_start_loc.scalar_type() == at::kInt &&
                    seq_lens.scalar_type() == at::kInt &&
                    block_tables.scalar_type() == at::kInt,
                "DecodeStep.forward: step tensor dtypes");
    const int64_t t = hidden.size(0);
    TORCH_CHECK(positions.numel() == t && slots.numel() == t, "DecodeStep: token counts");
    // Per token: its request and its context length (causal: up to its own position).
    const int64_t r = seq_lens.numel();
    const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    std::vector<int32_t> tok_req(t), tok_ctx(t);
    int32_t max_ctx = 0;
    for (int64_t i = 0; i < r; ++i)
      for (int32_t j = qsl[i]; j < qsl[i + 1]; ++j) {
        tok_req[j] = static_cast<int32_t>(i);
        tok_ctx[j] = lens[i] - (qsl[i + 1] - j) + 1;
        max_ctx = std::max(max_ctx, tok_ctx[j]);
      }
    TORCH_CHECK(qsl[r] == t, "DecodeStep: query_start_loc does not cover the tokens");
    Mask mask;
    if (tree_bits.numel()) {
      TORCH_CHECK(tree_bits.scalar_type() == at::kLong && tree_bits.numel() == t &&
                      tree_start.scalar_type() == at::kInt && tree_start.numel() == r,
                  "DecodeStep: tree_bits [T] int64 and tree_start [R] int32");
      tree_bits = tree_bits.contiguous();
      tree_start = tree_start.contiguous();
      const int32_t* st = tree_start.data_ptr<int32_t>();
      mask.from.resize(t);
      for (int64_t j = 0; j < t; ++j) mask.from[j] = st[tok_req[j]];
      mask.bits = tree_bits.data_ptr<int64_t>();
      for (const Layer& L : layers_)  // a tree token's window is not defined (eager's neither)
        TORCH_CHECK(L.window == 0, "DecodeStep: candidate trees on windowed layers");
    }
    PromptRows rows;
    if (const int64_t p = prompt_rows.numel()) {
      TORCH_CHECK(prompt_rows.scalar_type() == at::kLong && prompt_rows.dim() == 1 && p <= t,
                  "DecodeStep: prompt_rows [P <= T] int64");
      rows.prompt = prompt_rows.contiguous();
      if (p < t) {
        at::Tensor keep = at::empty({t}, hidden.options().dtype(at::kBool));
        keep.fill_(true);
        keep.index_fill_(0, rows.prompt, false);
        rows.gen = keep.nonzero().view({-1});
        TORCH_CHECK(rows.gen.numel() + p == t, "DecodeStep: prompt_rows repeat");
      }
    }
    std::vector<LoraGroup> lora;
    if (lora_slots.numel()) {
      TORCH_CHECK(lora_slots.scalar_type() == at::kInt && lora_slots.numel() == t &&
                      lora_ranks.scalar_type() == at::kInt && lora_ranks.numel() == lora_slots_,
                  "DecodeStep: lora_slots [T] int32 and lora_ranks [S] int32 over the ",
                  lora_slots_, " slots set_lora was given");
      lora_slots = lora_slots.contiguous();
      lora_ranks = lora_ranks.contiguous();
      const int32_t* ts = lora_slots.data_ptr<int32_t>();
      const int32_t* rk = lora_ranks.data_ptr<int32_t>();
      std::vector<int64_t> at_slot(lora_slots_, -1);  // index into lora per slot
      for (int64_t i = 0; i < t; ++i) {
        const int32_t sl = ts[i];
        if (sl < 0) continue;
        TORCH_CHECK(sl < lora_slots_, "DecodeStep: LoRA slot ", sl, " of ", lora_slots_);
        if (at_slot[sl] < 0) {
          at_slot[sl] = (int64_t)lora.size();
          lora.push_back(LoraGroup{sl, rk[sl], {}});
        }
        lora[at_slot[sl]].rows.push_back(i);
      }
    }
    at::Tensor out;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(),
                                    "kvflow_decode_step", [&] {
      out = run<scalar_t>(hidden, positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                          tok_req, tok_ctx, max_ctx, block_tables, mask, rows, lora);
    });
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t num_int4() const {
    int64_t c = 0;
    for (const Layer& L : layers_) c += L.qkv.int4() + L.o.int4() + L.gate_up.int4() + L.down.int4();
    return c;
  }

  // A quantized KV cache for every layer: kind "int8" (scales: each layer's
  // [2, NB, BS, KVH] float32) or "fp8" (k_scales / v_scales: each layer's per-tensor
  // scales); the caches handed to the constructor then hold int8 / float8_e4m3fn.
  void set_kv_quant(const std::string& kind, std::vector<at::Tensor> scales,
                    std::vector<double> k_scales, std::vector<double> v_scales) {
    const size_t nl = layers_.size();
    TORCH_CHECK(kind == "int8" || kind == "fp8", "DecodeStep: KV cache kind ", kind);
    TORCH_CHECK(d_ % 8 == 0, "DecodeStep: a quantized KV cache needs a head dim "
                "that is a multiple of 8");
    kv_kind_ = kind == "int8" ? KVKind::kInt8 : KVKind::kFp8;
    const auto want = kv_kind_ == KVKind::kInt8 ? at::kChar : at::kFloat8_e4m3fn;
    TORCH_CHECK(k_scales.size() == nl && v_scales.size() == nl &&
                    (kv_kind_ == KVKind::kFp8 || scales.size() == nl),
                "DecodeStep.set_kv_quant: one scale entry per layer");
    for (size_t i = 0; i < nl; ++i) {
      Layer& L = layers_[i];
      TORCH_CHECK(L.cache.scalar_type() == want, "DecodeStep: layer ", i, " cache is ",
                  L.cache.scalar_type(), ", not ", kind);
      L.k_scale = static_cast<float>(k_scales[i]);
      L.v_scale = static_cast<float>(v_scales[i]);
      TORCH_CHECK(L.k_scale > 0.f && L.v_scale > 0.f, "DecodeStep: KV scales must be > 0");
      if (kv_kind_ == KVKind::kInt8) {
        const at::Tensor& sc = scales[i];
        TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 4 &&
                        sc.size(0) == 2 && sc.size(1) == L.cache.size(1) &&
                        sc.size(2) == L.cache.size(2) && sc.size(3) == kvh_,
                    "DecodeStep: int8 KV scales of layer ", i, " must be float32 "
                    "[2, NB, BS, KVH] like its cache");
        L.kv_scales = sc;
      }
    }
  }

  // Layer `layer`'s linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) adds LoRA deltas
  // from these slots: a [S, slices * R, K] and b [S, N, R] (LoRAWeights' live a and
  // b_all, read in place at every step), the slices' output sizes in order.
  void set_lora(int64_t layer, int64_t which, at::Tensor a, at::Tensor b,
                std::vector<int64_t> sizes) {
    TORCH_CHECK(layer >= 0 && layer < (int64_t)layers_.size() && which >= 0 && which < 4,
                "DecodeStep.set_lora: layer ", layer, " linear ", which);
    const int64_t ns = (int64_t)sizes.size();
    TORCH_CHECK(ns > 0 && a.dim() == 3 && b.dim() == 3 && a.is_contiguous() &&
                    b.is_contiguous() && a.size(0) == b.size(0) && a.size(1) % ns == 0 &&
                    b.size(2) == a.size(1) / ns && a.scalar_type() == b.scalar_type(),
                "DecodeStep.set_lora: a [S, slices * R, K] and b [S, N, R], contiguous, "
                "one dtype");
    TORCH_CHECK(lora_slots_ == 0 || lora_slots_ == a.size(0),
                "DecodeStep.set_lora: every layer has the same slots");
    LoraLinear lo;
    lo.rank = b.size(2);
    int64_t off = 0;
    for (int64_t n : sizes) {
      lo.offsets.push_back(off);
      off += n;
    }
    TORCH_CHECK(off == b.size(1), "DecodeStep.set_lora: slices of ", off, " columns, b has ",
                b.size(1));
    const Linear* lins[4] = {&layers_[layer].qkv, &layers_[layer].o, &layers_[layer].gate_up,
                             &layers_[layer].down};
    const int64_t n_out = lins[which]->out_features();
    TORCH_CHECK(n_out == 0 || n_out == off, "DecodeStep.set_lora: ", off,
                " LoRA columns for a linear of ", n_out);
    lo.sizes = std::move(sizes);
    lo.a = a;
    lo.b = b;
    layers_[layer].lora[which] = std::move(lo);
    lora_slots_ = a.size(0);
  }

  int64_t num_lora() const {
    int64_t c = 0;
    for (const Layer& L : layers_)
      for (const LoraLinear& lo : L.lora) c += lo.on();
    return c;
  }

  std::string kv_cache_kind() const {
    return kv_kind_ == KVKind::kInt8 ? "int8" : kv_kind_ == KVKind::kFp8 ? "fp8" : "model";
  }

 private:
  // A step's tree masks per token (empty: none); see forward().
  struct Mask {
    std::vector<int32_t> from;
    const int64_t* bits = nullptr;
    const int32_t* from_ptr() const { return from.empty() ? nullptr : from.data(); }
    // Whether token i may not see position p.
    bool hides(int64_t i, int64_t p) const {
      if (from.empty() || p < from[i] || p - from[i] >= 64) return false;
      return !((static_cast<uint64_t>(bits[i]) >> (p - from[i])) & 1);
    }
  };

  // A step's prompt rows and the other rows (see forward()); prompt undefined: none,
  // gen undefined: every row is a prompt row.
  struct PromptRows {
    at::Tensor prompt, gen;
  };

  // linear() with the step's prompt rows on the layer's own method where the layer
  // runs on int8 activations (forward's prompt_rows).
  static at::Tensor lin(const at::Tensor& x, const Linear& l, at::Tensor& buf,
                        const PromptRows& rows) {
    if (!rows.prompt.defined() || !l.kind4 || !l.int4() || l.dense())
      return linear(x, l, buf);
    if (!rows.gen.defined()) return l.fn(x).cast<at::Tensor>().contiguous();
    at::Tensor y = at::empty({x.size(0), l.out_features()}, x.options());
    at::Tensor part = buf.narrow(0, 0, rows.gen.numel());
    y.index_copy_(0, rows.gen, linear(x.index_select(0, rows.gen), l, part));
    y.index_copy_(0, rows.prompt, l.fn(x.index_select(0, rows.prompt)).cast<at::Tensor>());
    return y;
  }

  template <typename T>
  at::Tensor run(const at::Tensor& hidden_in, const int64_t* pos, const int64_t* slots,
                 const std::vector<int32_t>& tok_req, const std::vector<int32_t>& tok_ctx,
                 int32_t max_ctx, const at::Tensor& tables, const Mask& mask,
                 const PromptRows& rows, const std::vector<LoraGroup>& lora) {
    const int64_t t = hidden_in.size(0), e = hidden_in.size(1);
    const float eps = static_cast<float>(eps_);
    at::Tensor residual = hidden_in.clone();  // the residual stream [T, E]
    at::Tensor hidden;  // the last sublayer's output, not yet added
    auto normed = at::empty_like(residual);
    // Workspaces reused by every layer (sized by the first one: all layers are alike).
    const Layer& L0 = layers_[0];
    const auto opts = residual.options();
    const int64_t qkv_w = (h_ + 2 * kvh_) * d_;
    const int64_t inter2 = L0.gate_up.out_features();
    at::Tensor qkv_buf = at::empty({t, qkv_w}, opts), attn_buf = at::empty({t, h_ * d_}, opts);
    at::Tensor o_buf = at::empty({t, e}, opts), down_buf = at::empty({t, e}, opts);
    at::Tensor gu_buf = at::empty({t, inter2}, opts);
    at::Tensor act_buf;
    std::vector<int32_t> first(t);  // a windowed layer's first key per token
    for (size_t li = 0; li < layers_.size(); ++li) {
      Layer& L = layers_[li];
      T* res = residual.data_ptr<T>();
      if (li > 0) add_into<T>(hidden.data_ptr<T>(), res, t * e);
      norm_rows<T>(L.in_norm, res, normed.data_ptr<T>(), t, e, eps);
      at::Tensor qkv = lin(normed, L.qkv, qkv_buf, rows);  // [T, (H + 2 KVH) D]
      if (!lora.empty() && L.lora[0].on()) add_lora<T>(L.lora[0], normed, qkv, lora);
      if (L.q_norm.defined()) {  // per head, before rotary
        const int64_t width = qkv.size(1);
        T* q = qkv.data_ptr<T>();
        for (int64_t i = 0; i < t; ++i) {
          norm_rows<T>(L.q_norm, q + i * width, q + i * width, h_, d_, eps);
          norm_rows<T>(L.k_norm, q + i * width + h_ * d_, q + i * width + h_ * d_, kvh_, d_, eps);
        }
      }
      const int32_t* from = nullptr;
      if (L.window > 0) {  // a query at position p sees keys p - W + 1 .. p
        for (int64_t i = 0; i < t; ++i)
          first[i] = static_cast<int32_t>(std::max<int64_t>(0, tok_ctx[i] - L.window));
        from = first.data();
      }
      if (paged_kernel_reads(L.cache))
        attention_paged<T>(L, qkv, pos, slots, tok_req, tok_ctx, from, tables, mask, attn_buf);
      else
        attention<T>(L, qkv, pos, slots, tok_req, tok_ctx, from, max_ctx, tables, mask,
                     attn_buf);  // [T, H D]
      hidden = lin(attn_buf, L.o, o_buf, rows);  // [T, E]
      if (!lora.empty() && L.lora[1].on()) add_lora<T>(L.lora[1], attn_buf, hidden, lora);
      if (L.attn_out_norm.defined()) {  // Gemma: the output normed before its add
        norm_rows<T>(L.attn_out_norm, hidden.data_ptr<T>(), normed.data_ptr<T>(), t, e, eps);
        hidden = normed;
      }
      add_into<T>(hidden.data_ptr<T>(), res, t * e);
      norm_rows<T>(L.post_norm, res, normed.data_ptr<T>(), t, e, eps);
      at::Tensor gu = lin(normed, L.gate_up, gu_buf, rows);  // [T, 2 I]
      if (!lora.empty() && L.lora[2].on()) add_lora<T>(L.lora[2], normed, gu, lora);
      if (!act_buf.defined() || act_buf.size(1) != gu.size(1) / 2)
        act_buf = at::empty({t, gu.size(1) / 2}, opts);
      if (gelu_) gelu_tanh_mul<T>(gu, act_buf);
      else silu_mul<T>(gu, act_buf);
      hidden = lin(act_buf, L.down, down_buf, rows);  // [T, E]
      if (!lora.empty() && L.lora[3].on()) add_lora<T>(L.lora[3], act_buf, hidden, lora);
      if (L.mlp_out_norm.defined()) {  // added at the next layer's start (or below)
        norm_rows<T>(L.mlp_out_norm, hidden.data_ptr<T>(), normed.data_ptr<T>(), t, e, eps);
        hidden = normed;
      }
    }
    add_into<T>(hidden.data_ptr<T>(), residual.data_ptr<T>(), t * e);
    auto out = at::empty_like(residual);
    norm_rows<T>(final_norm_, residual.data_ptr<T>(), out.data_ptr<T>(), t, e, eps);
    return out;
  }

  // The model's RMSNorm of `rows` rows of width e (x == out is allowed): Llama's, or
  // Gemma's (1 + weight, float32 throughout) when gemma_.
  template <typename T>
  void norm_rows(const at::Tensor& w, const T* x, T* out, int64_t rows, int64_t e,
                 float eps) const {
    if (gemma_) gemma_norm_rows<T>(x, w.data_ptr<float>(), out, rows, e, eps);
    else rms_norm_rows<T>(x, w.data_ptr<T>(), out, rows, e, eps);
  }

  // [T, 2 I] = [gate | up] -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU, as
  // F.gelu(gate, approximate="tanh") * up: the GELU rounds to the model dtype first).
  // tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) by exp_nonpos, which
  // vectorizes (a libm tanh per value was ~0.3 s of a 600-token Gemma prefill).
  template <typename T>
  void gelu_tanh_mul(const at::Tensor& gu, at::Tensor& out) {
    const int64_t t = gu.size(0), i2 = gu.size(1), half = i2 / 2;
    const T* g = gu.data_ptr<T>();
    T* o = out.data_ptr<T>();
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
    for (int64_t r = 0; r < t; ++r)
      for (int64_t i = 0; i < half; ++i) {
        const float x = static_cast<float>(g[r * i2 + i]);
        const float inner = kBeta * (x + kKappa * (x * x * x));
        const float e = exp_nonpos(-2.f * std::fabs(inner));
        const float th = std::copysign((1.f - e) / (1.f + e), inner);
        T s = round_to<T>(0.5f * x * (1.f + th));
        o[r * half + i] = round_to<T>(static_cast<float>(s) *
                                      static_cast<float>(g[r * i2 + half + i]));
      }
  }

  // [T, 2 I] = [gate | up] -> silu(gate) * up [T, I]; silu rounds to the model dtype
  // before the product, as F.silu(gate) * up does.
  template <typename T>
  void silu_mul(const at::Tensor& gu, at::Tensor& out) {
    const int64_t t = gu.size(0), i2 = gu.size(1), half = i2 / 2;
    const T* g = gu.data_ptr<T>();
    T* o = out.data_ptr<T>();
    for (int64_t r = 0; r < t; ++r)
      for (int64_t i = 0; i < half; ++i) {
        float x = static_cast<float>(g[r * i2 + i]);
        T s = round_to<T>(x / (1.f + std::exp(-x)));
        o[r * half + i] = round_to<T>(static_cast<float>(s) *
                                      static_cast<float>(g[r * i2 + half + i]));
      }
  }

  // Rotary (rotate-half) of one head in place: x * (cos|cos) + roll(x, D/2) * (-sin|sin),
  // computed in float32 and rounded once, as the torch backend's apply_rotary.
  template <typename T>
  void rotate(T* x, const float* cs) const {
    const int64_t half = d_ / 2;
    const float* c = cs;
    const float* s = cs + half;
    float tmp[512];
    for (int64_t i = 0; i < half; ++i) {
      float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
      float lo = x1 * c[i];
      lo += x2 * -s[i];
      float hi = x2 * c[i];
      hi += x1 * s[i];
      tmp[i] = lo;
      tmp[i + half] = hi;
    }
    for (int64_t i = 0; i < d_; ++i) x[i] = round_to<T>(tmp[i]);
  }

  // Rotary on q and k (the layer's table), cache write of k and v at the token slots (-1
  // skips), then each token attends to its request's first tok_ctx positions through the
  // block table, from position first[i] on (first null: 0; the blocks before the one
  // holding it are not read), scores soft-capped where the layer says so.
  template <typename T>
  void attention(Layer& L, at::Tensor& qkv, const int64_t* pos, const int64_t* slots,
                 const std::vector<int32_t>& tok_req, const std::vector<int32_t>& tok_ctx,
                 const int32_t* first, int32_t max_ctx, const at::Tensor& tables,
                 const Mask& mask, at::Tensor& out) {
    const int64_t t = qkv.size(0), width = qkv.size(1), d = d_, h = h_, kvh = kvh_;
    TORCH_CHECK(width == (h + 2 * kvh) * d, "DecodeStep: qkv width");
    TORCH_CHECK(d <= 512, "DecodeStep: head_dim above 512");
    at::Tensor& cache = L.cache;
    const int64_t nb = cache.size(1), bs = cache.size(2), row = kvh * d;
    const int64_t max_slot = nb * bs;
    T* q_all = qkv.data_ptr<T>();
    T* kc = cache.data_ptr<T>();
    T* vc = kc + max_slot * row;
    const float* cs = L.cos_sin.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      T* tok = q_all + i * width;
      const float* csr = cs + pos[i] * d;
      for (int64_t hh = 0; hh < h + kvh; ++hh) rotate<T>(tok + hh * d, csr);
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      TORCH_CHECK(slot < max_slot, "DecodeStep: slot past the cache");
      std::copy(tok + h * d, tok + (h + kvh) * d, kc + slot * row);
      std::copy(tok + (h + kvh) * d, tok + (h + 2 * kvh) * d, vc + slot * row);
    }
    T* op = out.data_ptr<T>();
    const int32_t* tab = tables.data_ptr<int32_t>();
    const int64_t tw = tables.size(1), group = h / kvh;
    const float scale = L.scale, cap = L.softcap;
    constexpr float kInf = std::numeric_limits<float>::infinity();
    // (token, head) pairs split over threads once there is enough work per pair.
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, max_ctx * d));
    at::parallel_for(0, t * h, grain, [&](int64_t p0, int64_t p1) {
      std::vector<float> scores(max_ctx);
      float q[512], acc[512];
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t i = p / h, hh = p % h, g = hh / group;
        const int32_t ctx = tok_ctx[i];
        const int32_t from = first ? std::min(first[i], ctx) : 0;
        const int32_t blk0 = from / static_cast<int32_t>(bs);  // the first block read
        const int32_t lo = blk0 * static_cast<int32_t>(bs);
        const int32_t* trow = tab + static_cast<int64_t>(tok_req[i]) * tw;
        const T* qp = q_all + i * width + hh * d;
        for (int64_t j = 0; j < d; ++j) q[j] = static_cast<float>(qp[j]);
        // Scores block by block of the table (no division per position).
        float mx = -kInf;
        for (int64_t c0 = lo, blk = blk0; c0 < ctx; c0 += bs, ++blk) {
          const T* kb = kc + static_cast<int64_t>(trow[blk]) * bs * row + g * d;
          const int64_t n = std::min<int64_t>(bs, ctx - c0);
          for (int64_t o = 0; o < n; ++o) {
            if (c0 + o < from || mask.hides(i, c0 + o)) {  // weighs exactly 0, below
              scores[c0 + o] = -kInf;
              continue;
            }
            float s = dot_row(q, kb + o * row, d) * scale;
            if (cap > 0.f) s = std::tanh(s / cap) * cap;
            scores[c0 + o] = s;
            mx = std::max(mx, s);
          }
        }
        for (int32_t c = lo; c < ctx; ++c)
          scores[c] = c < from || mask.hides(i, c) ? 0.f : exp_nonpos(scores[c] - mx);
        float sum = 0.f;
        for (int32_t c = lo; c < ctx; ++c) sum += scores[c];
        for (int64_t j = 0; j < d; ++j) acc[j] = 0.f;
        for (int64_t c0 = lo, blk = blk0; c0 < ctx; c0 += bs, ++blk) {
          const T* vb = vc + static_cast<int64_t>(trow[blk]) * bs * row + g * d;
          const int64_t n = std::min<int64_t>(bs, ctx - c0);
          for (int64_t o = 0; o < n; ++o) {
            const T* vp = vb + o * row;
            const float w = scores[c0 + o];
            for (int64_t j = 0; j < d; ++j) acc[j] += w * static_cast<float>(vp[j]);
          }
        }
        const float inv = 1.f / sum;
        T* o = op + i * h * d + hh * d;
        for (int64_t j = 0; j < d; ++j) o[j] = round_to<T>(acc[j] * inv);
      }
    });
  }

  // Whether the shared paged kernel reads this cache: float32, int8 and fp8 ones with a
  // head dim that is a multiple of 8 (bf16/fp16 caches take attention() above).
  bool paged_kernel_reads(const at::Tensor& cache) const {
    const auto dt = cache.scalar_type();
    return d_ % 8 == 0 && (dt == at::kFloat || dt == at::kChar || dt == at::kFloat8_e4m3fn);
  }

  // attention() for a float32 / int8 / fp8 cache: rotary on q and k, the cache write
  // (quantizing as kv_quant.py does, so a cache written here holds the bytes the eager
  // write stores), then every token through paged_attention.h's kernel, one item per
  // token: its request's table row and its causal context length.
  template <typename T>
  void attention_paged(Layer& L, at::Tensor& qkv, const int64_t* pos, const int64_t* slots,
                       const std::vector<int32_t>& tok_req,
                       const std::vector<int32_t>& tok_ctx, const int32_t* first,
                       const at::Tensor& tables, const Mask& mask, at::Tensor& out) {
    const int64_t t = qkv.size(0), width = qkv.size(1), d = d_, h = h_, kvh = kvh_;
    TORCH_CHECK(width == (h + 2 * kvh) * d, "DecodeStep: qkv width");
    TORCH_CHECK(d <= 512, "DecodeStep: head_dim above 512");
    at::Tensor& cache = L.cache;
    const int64_t nb = cache.size(1), bs = cache.size(2), row = kvh * d;
    const int64_t max_slot = nb * bs;
    const KVKind kind = cache.scalar_type() == at::kChar ? KVKind::kInt8
                        : cache.scalar_type() == at::kFloat8_e4m3fn ? KVKind::kFp8
                                                                     : KVKind::kModel;
    T* q_all = qkv.data_ptr<T>();
    const float* cs = L.cos_sin.data_ptr<float>();
    uint8_t* raw = static_cast<uint8_t*>(cache.data_ptr());  // K at 0, V half-way
    const int64_t half_bytes = max_slot * row * static_cast<int64_t>(cache.element_size());
    float* sc = kind == KVKind::kInt8 ? L.kv_scales.data_ptr<float>() : nullptr;
    // As the eager write: times the reciprocal of the per-tensor scale, in float32.
    const float k_inv = static_cast<float>(1.0 / static_cast<double>(L.k_scale));
    const float v_inv = static_cast<float>(1.0 / static_cast<double>(L.v_scale));
    for (int64_t i = 0; i < t; ++i) {
      T* tok = q_all + i * width;
      const float* csr = cs + pos[i] * d;
      for (int64_t hh = 0; hh < h + kvh; ++hh) rotate<T>(tok + hh * d, csr);
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      TORCH_CHECK(slot < max_slot, "DecodeStep: slot past the cache");
      const T* k = tok + h * d;
      const T* v = tok + (h + kvh) * d;
      if (kind == KVKind::kInt8) {
        int8_t* kq = reinterpret_cast<int8_t*>(raw) + slot * row;
        quantize_int8_row<T>(k, kq, sc + slot * kvh, kvh, d);
        quantize_int8_row<T>(v, kq + max_slot * row, sc + (max_slot + slot) * kvh, kvh, d);
      } else if (kind == KVKind::kFp8) {
        quantize_fp8_row<T>(k, raw + slot * row, k_inv, row);
        quantize_fp8_row<T>(v, raw + half_bytes + slot * row, v_inv, row);
      } else {  // a float32 cache of a float32 model
        float* kc = reinterpret_cast<float*>(raw);
        for (int64_t j = 0; j < row; ++j) kc[slot * row + j] = static_cast<float>(k[j]);
        for (int64_t j = 0; j < row; ++j)
          kc[(max_slot + slot) * row + j] = static_cast<float>(v[j]);
      }
    }
    // The kernel takes float32 queries and writes float32 outputs: a float32 model's
    // rows are used in place (q rows `width` apart), others go through a float copy.
    const float* qf;
    float* of;
    int64_t q_stride;
    at::Tensor qbuf, obuf;
    if constexpr (std::is_same_v<T, float>) {
      qf = q_all;
      q_stride = width;
      of = out.data_ptr<float>();
    } else {
      qbuf = at::empty({t, h * d}, qkv.options().dtype(at::kFloat));
      obuf = at::empty({t, h * d}, qkv.options().dtype(at::kFloat));
      float* qb = qbuf.data_ptr<float>();
      for (int64_t i = 0; i < t; ++i)
        for (int64_t j = 0; j < h * d; ++j)
          qb[i * h * d + j] = static_cast<float>(q_all[i * width + j]);
      qf = qb;
      q_stride = h * d;
      of = obuf.data_ptr<float>();
    }
    const int32_t* tab = tables.data_ptr<int32_t>();
    const int64_t tw = tables.size(1);
    const float scale = L.scale;
    const int threads = at::get_num_threads();
    using kvflow::paged::dispatch;
    if (kind == KVKind::kInt8)
      dispatch(d, of, qf, q_stride, reinterpret_cast<const int8_t*>(raw), sc, tab,
               tok_req.data(), tok_ctx.data(), t, h, kvh, nb, bs, tw, scale, 1.f, 1.f, threads,
               mask.from_ptr(), mask.bits, first, L.softcap);
    else if (kind == KVKind::kFp8)
      dispatch(d, of, qf, q_stride, static_cast<const uint8_t*>(raw), nullptr, tab,
               tok_req.data(), tok_ctx.data(), t, h, kvh, nb, bs, tw, scale, L.k_scale,
               L.v_scale, threads, mask.from_ptr(), mask.bits, first, L.softcap);
    else
      dispatch(d, of, qf, q_stride, reinterpret_cast<const float*>(raw), nullptr, tab,
               tok_req.data(), tok_ctx.data(), t, h, kvh, nb, bs, tw, scale, 1.f, 1.f, threads,
               mask.from_ptr(), mask.bits, first, L.softcap);
    if constexpr (!std::is_same_v<T, float>) {
      T* op = out.data_ptr<T>();
      for (int64_t j = 0; j < t * h * d; ++j) op[j] = round_to<T>(of[j]);
    }
  }

  KVKind kv_kind_ = KVKind::kModel;
  int64_t lora_slots_ = 0;  // LoRA slots per adapted linear (set_lora; 0: none)
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  int64_t h_, kvh_, d_;
  double eps_;
  bool gemma_, gelu_;  // Gemma's norms; GeGLU (tanh GELU) instead of SiLU
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvflow's C++ CPU decode step (kvflow/cpu/step.py)";
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<py::object>,
                    std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                    at::Tensor, std::vector<at::Tensor>, int64_t, int64_t, int64_t,
                    double, std::vector<double>, std::vector<int64_t>, std::vector<double>,
                    std::vector<at::Tensor>, bool, std::string>())
      .def("forward", &DecodeStep::forward)
      .def("set_kv_quant", &DecodeStep::set_kv_quant)
      .def("set_lora", &DecodeStep::set_lora)
      .def_property_readonly("num_lora", &DecodeStep::num_lora)
      .def_property_readonly("kv_cache_kind", &DecodeStep::kv_cache_kind)
      .def_property_readonly("num_int4", &DecodeStep::num_int4)
      .def_property_readonly("num_layers", &DecodeStep::num_layers);
  m.def("int4_gemv", [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& sb,
                        int64_t group, bool doubled) {
    at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
    kvflow::int4_gemv(x, q, sb, group, doubled, y);
    return y;
  }, "cpu/int4.cpp's GEMV: x [M <= 16, K] float32 -> [M, N] float32 (for tests)");
  m.def("int4_gemv_simd", &kvflow::int4_gemv_simd);
  m.def("add_lora", [](const at::Tensor& x, at::Tensor y, const at::Tensor& a,
                       const at::Tensor& b, std::vector<int64_t> sizes,
                       const at::Tensor& token_slot, const at::Tensor& ranks) {
    LoraLinear lo;
    lo.a = a.contiguous();
    lo.b = b.contiguous();
    lo.rank = b.size(2);
    int64_t off = 0;
    for (int64_t n : sizes) {
      lo.offsets.push_back(off);
      off += n;
    }
    lo.sizes = sizes;
    std::vector<LoraGroup> groups;
    const int32_t* ts = token_slot.data_ptr<int32_t>();
    for (int64_t s = 0; s < a.size(0); ++s) {
      LoraGroup g{s, ranks.data_ptr<int32_t>()[s], {}};
      for (int64_t i = 0; i < token_slot.numel(); ++i)
        if (ts[i] == s) g.rows.push_back(i);
      if (!g.rows.empty()) groups.push_back(std::move(g));
    }
    at::Tensor xc = x.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_lora",
                                    [&] { add_lora<scalar_t>(lo, xc, y, groups); });
    return y;
  }, "the step's LoRA delta: y [T, N] += x [T, K]'s rows' deltas from slots a "
     "[S, slices * R, K], b [S, N, R] at each row's slot (token_slot [T] int32, -1: none; "
     "ranks [S] int32), in place (for tests)");
  m.def("linear_f32", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                    x.size(0) <= kvflow::kMaxGemvRows && x.scalar_type() == at::kFloat &&
                    w.scalar_type() == at::kFloat && (b.numel() == 0 || b.numel() == w.size(0)),
                "linear_f32: x [M <= 16, K], w [N, K] float32, bias [N] or empty");
    at::Tensor xc = x.contiguous(), wc = w.contiguous();
    at::Tensor bc = b.numel() ? b.to(at::kFloat).contiguous() : b;
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    linear_rows_f32(xc.data_ptr<float>(), x.size(0), x.size(1), wc.data_ptr<float>(),
                    b.numel() ? bc.data_ptr<float>() : nullptr, w.size(0),
                    y.data_ptr<float>(), w.size(0));
    return y;
  }, "the step's float32 GEMV: x [M <= 16, K] W^T (+ b) in one pass over W, each row as "
     "a one-row call (a dense float32 lm_head's logits)");
  m.def("quant_gemv", [](const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                         int64_t group, bool doubled, int64_t kind) {
    at::Tensor y = at::empty({x.size(0), a.size(0)}, x.options());
    kvflow::quant_gemv(x, a, b, group, doubled, kind, y);
    return y;
  }, "a handed-over layer's GEMV: x [M <= 16, K] float32 -> [M, N] float32; kind 0: "
     "int4_gemv's layout, 4 / 8: q8_gemv's (int8 activations)");
  m.def("q8_gemv", [](const at::Tensor& x, const at::Tensor& w, int64_t bits, bool simd) {
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    kvflow::q8_gemv(x, w, bits, simd, y);
    return y;
  }, "cpu/int4.cpp's int8-activation GEMV; simd False: the plain loops (for tests)");
  m.def("q8_gemv_simd", &kvflow::q8_gemv_simd);
  m.def("q8_gemv_isa", &kvflow::q8_gemv_isa, "the SIMD kernel q8_gemv runs: 'AVX512-VNNI', "
        "'AVX2', or '' (plain loops)");
  m.def("q8_arena", &kvflow::q8_arena, "uint8 [bytes] in 2 MiB pages (madvise)");
  m.def("q8_refine_top", [](const at::Tensor& x, const at::Tensor& w, int64_t bits,
                            at::Tensor y, int64_t top) { kvflow::q8_refine_top(x, w, bits, y, top); },
        "recompute the `top` largest logits per row of y in float32, in place");
}
