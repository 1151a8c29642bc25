// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/view.hpp"

#if defined(EPMOE_HAS_CBLAS)
#include <cblas.h>
#endif

namespace epmoe::space {

/// Which GEMM the host space runs, for reports.
inline const char* host_gemm_backend() {
#if defined(EPMOE_HAS_OPENBLAS)
  return "cblas_sgemm (OpenBLAS)";
#elif defined(EPMOE_HAS_CBLAS)
  return "cblas_sgemm (BLAS)";
#else
  return "portable loop (no BLAS found)";
#endif
}

/// c[M,N] = a[M,K] * b[N,K]^T, row-major with strides. BLAS sgemm when the build found one;
/// otherwise a dot-product loop (both operands are read along contiguous rows).
inline void host_gemm_nt(matrix_view<const float> a, matrix_view<const float> b,
                         matrix_view<float> c) {
  const index_t M = c.rows, N = c.cols, K = a.cols;
  if (M == 0 || N == 0) return;
#if defined(EPMOE_HAS_CBLAS)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, a.data, static_cast<int>(a.stride), b.data,
              static_cast<int>(b.stride), 0.0f, c.data, static_cast<int>(c.stride));
#else
  // 4 output columns at a time: 4 independent sums over one a-row, which vectorises.
  for (index_t i = 0; i < M; ++i) {
    const float* ar = a.row(i);
    float* cr = c.row(i);
    index_t j = 0;
    for (; j + 4 <= N; j += 4) {
      const float *b0 = b.row(j), *b1 = b.row(j + 1), *b2 = b.row(j + 2), *b3 = b.row(j + 3);
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (index_t k = 0; k < K; ++k) {
        const float x = ar[k];
        s0 += x * b0[k];
        s1 += x * b1[k];
        s2 += x * b2[k];
        s3 += x * b3[k];
      }
      cr[j] = s0;
      cr[j + 1] = s1;
      cr[j + 2] = s2;
      cr[j + 3] = s3;
    }
    for (; j < N; ++j) {
      const float* br = b.row(j);
      float s = 0;
      for (index_t k = 0; k < K; ++k) s += ar[k] * br[k];
      cr[j] = s;
    }
  }
#endif
}

}  // namespace epmoe::space
