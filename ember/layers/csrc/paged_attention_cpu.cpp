// Paged decode attention for CPUs: one query token per sequence, reading K/V in place from a
// slot-indexed cache through each sequence's block table (no gather, no padding).
//
// Registered as torch.ops.ember.paged_decode_attention; ember/layers/cpu_attention.py builds
// and loads it. Work is split over (sequence, KV head) pairs with ATen's thread pool; the
// query heads that share a KV head are processed together so each K/V row is read once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Eight floats in one vector register (AVX2 on x86, two NEON registers on Arm): GCC/Clang
// vector extensions keep the kernel portable across CPUs built with -march=native.
typedef float f8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f8 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  u16x8 half;
  std::memcpy(&half, p, sizeof(half));
  u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
  f8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline float sum8(f8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// One (sequence, KV head): `group` queries q [group, head_dim] over the `len` context tokens
// found through `table`; writes out [group, head_dim]. scores is scratch of group * len.
// kDim is head_dim when known at compile time (the common 64 and 128, fully unrolled), or 0.
template <typename T, int64_t kDim>
void decode_one(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t len, int64_t group, int64_t head_dim, int64_t block_size, float scale,
                float* scores, float* out) {
  const int64_t dim = kDim ? kDim : head_dim;
  for (int64_t first = 0; first < len; first += block_size) {
    const T* k = k_cache + table[first / block_size] * block_size * dim;
    const int64_t n = std::min(block_size, len - first);
    for (int64_t i = 0; i < n; ++i, k += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * dim;
        f8 even = {}, odd = {};  // two chains hide the FMA latency
        for (int64_t d = 0; d < dim; d += 16) {
          even += load8(qg + d) * load8(k + d);
          odd += load8(qg + d + 8) * load8(k + d + 8);
        }
        scores[g * len + first + i] = sum8(even + odd) * scale;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float max_score = s[0];
    for (int64_t t = 1; t < len; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      total += s[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
    std::fill(out + g * dim, out + (g + 1) * dim, 0.f);
  }
  for (int64_t first = 0; first < len; first += block_size) {
    const T* v = v_cache + table[first / block_size] * block_size * dim;
    const int64_t n = std::min(block_size, len - first);
    for (int64_t i = 0; i < n; ++i, v += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const f8 p = f8{} + scores[g * len + first + i];
        float* og = out + g * dim;
        for (int64_t d = 0; d < dim; d += 8) {
          f8 o = load8(og + d) + p * load8(v + d);
          std::memcpy(og + d, &o, sizeof(o));
        }
      }
    }
  }
}

template <typename T>
void decode_all(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_slots = kv_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  const float* q_ptr = q.data_ptr<float>();
  const T* k_ptr = kv_cache.data_ptr<T>();
  const T* v_ptr = k_ptr + num_kv_heads * num_slots * head_dim;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, len_ptr[b]);
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * max_len);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t head_offset = h * num_slots * head_dim;
      const int64_t row = (b * num_heads + h * group) * head_dim;
      auto* one = head_dim == 64 ? &decode_one<T, 64>
                  : head_dim == 128 ? &decode_one<T, 128> : &decode_one<T, 0>;
      one(q_ptr + row, k_ptr + head_offset, v_ptr + head_offset, table_ptr + b * max_blocks,
          len_ptr[b], group, head_dim, block_size, static_cast<float>(scale), scores.data(),
          out_ptr + row);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [batch, heads, head_dim] tensor");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, kv_heads, slots, head_dim] tensor");
  TORCH_CHECK(kv_cache.size(3) == q.size(2), "q and kv_cache head_dim differ");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [batch, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [batch] tensor");
  at::Tensor out = at::empty_like(q);
  if (kv_cache.scalar_type() == at::kFloat) {
    decode_all<float>(q, kv_cache, block_tables, seq_lens, block_size, scale, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "kv_cache must be float32 or bfloat16");
    decode_all<c10::BFloat16>(q, kv_cache, block_tables, seq_lens, block_size, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(ember, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
