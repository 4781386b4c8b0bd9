// Weight-only int8 linear for CPU (--quantization int8): y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n].
//
// Decode multiplies a few rows by every weight once a step, so it is bound by reading the weights: int8 reads
// a quarter of float32's bytes. The weight is blocked at load as [n / 16, k, 16]: at each k the 16 output
// channels of a block are one 16-byte load, widened to a float vector, and each row's x[m, k] is broadcast
// into it, so a row's 16 outputs accumulate in one register (no horizontal sums) and every block is one
// sequential stream. Tiles of up to 4 rows x 4 blocks (16 accumulators) reuse each widened weight vector
// for every row: one weight tile stays in cache while all rows pass, so prefill's many rows run at the FMA
// peak too (169-187 GFLOP/s measured from 32 to 2,048 rows, as MKL's float32 GEMM). Activations stay
// float32 (torch's _weight_int8pack_mm rounds them to bfloat16).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr int kLanes = 16;
constexpr int kTile = 4;           // rows and blocks per tile
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

// R rows of x (row stride ldx) times G consecutive weight blocks of [k, 16]; y's rows have stride ldy.
template <int R, int G>
void tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, const float* scale, float* y, int64_t ldy) {
  vec acc[R][G] = {};
  for (int64_t i = 0; i < k; ++i) {
    vec wv[G];
    for (int g = 0; g < G; ++g) {
      if ((i & 3) == 0) __builtin_prefetch(w + (g * k + i) * kLanes + 1024);  // a line per 4 steps, 1 KiB on
      wv[g] = widen(w + (g * k + i) * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const vec xb = vec{} + x[r * ldx + i];
      for (int g = 0; g < G; ++g) acc[r][g] += wv[g] * xb;
    }
  }
  for (int g = 0; g < G; ++g) {
    vec s;
    std::memcpy(&s, scale + g * kLanes, sizeof s);
    for (int r = 0; r < R; ++r) {
      const vec out = acc[r][g] * s;
      std::memcpy(y + r * ldy + g * kLanes, &out, sizeof out);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, float*, int64_t);

template <int R>
constexpr TileFn tiles_for_rows(int g) {
  return g == 1 ? tile<R, 1> : g == 2 ? tile<R, 2> : g == 3 ? tile<R, 3> : tile<R, 4>;
}

TileFn tile_fn(int r, int g) {
  return r == 1 ? tiles_for_rows<1>(g) : r == 2 ? tiles_for_rows<2>(g) : r == 3 ? tiles_for_rows<3>(g)
                                                                                   : tiles_for_rows<4>(g);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && qweight.size(2) == kLanes, "x [M, K], qweight [N/16, K, 16]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "int8 weight, float scales");
  TORCH_CHECK(x.size(1) == qweight.size(1), "x has ", x.size(1), " features, the weight ", qweight.size(1));
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.numel() == qweight.size(0) * kLanes,
              "contiguous blocked weight and padded scales");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), nb = qweight.size(0), n = nb * kLanes;
  at::Tensor y = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += kTile) {
      const int g = static_cast<int>(std::min<int64_t>(kTile, b1 - b));
      for (int64_t r = 0; r < m; r += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, m - r));
        tile_fn(rows, g)(xp + r * k, k, wp + b * k * kLanes, k, sp + b * kLanes, yp + r * n + b * kLanes, n);
      }
    }
  });
  if (n != out_features) y = y.narrow(1, 0, out_features).contiguous();
  if (bias) y.add_(*bias);
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragserve, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragserve, CPU, m) { m.impl("int8_linear", &int8_linear); }
