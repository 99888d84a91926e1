// pdserve's CPU kernels for AVX2/FMA, float32 and bfloat16 (engine/native.py loads them as torch ops):
//   linear            y = residual + (x W^T + bias), for the few rows of a decode step (bfloat16
//                     weights widened in L1, summed in float32);
//   rms_norm          the model's RMSNorm in one pass over each row;
//   decode_attention  one query token per sequence against its K/V read in place from the paged
//                     cache (no gather), grouped-query heads, softmax in float32.
//
// linear:
// W is the weight as torch stores it ([N, K], row-major). Each output is a dot product of one
// weight row with one input row: the weight rows stream from memory once per call, four at a time,
// and every input row (two at a time) is read from L1 against them, so at the few rows of a decode
// step the kernel runs at the memory's read rate instead of MKL's GEMV rate (see
// benchmarks/gemv_layout.py). Threads split the weight rows (at::parallel_for), never K, so an
// output's arithmetic is the same at any thread count and any batch size: row m of a batch gets
// the bits it would get alone (tests/engine/test_native.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for eight floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial in r,
// times 2^n; within about 1 ulp of std::exp over the range softmax uses, x <= 0). Below
// ln(FLT_MIN) the result is 0, as the float it stands for is subnormal. A pure function of x, so a
// score's probability is the same whatever the batch, the blocking or the thread count.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// In place: row[0..len) = softmax(row), the max and the sum taken eight lanes at a time.
inline void softmax_row(float* row, int64_t len) {
  int64_t i = 0;
  float mx = row[0];
  if (len >= 8) {
    __m256 m = _mm256_loadu_ps(row);
    for (i = 8; i + 8 <= len; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    mx = *std::max_element(lanes, lanes + 8);
  }
  for (int64_t t = i; t < len; ++t) mx = std::max(mx, row[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  alignas(32) float tail[8];
  for (i = 0; i + 8 <= len; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmx));
    _mm256_storeu_ps(row + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (i < len) {  // the tail through the same exp, padded lanes contributing 0
    for (int64_t t = 0; t < 8; ++t) tail[t] = i + t < len ? row[i + t] - mx : -INFINITY;
    const __m256 e = exp8(_mm256_load_ps(tail));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_store_ps(tail, e);
    for (int64_t t = 0; i + t < len; ++t) row[i + t] = tail[t];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(vsum));
  for (i = 0; i + 8 <= len; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), inv));
  const float finv = _mm256_cvtss_f32(inv);
  for (; i < len; ++i) row[i] *= finv;
}

// Runs fn(i) for i in [0, n) across torch's threads, each thread taking the next unclaimed index
// (an atomic counter) instead of a fixed share: tasks of uneven cost even out, and a thread that
// the OS preempts holds back only the task it is on while the others take the rest. (The parallel
// region still ends when every thread has arrived; one that was never scheduled meanwhile finds no
// task left and leaves at once.) Which thread runs a task never changes its arithmetic.
template <typename F>
void share_tasks(int64_t n, const F& fn, int64_t per_claim = 1) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + per_claim - 1) / per_claim);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (;;) {
      const int64_t start = next.fetch_add(per_claim, std::memory_order_relaxed);
      if (start >= n) break;
      const int64_t stop = std::min(n, start + per_claim);
      for (int64_t i = start; i < stop; ++i) fn(i);
    }
  });
}

// sums[m * R + r] = dot(w row r, x row m) for R weight rows and MG input rows.
template <int R, int MG>
inline void dots(const float* x, int64_t ldx, const float* w, int64_t K, float* sums) {
  __m256 acc[R][MG];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int m = 0; m < MG; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MG];
#pragma GCC unroll 2
    for (int m = 0; m < MG; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * K + k);
#pragma GCC unroll 2
      for (int m = 0; m < MG; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int m = 0; m < MG; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += w[r * K + kk] * x[m * ldx + kk];
      sums[m * R + r] = s;
    }
}

// The model's element type T (float or c10::BFloat16) as floats: bf16 is the top half of a float.
inline void to_float(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Outputs R weight rows x M input rows, as torch computes them in T: the dot (+ bias) rounded to T,
// then (+ residual) rounded to T (in float32 no rounding happens).
template <typename T, int R>
inline void rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, int64_t n0, int64_t N,
                 const T* bias, const T* res, int64_t ldr, T* y) {
  float sums[2 * R];
  for (int64_t m0 = 0; m0 < M; m0 += 2) {
    const int mg = M - m0 >= 2 ? 2 : 1;
    if (mg == 2) dots<R, 2>(x + m0 * ldx, ldx, w, K, sums);
    else dots<R, 1>(x + m0 * ldx, ldx, w, K, sums);
    for (int m = 0; m < mg; ++m)
      for (int r = 0; r < R; ++r) {
        float v = sums[m * R + r];
        if (bias) v = v + static_cast<float>(bias[n0 + r]);
        T out = static_cast<T>(v);
        if (res) out = static_cast<T>(static_cast<float>(res[(m0 + m) * ldr + n0 + r]) + static_cast<float>(out));
        y[(m0 + m) * N + n0 + r] = out;
      }
  }
}

// float32 weights are read in place; bfloat16 ones are widened four rows at a time into a buffer
// that stays in L1 while every input row is multiplied by it, so memory is read at half the bytes.
template <typename T>
void linear_rows(const float* X, int64_t ldx, int64_t M, const T* W, int64_t K, int64_t N, const T* b,
                 const T* r, int64_t ldr, T* Y) {
  const int64_t blocks = (N + 3) / 4;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<T, float> ? 0 : 4 * K);
    auto rows_of = [&](int64_t n, int64_t count) -> const float* {
      if constexpr (std::is_same_v<T, float>) {
        return W + n * K;
      } else {
        to_float(W + n * K, widened.data(), count * K);
        return widened.data();
      }
    };
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 4;
      if (n0 + 4 <= N) {
        rows<T, 4>(X, ldx, M, rows_of(n0, 4), K, n0, N, b, r, ldr, Y);
      } else {
        for (int64_t n = n0; n < N; ++n) rows<T, 1>(X, ldx, M, rows_of(n, 1), K, n, N, b, r, ldr, Y);
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "pdserve_native::linear: x [M, K] and weight [N, K] expected");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "pdserve_native::linear: float32 or bfloat16 only, x and weight alike");
  TORCH_CHECK(weight.is_contiguous(), "pdserve_native::linear: the weight must be row-major");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == dtype,
                "pdserve_native::linear: bias [N] of the weight's dtype expected");
  at::Tensor rc;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                    residual->scalar_type() == dtype,
                "pdserve_native::linear: residual [M, N] of the weight's dtype expected");
    rc = residual->stride(1) == 1 ? *residual : residual->contiguous();
  }
  // the input rows as float32 (bf16 widened once per call; float32 read in place)
  const at::Tensor xf = dtype == at::kFloat ? (x.stride(1) == 1 ? x : x.contiguous()) : x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, weight.options());
  if (dtype == at::kFloat) {
    linear_rows<float>(xf.data_ptr<float>(), xf.stride(0), M, weight.data_ptr<float>(), K, N,
                       bias.has_value() ? bias->data_ptr<float>() : nullptr,
                       rc.defined() ? rc.data_ptr<float>() : nullptr, rc.defined() ? rc.stride(0) : 0,
                       y.data_ptr<float>());
  } else {
    using B = c10::BFloat16;
    linear_rows<B>(xf.data_ptr<float>(), xf.stride(0), M, weight.data_ptr<B>(), K, N,
                   bias.has_value() ? bias->data_ptr<B>() : nullptr, rc.defined() ? rc.data_ptr<B>() : nullptr,
                   rc.defined() ? rc.stride(0) : 0, y.data_ptr<B>());
  }
  return y;
}

// One dot product, summed as the linear's are (eight lanes, then across them).
inline float dot(const float* a, const float* b, int64_t n) {
  float s;
  dots<1, 1>(a, n, b, n, &s);
  return s;
}

// y = weight * T(x / sqrt(mean(x^2) + eps)) per row of x [M, K] (rows contiguous, any row stride),
// in float32 and rounded where transformers' RMSNorm rounds (T: float32 or bfloat16); only the sum
// of squares is summed in another order than torch's reduction (eight lanes, then across them).
template <typename T>
void rms_norm_rows(const T* X, int64_t ldx, const T* W, int64_t M, int64_t K, float eps, T* Y) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K), w(K);
    to_float(W, w.data(), K);
    for (int64_t m = begin; m < end; ++m) {
      to_float(X + m * ldx, row.data(), K);
      const float inv = 1.0f / std::sqrt(dot(row.data(), row.data(), K) / static_cast<float>(K) + eps);
      T* out = Y + m * K;
      for (int64_t k = 0; k < K; ++k) out[k] = static_cast<T>(w[k] * static_cast<float>(static_cast<T>(row[k] * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "pdserve_native::rms_norm: x [M, K] float32 or bfloat16 with contiguous rows expected");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == dtype,
              "pdserve_native::rms_norm: weight [K] of x's dtype expected");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, K}, x.options());
  if (dtype == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), M, K, eps, y.data_ptr<float>());
  } else {
    using B = c10::BFloat16;
    rms_norm_rows<B>(x.data_ptr<B>(), x.stride(0), weight.data_ptr<B>(), M, K, eps, y.data_ptr<B>());
  }
  return y;
}

// query [B, Hq, D]; key_cache / value_cache [num_blocks, block_size, Hkv, D] (one layer, as the
// paged cache holds it); block_tables [B, max_blocks] int64; context_lens [B] int64 -> [B, Hq, D].
// Query head h reads kv head h / (Hq / Hkv). Scores, softmax and the weighted sum of values in
// float32 over the sequence's own context_lens[b] positions, each key and value read (and bf16
// widened, once per task) where it lies in its block; the output is rounded to the query's dtype.
//
// One task is one (sequence, kv head): its G query heads read each key and value once from memory.
// Each score is one dot product summed as `dot` sums it (eight lanes, then across them), eight
// positions at a time so that eight independent FMA chains fill the pipeline; each output element
// sums its values' products in position order, several 8-lane groups of the head at a time. So the
// bits do not depend on the blocking, the batch or the thread count.

// scores[p] = dot(q, k[p]) * sc for P positions (rows k[0..P-1], D floats each).
template <int P>
inline void score_block(const float* q, const float* const* k, int64_t D, float sc, float* scores) {
  __m256 acc[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) acc[p] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[p] = _mm256_fmadd_ps(_mm256_loadu_ps(k[p] + d), qv, acc[p]);
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    float v = hsum(acc[p]);
    for (int64_t dd = d; dd < D; ++dd) v += k[p][dd] * q[dd];
    scores[p] = v * sc;
  }
}

// out[0 .. 8 NV) = sum over positions s (in order) of probs[s] * v[s][0 .. 8 NV).
template <int NV>
inline void value_block(const float* probs, const float* const* v, int64_t len, int64_t d0, float* out) {
  __m256 acc[NV];
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < len; ++s) {
    const __m256 pv = _mm256_set1_ps(probs[s]);
    const float* row = v[s] + d0;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row + 8 * j), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + d0 + 8 * j, acc[j]);
}

template <typename T, typename C>
void decode_attention_tasks(const T* Q, const C* Kc, const C* Vc, const int64_t* tables, const int64_t* lens,
                            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, float sc,
                            T* O) {
  const int64_t G = Hq / Hkv, HD = Hkv * D;
  // One task is one sequence, all its kv heads: a position's keys (and values) of every head lie
  // together in its block, so each block is read once, front to back. Tasks are taken one at a
  // time (share_tasks): a thread that is preempted holds back only the sequence it is on.
  share_tasks(B, [&](int64_t b) {
    thread_local std::vector<float> scores, q, acc, widened;
    thread_local std::vector<const float*> keys, values;
    const int64_t len = lens[b];
    const int64_t* table = tables + b * max_blocks;
    scores.resize(static_cast<size_t>(G * len));
    keys.resize(static_cast<size_t>(len));
    values.resize(static_cast<size_t>(len));
    q.resize(static_cast<size_t>(Hq * D));
    acc.resize(static_cast<size_t>(G * D));
    to_float(Q + b * Hq * D, q.data(), Hq * D);
    if constexpr (!std::is_same_v<C, float>) {
      widened.resize(static_cast<size_t>(2 * len * HD));
      for (int64_t s = 0; s < len; ++s) {
        const int64_t at = (table[s / bs] * bs + s % bs) * HD;
        to_float(Kc + at, widened.data() + s * HD, HD);
        to_float(Vc + at, widened.data() + (len + s) * HD, HD);
      }
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t s = 0; s < len; ++s) {
        if constexpr (std::is_same_v<C, float>) {
          const int64_t at = (table[s / bs] * bs + s % bs) * HD + h * D;
          keys[s] = Kc + at;
          values[s] = Vc + at;
        } else {
          keys[s] = widened.data() + s * HD + h * D;
          values[s] = widened.data() + (len + s) * HD + h * D;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q.data() + (h * G + g) * D;
        float* row = scores.data() + g * len;
        int64_t s = 0;
        for (; s + 8 <= len; s += 8) score_block<8>(qg, keys.data() + s, D, sc, row + s);
        for (; s < len; ++s) score_block<1>(qg, keys.data() + s, D, sc, row + s);
        softmax_row(row, len);
        float* o = acc.data() + g * D;
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) value_block<8>(row, values.data(), len, d, o);
        for (; d + 32 <= D; d += 32) value_block<4>(row, values.data(), len, d, o);
        for (; d + 8 <= D; d += 8) value_block<1>(row, values.data(), len, d, o);
        for (; d < D; ++d) {
          float x = 0.0f;
          for (int64_t i = 0; i < len; ++i) x += row[i] * values[i][d];
          o[d] = x;
        }
      }
      T* out = O + (b * Hq + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i]);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const auto qt = query.scalar_type(), ct = key_cache.scalar_type();
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && (qt == at::kFloat || qt == at::kBFloat16),
              "pdserve_native::decode_attention: query [B, Hq, D] contiguous float32 or bfloat16 expected");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && value_cache.scalar_type() == ct &&
                  (ct == at::kFloat || ct == at::kBFloat16),
              "pdserve_native::decode_attention: K/V caches [blocks, block_size, Hkv, D] contiguous float32 or "
              "bfloat16 expected");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong &&
                  block_tables.size(0) == query.size(0) && context_lens.size(0) == query.size(0),
              "pdserve_native::decode_attention: block_tables [B, max_blocks] and context_lens [B] int64 expected");
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && Hq % Hkv == 0, "pdserve_native::decode_attention: head shapes disagree");
  const int64_t max_blocks = block_tables.size(1);
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t* T = tables.data_ptr<int64_t>();
  const int64_t* L = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(L[b] >= 1 && L[b] <= max_blocks * bs, "pdserve_native::decode_attention: context length ", L[b],
                " outside 1..", max_blocks * bs);
    for (int64_t i = 0; i < (L[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(T[b * max_blocks + i] >= 0 && T[b * max_blocks + i] < num_blocks,
                  "pdserve_native::decode_attention: block id out of range");
  }
  at::Tensor out = at::empty({B, Hq, D}, query.options());
  const float sc = static_cast<float>(scale);
  using BF = c10::BFloat16;
  if (qt == at::kFloat && ct == at::kFloat) {
    decode_attention_tasks<float, float>(query.data_ptr<float>(), key_cache.data_ptr<float>(),
                                         value_cache.data_ptr<float>(), T, L, B, Hq, Hkv, D, bs, max_blocks, sc,
                                         out.data_ptr<float>());
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    decode_attention_tasks<BF, BF>(query.data_ptr<BF>(), key_cache.data_ptr<BF>(), value_cache.data_ptr<BF>(), T, L,
                                   B, Hq, Hkv, D, bs, max_blocks, sc, out.data_ptr<BF>());
  } else if (qt == at::kFloat && ct == at::kBFloat16) {
    decode_attention_tasks<float, BF>(query.data_ptr<float>(), key_cache.data_ptr<BF>(), value_cache.data_ptr<BF>(),
                                      T, L, B, Hq, Hkv, D, bs, max_blocks, sc, out.data_ptr<float>());
  } else {
    TORCH_CHECK(false, "pdserve_native::decode_attention: a bfloat16 query needs a bfloat16 cache");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_native, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_native, CPU, m) {
  m.impl("linear", &linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
}
