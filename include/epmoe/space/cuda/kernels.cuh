// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The kernels behind space::cuda's primitives: loops that run the layer's EPMOE_HD functors
// (grid-stride, so no element is skipped however large n is), block copies, a histogram
// and the grouped GEMM's pointer arrays. No layer logic lives here: the plan, the exchange's
// per-row math and the reduce are the host's functors.
#include <cstdint>

#include "epmoe/core/view.hpp"
#include "epmoe/space/cuda/runtime.cuh"

namespace epmoe::cuda_kernels {

inline constexpr int block_threads = 256;

/// Blocks for n work items: enough to fill the device, capped (grid-stride loops do the rest).
inline unsigned grid_for(index_t n) {
  const index_t g = (n + block_threads - 1) / block_threads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 8 ? 65535 * 8 : g));
}

#define EPMOE_GRID_STRIDE(i, n)                                                          \
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<index_t>(gridDim.x) * blockDim.x)

/// f(i) for i in [0, n).
template <class F>
__global__ void for_each(index_t n, F f) {
  EPMOE_GRID_STRIDE(i, n) f(i);
}

/// f(row, h0, h1) for every piece of `piece` columns of rows [0, n) (n from device memory
/// when `count` is given, capped at max_n).
template <class F>
__global__ void for_each_row(index_t max_n, const index_t* count, index_t width, index_t piece,
                             F f) {
  const index_t n = count ? (*count < max_n ? *count : max_n) : max_n;
  const index_t pieces = (width + piece - 1) / piece;
  EPMOE_GRID_STRIDE(i, n * pieces) {
    const index_t r = i / pieces, h0 = (i % pieces) * piece;
    f(r, h0, h0 + piece < width ? h0 + piece : width);
  }
}

template <class T>
__global__ void fill(T* p, index_t n, T v) {
  EPMOE_GRID_STRIDE(i, n) p[i] = v;
}

/// Copies block b's count[b] rows from src row src_off[b] to dst row dst_off[b]; blocks are
/// spread over the grid's y dimension, rows and columns over x.
template <class T>
__global__ void copy_blocks(matrix_view<const T> src, matrix_view<T> dst, index_t n,
                            const index_t* src_off, const index_t* dst_off, const index_t* count) {
  for (index_t b = blockIdx.y; b < n; b += gridDim.y) {
    const index_t rows = count[b], cols = src.cols;
    EPMOE_GRID_STRIDE(i, rows * cols) {
      const index_t r = i / cols, c = i % cols;
      dst(dst_off[b] + r, c) = src(src_off[b] + r, c);
    }
  }
}

// (Kernels in a header are templates, so every translation unit may instantiate them.)

/// out[k] += 1 for every key k in [0, bins) (out zeroed first).
template <class Key>
__global__ void histogram(const Key* keys, index_t n, index_t bins, unsigned long long* out) {
  EPMOE_GRID_STRIDE(i, n) {
    const Key k = keys[i];
    if (k >= 0 && k < bins) atomicAdd(out + k, 1ull);
  }
}

/// out[i] = i: the values a key sort carries.
template <class Int>
__global__ void iota(Int* out, index_t n) {
  EPMOE_GRID_STRIDE(i, n) out[i] = static_cast<Int>(i);
}

/// out[n] = out[n-1] + in[n-1]: the total after CUB's exclusive scan of n entries.
template <class Int>
__global__ void scan_total(const Int* in, Int* out, index_t n) {
  if (blockIdx.x == 0 && threadIdx.x == 0) out[n] = n > 0 ? out[n - 1] + in[n - 1] : 0;
}

/// One grouped GEMM's pointer arrays, on the device from the groups' device offsets (so a
/// captured graph computes its own): A = rows of group g, B = weight g, C = output rows.
template <class T>
__global__ void grouped_pointers(grouped_rows<const T> a, stacked_view<const T> b,
                                 grouped_rows<T> c, const int* groups, int n, const void** ptrs,
                                 int cap) {
  EPMOE_GRID_STRIDE(q, n) {
    const int g = groups[q];
    const index_t* off = a.device_offsets;
    ptrs[q] = b.data + g * b.batch_stride;                      // cuBLAS's A: the weight
    ptrs[cap + q] = a.data + (off[g] - off[0]) * a.stride;      // cuBLAS's B: the rows
    ptrs[2 * cap + q] = c.data + (off[g] - off[0]) * c.stride;  // C
  }
}

}  // namespace epmoe::cuda_kernels
