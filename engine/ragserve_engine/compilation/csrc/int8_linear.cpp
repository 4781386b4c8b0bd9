// Weight-only int8 linear for CPU (--quantization int8): y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n].
//
// Decode multiplies a few rows by every weight once a step, so it is bound by reading the weights: int8 reads
// a quarter of float32's bytes. The weight is blocked at load as [n / 64, k, 64]: at each k the 64 output
// channels of a block are one cache line, widened to four float vectors, and each row's x[m, k] is broadcast
// into them, so a row's 64 outputs accumulate in four registers (no horizontal sums) and each thread reads
// one sequential stream. Tiles of up to 4 rows (16 accumulators) reuse each widened weight line for every
// row: one block stays in cache while all rows pass, so prefill's many rows run at the FMA peak too
// (169-187 GFLOP/s measured from 32 to 2,048 rows, as MKL's float32 GEMM). Activations stay float32
// (torch's _weight_int8pack_mm rounds them to bfloat16).
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
constexpr int kVecs = 4;                 // vectors per block
constexpr int kBlock = kVecs * kLanes;   // output channels per block: one 64-byte line per k
constexpr int kRows = 4;                 // rows per tile
constexpr int64_t kPrefetch = 16;        // lines ahead
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
void tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, const float* scale, float* y, int64_t ldy) {
  vec acc[R][kVecs] = {};
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* line = w + i * kBlock;
    __builtin_prefetch(line + kPrefetch * kBlock);
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

using TileFn = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTiles[kRows] = {tile<1>, tile<2>, tile<3>, tile<4>};

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && qweight.size(2) == kBlock, "x [M, K], qweight [N/64, K, 64]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "int8 weight, float scales");
  TORCH_CHECK(x.size(1) == qweight.size(1), "x has ", x.size(1), " features, the weight ", qweight.size(1));
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.numel() == qweight.size(0) * kBlock,
              "contiguous blocked weight and padded scales");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), nb = qweight.size(0), n = nb * kBlock;
  at::Tensor y = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < m; r += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - r);
        kTiles[rows - 1](xp + r * k, k, wp + b * k * kBlock, k, sp + b * kBlock, yp + r * n + b * kBlock, n);
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
