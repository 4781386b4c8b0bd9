// Weight-only quantized linears for CPU: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n], the weight in 8 or 4 bits.
//
// Decode multiplies a few rows by every weight once a step, so it is bound by reading the weights. Both
// weights are blocked at load by 64 output channels: at each k the block's 64 weights are one cache line
// (int8) or half of one (int4), widened to four float vectors, and each row's x[m, k] is broadcast into
// them, so a row's 64 outputs accumulate in four registers (no horizontal sums) and each thread reads one
// sequential stream. Tiles of up to 4 rows (16 accumulators) reuse each widened line for every row: one
// block stays in cache while all rows pass, so prefill's many rows run at the FMA peak too (int8:
// 169-187 GFLOP/s measured from 32 to 2,048 rows, as MKL's float32 GEMM). Activations stay float32
// (torch's _weight_int8pack_mm rounds them to bfloat16).
//
// int8 (--quantization int8): w = scale[n] * q, q in -127..127; weight [n / 64, k, 64].
// int8 in groups (int4's LM head, llama.cpp's Q8_0 scheme): w = d * q with a float16 d per 32 input features
// of a channel; weight as int8, d [n / 64, k / 32, 64] as int4's.
// int4 (--quantization int4), llama.cpp's Q4_1 scheme: along the input features, groups of 32 weights of
// one output channel share a scale d and a minimum m (float16), w = d * q + m with q in 0..15. So
// y[r, n] = sum_g (d[g, n] * sum_{k in g} q[n, k] x[r, k] + m[g, n] * sum_{k in g} x[r, k]). Weight
// [n / 64, k, 32] bytes, byte j of a row holding channel j in its low nibble and channel j + 32 in its high
// one; d and m [n / 64, k / 32, 64]. A tile accumulates a group's q * x per row, then folds it in with d
// and the group's sum of x (computed once per call).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr int kLanes = 16;
constexpr int kVecs = 4;                // vectors per block
constexpr int kBlock = kVecs * kLanes;  // output channels per block
constexpr int kRows = 4;                // rows per tile
constexpr int kGroup = 32;              // int4: input features per scale and minimum
constexpr int64_t kPrefetch = 1024;     // bytes ahead in a block's stream (16 lines)
using vec = float __attribute__((vector_size(64)));

// 16 int8 -> 16 floats (GCC's generic vector conversion of this is scalar code).
inline vec widen(const int8_t* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  __m256 half[2];
  for (int h = 0; h < 2; ++h)
    half[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
  vec v;
  std::memcpy(&v, half, sizeof v);
  return v;
#else
  vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

// R rows of x (row stride ldx) times one weight block [k, 64]; y's rows have stride ldy.
template <int R>
void tile_int8(const float* x, int64_t ldx, const int8_t* w, int64_t k, const float* scale, float* y, int64_t ldy) {
  vec acc[R][kVecs] = {};
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* line = w + i * kBlock;
    __builtin_prefetch(line + kPrefetch);
    vec wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = widen(line + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const vec xb = vec{} + x[r * ldx + i];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += wv[v] * xb;
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    vec s;
    std::memcpy(&s, scale + v * kLanes, sizeof s);
    for (int r = 0; r < R; ++r) {
      const vec out = acc[r][v] * s;
      std::memcpy(y + r * ldy + v * kLanes, &out, sizeof out);
    }
  }
}

// The 64 weights of one k (32 bytes) as four vectors: low nibbles of bytes 0-15, 16-31, then high nibbles.
inline void unpack(const uint8_t* p, vec* w) {
#if defined(__AVX512F__)
  const __m512i mask = _mm512_set1_epi32(15);
  for (int h = 0; h < 2; ++h) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h * kLanes)));
    w[h] = (vec)_mm512_cvtepi32_ps(_mm512_and_si512(b, mask));
    w[h + 2] = (vec)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
#else
  for (int i = 0; i < 2 * kLanes; ++i) {
    w[i / kLanes][i % kLanes] = p[i] & 15;
    w[2 + i / kLanes][i % kLanes] = p[i] >> 4;
  }
#endif
}

inline vec halves(const c10::Half* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// R rows of x (stride ldx; xsum: their per-group sums, stride ldg) times one block: weights [k, 32] bytes
// (int4) or [k, 64] int8 (kInt4 false: no minimums, xsum unused), d and m [groups, 64]; y's rows have stride ldy.
template <int R, bool kInt4>
void tile_grouped(const float* x, int64_t ldx, const float* xsum, int64_t ldg, const uint8_t* w, int64_t k,
                  const c10::Half* d, const c10::Half* m, float* y, int64_t ldy) {
  constexpr int64_t kLine = kInt4 ? kBlock / 2 : kBlock;  // bytes per input feature
  vec acc[R][kVecs] = {};
  for (int64_t g0 = 0, g = 0; g0 < k; g0 += kGroup, ++g) {
    vec part[R][kVecs] = {};
    for (int64_t i = g0; i < std::min<int64_t>(g0 + kGroup, k); ++i) {
      const uint8_t* line = w + i * kLine;
      if (!kInt4 || (i & 1) == 0) __builtin_prefetch(line + kPrefetch);
      vec wv[kVecs];
      if constexpr (kInt4) {
        unpack(line, wv);
      } else {
        for (int v = 0; v < kVecs; ++v) wv[v] = widen(reinterpret_cast<const int8_t*>(line) + v * kLanes);
      }
      for (int r = 0; r < R; ++r) {
        const vec xb = vec{} + x[r * ldx + i];
        for (int v = 0; v < kVecs; ++v) part[r][v] += wv[v] * xb;
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      const vec dv = halves(d + g * kBlock + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v] += dv * part[r][v];
      if constexpr (kInt4) {
        const vec mv = halves(m + g * kBlock + v * kLanes);
        for (int r = 0; r < R; ++r) acc[r][v] += mv * xsum[r * ldg + g];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) std::memcpy(y + r * ldy + v * kLanes, &acc[r][v], sizeof(vec));
}

using Int8Tile = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, float*, int64_t);
constexpr Int8Tile kInt8Tiles[kRows] = {tile_int8<1>, tile_int8<2>, tile_int8<3>, tile_int8<4>};
using GroupTile = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, const c10::Half*,
                           const c10::Half*, float*, int64_t);
constexpr GroupTile kInt4Tiles[kRows] = {tile_grouped<1, true>, tile_grouped<2, true>, tile_grouped<3, true>,
                                         tile_grouped<4, true>};
constexpr GroupTile kInt8GroupTiles[kRows] = {tile_grouped<1, false>, tile_grouped<2, false>,
                                              tile_grouped<3, false>, tile_grouped<4, false>};

// y [m, nb * 64] (float32): tile(b, r, rows, y at row r and block b, ldy) for every block b and every tile of
// up to 4 rows from r; then the padding channels dropped, the bias added, the result in dtype.
template <typename Tile>
at::Tensor blocked_linear(const at::Tensor& xf, int64_t nb, int64_t out_features,
                          const std::optional<at::Tensor>& bias, at::ScalarType dtype, const Tile& tile) {
  const int64_t m = xf.size(0), n = nb * kBlock;
  at::Tensor y = at::empty({m, n}, xf.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < m; r += kRows) tile(b, r, std::min<int64_t>(kRows, m - r), yp + r * n + b * kBlock, n);
  });
  if (n != out_features) y = y.narrow(1, 0, out_features).contiguous();
  if (bias) y.add_(*bias);
  return y.to(dtype);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && qweight.size(2) == kBlock, "x [M, K], qweight [N/64, K, 64]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "int8 weight, float scales");
  TORCH_CHECK(x.size(1) == qweight.size(1), "x has ", x.size(1), " features, the weight ", qweight.size(1));
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.numel() == qweight.size(0) * kBlock,
              "contiguous blocked weight and padded scales");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t k = xf.size(1);
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return blocked_linear(xf, qweight.size(0), out_features, bias, x.scalar_type(),
                        [&](int64_t b, int64_t r, int64_t rows, float* y, int64_t ldy) {
                          kInt8Tiles[rows - 1](xp + r * k, k, wp + b * k * kBlock, k, sp + b * kBlock, y, ldy);
                        });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && qweight.size(2) == kBlock / 2, "qweight [N/64, K, 32]");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf &&
                  mins.scalar_type() == at::kHalf, "uint8 weight, float16 scales and mins");
  const int64_t m = x.size(0), k = x.size(1), nb = qweight.size(0);
  const int64_t groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(qweight.size(1) == k, "x has ", k, " features, the weight ", qweight.size(1));
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && mins.is_contiguous() &&
                  scales.numel() == nb * groups * kBlock && mins.numel() == scales.numel(),
              "contiguous blocked weight, scales and mins [N/64, K/32, 64]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor xsum = at::empty({m, groups}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* sp = xsum.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * kGroup; i < std::min<int64_t>((g + 1) * kGroup, k); ++i) s += xp[r * k + i];
      sp[r * groups + g] = s;
    }
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const c10::Half* dp = scales.data_ptr<c10::Half>();
  const c10::Half* mp = mins.data_ptr<c10::Half>();
  return blocked_linear(xf, nb, out_features, bias, x.scalar_type(),
                        [&](int64_t b, int64_t r, int64_t rows, float* y, int64_t ldy) {
                          kInt4Tiles[rows - 1](xp + r * k, k, sp + r * groups, groups, wp + b * k * (kBlock / 2), k,
                                               dp + b * groups * kBlock, mp + b * groups * kBlock, y, ldy);
                        });
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && qweight.size(2) == kBlock, "x [M, K], qweight [N/64, K, 64]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf, "int8 weight, float16 scales");
  const int64_t k = x.size(1), nb = qweight.size(0), groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(qweight.size(1) == k, "x has ", k, " features, the weight ", qweight.size(1));
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.numel() == nb * groups * kBlock,
              "contiguous blocked weight and scales [N/64, K/32, 64]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>());
  const c10::Half* dp = scales.data_ptr<c10::Half>();
  return blocked_linear(xf, nb, out_features, bias, x.scalar_type(),
                        [&](int64_t b, int64_t r, int64_t rows, float* y, int64_t ldy) {
                          kInt8GroupTiles[rows - 1](xp + r * k, k, nullptr, 0, wp + b * k * kBlock, k,
                                                    dp + b * groups * kBlock, nullptr, y, ldy);
                        });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragserve, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_group_linear", &int8_group_linear);
}
