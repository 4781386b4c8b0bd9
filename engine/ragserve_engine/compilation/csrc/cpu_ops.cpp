// C++ ops for CPU decode graphs (built by cpu_ops.py), called by a compiled graph's C++ wrapper through the
// dispatcher, with no Python in between: paged decode attention, and the kernel of ragserve::packed_linear.
//
// Paged decode attention: one query per sequence, the paged KV cache read in place.
// One task per sequence; an online softmax per query head, started by the new token's own key/value.
// Each block of the sequence's table is read once, in tiles of 16 rows: for every query head the 16
// scores come out as one vector (16 dot products summed across lanes together, no per-row horizontal
// sum), then one rescale, the exps, and the weighted values. The next block is prefetched meanwhile.
// Vectors are GCC vector extensions: AVX-512 registers with -mavx512f, two AVX2
// ones with -mavx2.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;
using vec = float __attribute__((vector_size(64)));
using ivec = int32_t __attribute__((vector_size(64)));

inline vec splat(float x) { return vec{} + x; }

template <typename T>
inline vec load(const T* p) {
  float f[kLanes];
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
  vec v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

template <>
inline vec load<float>(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(vec x) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
}

// Lane r of the result is the sum of x[r]'s lanes: 16 horizontal sums in 15 vector adds.
inline vec transpose_sum(vec* x) {
  for (int i = 0; i < 8; ++i)
    x[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    x[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp(x) for x <= 0 (scores minus their running max): Cephes' expf polynomial, on a whole vector.
inline vec exp_neg(vec x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const ivec n = __builtin_convertvector(x * 1.44269504f - 0.5f, ivec);  // round to nearest: x <= 0
  const vec nf = __builtin_convertvector(n, vec);
  const vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * reinterpret_cast<const vec&>(static_cast<const ivec&>((n + 127) << 23));  // times 2^n
}

// kNc: head_dim / 16 known at compile time (4 and 8: head_dim 64 and 128), so a head's accumulators stay in
// registers across a tile's rows; 0: any multiple of 16.
template <int kNc, typename T>
void run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv,
         int64_t layer, const at::Tensor& tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t b = query.size(0), h = query.size(1), d = query.size(2), nc = kNc ? kNc : d / kLanes;
  const int64_t bs = kv.size(3), kvh = kv.size(4), g = h / kvh, width = tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* key_ptr = key.data_ptr<T>();
  const T* value_ptr = value.data_ptr<T>();
  const T* kv_ptr = kv.data_ptr<T>() + layer * kv.stride(1);
  const int64_t s_block = kv.stride(0), s_kv = kv.stride(2), s_row = kv.stride(3), s_head = kv.stride(4);
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  vec lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<vec> q(h * nc), acc(h * nc);
    std::vector<float> m(h), l(h);
    vec part[kLanes];
    for (int64_t seq = begin; seq < end; ++seq) {
      for (int64_t hd = 0; hd < h; ++hd) {  // q pre-scaled; the softmax starts from the new token's own term
        const int64_t own = (seq * kvh + hd / g) * d;
        vec t = vec{};
        for (int64_t c = 0; c < nc; ++c) {
          q[hd * nc + c] = load(q_ptr + (seq * h + hd) * d + c * kLanes) * static_cast<float>(scale);
          t += q[hd * nc + c] * load(key_ptr + own + c * kLanes);
          acc[hd * nc + c] = load(value_ptr + own + c * kLanes);
        }
        m[hd] = hsum(t);
        l[hd] = 1.f;
      }
      const int64_t cached = std::min(len_ptr[seq] - 1, width * bs);  // earlier tokens, in the cache
      for (int64_t start = 0; start < cached; start += bs) {
        const T* blk = kv_ptr + table_ptr[seq * width + start / bs] * s_block;
        // The next block (or the next sequence's first), prefetched a slice per head while this one computes.
        const char* next = nullptr;
        if (start + bs < cached)
          next = reinterpret_cast<const char*>(kv_ptr + table_ptr[seq * width + start / bs + 1] * s_block);
        else if (seq + 1 < end && len_ptr[seq + 1] > 1)
          next = reinterpret_cast<const char*>(kv_ptr + table_ptr[(seq + 1) * width] * s_block);
        const int64_t half = bs * s_row * static_cast<int64_t>(sizeof(T)), slice = (half / 64 + h - 1) / h * 64;
        const int64_t in_block = std::min(bs, cached - start);
        for (int64_t t0 = 0; t0 < in_block; t0 += kLanes) {
          const int64_t rows = std::min<int64_t>(kLanes, in_block - t0);
          for (int64_t hd = 0; hd < h; ++hd) {
            for (int64_t off = hd * slice; next && t0 == 0 && off < std::min(half, (hd + 1) * slice); off += 64) {
              __builtin_prefetch(next + off, 0, 2);
              __builtin_prefetch(next + s_kv * static_cast<int64_t>(sizeof(T)) + off, 0, 2);
            }
            const T* k0 = blk + t0 * s_row + hd / g * s_head;
            const vec* qh = &q[hd * nc];
            for (int64_t r = 0; r < kLanes; ++r) {
              vec p = vec{};
              for (int64_t c = 0; r < rows && c < nc; ++c) p += qh[c] * load(k0 + r * s_row + c * kLanes);
              part[r] = p;
            }
            vec s = transpose_sum(part);
            s = lane < splat(static_cast<float>(rows)) ? s : splat(neg_inf);
            float mx = m[hd];
            for (int i = 0; i < kLanes; ++i) mx = std::max(mx, s[i]);
            const float alpha = std::exp(m[hd] - mx);
            const vec p = lane < splat(static_cast<float>(rows)) ? exp_neg(s - mx) : vec{};
            m[hd] = mx;
            l[hd] = l[hd] * alpha + hsum(p);
            const T* v0 = k0 + s_kv;
            if constexpr (kNc > 0) {
              vec a[kNc];
              for (int c = 0; c < kNc; ++c) a[c] = acc[hd * kNc + c] * alpha;
              for (int64_t r = 0; r < rows; ++r)
                for (int c = 0; c < kNc; ++c) a[c] += p[r] * load(v0 + r * s_row + c * kLanes);
              for (int c = 0; c < kNc; ++c) acc[hd * kNc + c] = a[c];
            } else {
              vec* ah = &acc[hd * nc];
              for (int64_t c = 0; c < nc; ++c) ah[c] *= alpha;
              for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < nc; ++c) ah[c] += p[r] * load(v0 + r * s_row + c * kLanes);
            }
          }
        }
      }
      for (int64_t hd = 0; hd < h; ++hd) {
        T* dst = out_ptr + (seq * h + hd) * d;
        const float inv = 1.f / l[hd];
        for (int64_t c = 0; c < nc; ++c)
          for (int i = 0; i < kLanes; ++i) dst[c * kLanes + i] = static_cast<T>(acc[hd * nc + c][i] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& kv_cache, int64_t layer, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 6, "query [B, H, D], kv_cache [N, layers, 2, bs, KVH, D]");
  TORCH_CHECK(kv_cache.stride(5) == 1 && kv_cache.stride(4) == kv_cache.size(5), "kv_cache rows must be dense");
  TORCH_CHECK(query.size(2) % kLanes == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and kv_cache dtypes differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(4) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
      case 64: return run<4, scalar_t>(q, k, v, kv_cache, layer, tables, lens, scale, out);
      case 128: return run<8, scalar_t>(q, k, v, kv_cache, layer, tables, lens, scale, out);
      default: return run<0, scalar_t>(q, k, v, kv_cache, layer, tables, lens, scale, out);
    }
  });
  return out;
}

// ragserve::packed_linear (defined in Python, layers/packed_linear.py): the same oneDNN call as its Python
// kernel, which stays the fallback; this CPU kernel saves a Python call per linear (~18 us, 121 a step).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"),
                          c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())), std::string()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragserve, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key, Tensor value, Tensor kv_cache, int layer, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("packed_linear", &packed_linear);
}
