// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The CUDA layer's kernels: the dispatch plan (slot keys, counts, capacity, row order),
// permute (gather token rows), the SwiGLU gate and the weighted combine. Row kernels move
// 16-byte vectors when rows are aligned; the per-element math is the host's EPMOE_HD code
// (placement slot_for, expert::silu_mul), so the CPU tests check it.
#include <cstdint>

#include "epmoe/core/plan.hpp"
#include "epmoe/cuda/runtime.cuh"
#include "epmoe/expert/swiglu.hpp"

namespace epmoe::cuda_kernels {

inline constexpr int block_threads = 256;

inline unsigned grid_for(index_t n, int per_block = block_threads) {
  const index_t g = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 16 ? 65535 * 16 : g));
}

/// V elements of T moved as one aligned load/store (16 bytes when V * sizeof(T) == 16).
template <class T, int V>
struct alignas(sizeof(T) * V) pack {
  T v[V];
};

/// Elements per 16-byte vector when every row of `cols` elements at `stride` starting at
/// `p` is 16-byte aligned, else 1.
template <class T>
int vector_width(const void* p, index_t cols, index_t stride) {
  constexpr int V = 16 / sizeof(T);
  const bool aligned =
      reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && cols % V == 0 && stride % V == 0;
  return aligned ? V : 1;
}

// --- plan --------------------------------------------------------------------------------

/// Per assignment a = t*K + k: its physical slot (the placement's slot_for, the code the
/// host plan runs), counted per slot and per logical expert. Empty routing slots (no_expert)
/// get key P, which sorts after every slot.
template <class Where>
__global__ void plan_keys(const std::int32_t* ids, index_t n, int K, Where where,
                          token_origin origin, int P, int* keys, int* order, int* slot_rows,
                          int* routed) {
  const index_t a = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (a >= n) return;
  const int e = ids[a];
  int key = P;
  if (e >= 0) {
    key = where.slot_for(e, origin.home, origin.id(a / K));
    atomicAdd(slot_rows + key, 1);
    atomicAdd(routed + e, 1);
  }
  keys[a] = key;
  order[a] = static_cast<int>(a);
}

/// Rows each slot sends: its assignments up to the capacity limit, or exactly `limit` rows
/// when padding (static shapes). Entry P is 0 so an exclusive scan ends with the total.
// (Kernels in a header are templates, so every translation unit may instantiate them.)
template <class Int>
__global__ void slot_sizes(const Int* slot_rows, int P, index_t limit, bool pad, Int* kept) {
  const int p = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (p > P) return;
  if (p == P) {
    kept[p] = 0;
    return;
  }
  const index_t n = slot_rows[p];
  kept[p] = static_cast<int>(pad ? limit : (n < limit ? n : limit));
}

/// Per sorted assignment i (stable by slot: token order, then k, as the host plan): its row
/// in the send buffer, or dropped past the limit. slot[a] = send row or -1; row_token maps
/// each send row to its token (padding rows keep -1 and are sent as zeros).
template <class Int>
__global__ void plan_rows(const Int* keys, const Int* order, index_t n, int K, int P,
                          const Int* first_of_slot, const Int* send_offset, index_t limit,
                          std::int32_t* slot, std::int32_t* row_token) {
  const index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int a = order[i], p = keys[i];
  if (p == P) {
    slot[a] = -1;
    return;
  }
  const index_t pos = i - first_of_slot[p];
  if (pos < limit) {
    const int row = static_cast<int>(send_offset[p] + pos);
    slot[a] = row;
    row_token[row] = a / K;
  } else {
    slot[a] = -1;
  }
}

/// The counts message to each destination rank r: for each of its L slots, the rows sent
/// (padded), the real rows, and where they start in this rank's send buffer.
template <class Int>
__global__ void count_message(const Int* kept, const Int* slot_rows, const Int* send_offset, int R,
                              int L, index_t limit, index_t* msg) {
  const int b = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (b >= R * L) return;
  const int r = b / L, j = b % L;
  index_t* out = msg + static_cast<index_t>(r) * 3 * L;
  const index_t n = slot_rows[b];
  out[j] = kept[b];
  out[L + j] = n < limit ? n : limit;
  out[2 * L + j] = send_offset[b];
}

// --- rows --------------------------------------------------------------------------------

/// Send row i = token row_token[i] of x (zeros for padding), U-sized units (16-byte vectors
/// when aligned), units_per_row per row, x rows `ldx` units apart.
template <class U>
__global__ void gather_rows(const U* x, index_t ldx, const std::int32_t* row_token, index_t rows,
                            index_t units_per_row, U* out) {
  const index_t n = rows * units_per_row;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t r = i / units_per_row, c = i % units_per_row;
    const std::int32_t t = row_token[r];
    out[i] = t < 0 ? U{} : x[t * ldx + c];
  }
}

/// h1 = silu(h1) * h3 over n elements (expert::silu_mul, the host's function), V at a time.
template <class T, int V>
__global__ void silu_mul(T* h1, const T* h3, index_t n) {
  using P = pack<T, V>;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n / V;
       i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    P a = reinterpret_cast<const P*>(h1)[i];
    const P b = reinterpret_cast<const P*>(h3)[i];
#pragma unroll
    for (int v = 0; v < V; ++v)
      a.v[v] = from_float<T>(expert::silu_mul(to_float(a.v[v]), to_float(b.v[v])));
    reinterpret_cast<P*>(h1)[i] = a;
  }
}

/// y[t] = sum_k w[t,k] * back[slot[t,k]] (+ shared[t]) in fp32, the order of the host's
/// rows::weighted_reduce; dropped assignments (slot -1) add nothing. V elements per thread.
template <class T, int V>
__global__ void combine_rows(const T* back, index_t H, const std::int32_t* slot, const float* w,
                             int K, const float* shared, T* y, index_t ldy, index_t tokens) {
  using P = pack<T, V>;
  const index_t per_row = H / V, n = tokens * per_row;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t t = i / per_row, c = i % per_row;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    for (int k = 0; k < K; ++k) {
      const std::int32_t s = slot[t * K + k];
      if (s < 0) continue;
      const float wk = w[t * K + k];
      const P p = reinterpret_cast<const P*>(back + s * H)[c];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += wk * to_float(p.v[v]);
    }
    P out;
#pragma unroll
    for (int v = 0; v < V; ++v)
      out.v[v] = from_float<T>(shared ? acc[v] + shared[t * H + c * V + v] : acc[v]);
    reinterpret_cast<P*>(y + t * ldy)[c] = out;
  }
}

/// fp32 -> T, elementwise (weights loaded from fp32 host tensors, tests).
template <class T>
__global__ void convert(const float* in, T* out, index_t n) {
  const index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_float<T>(in[i]);
}

}  // namespace epmoe::cuda_kernels
