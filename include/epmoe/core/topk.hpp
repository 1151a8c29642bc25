// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>

#include "epmoe/core/macros.hpp"

// Per-token selection math shared by every router, on host and device.
namespace epmoe::math {

/// Selection key: NaN ranks like -inf (never above a number), so ids stay valid whatever
/// the input; a NaN logit makes its token's weights NaN anyway.
EPMOE_HD float selection_key(float x) { return x != x ? -INFINITY : x; }

/// The K largest of v[0..n) (K <= n), descending; ties keep the lower index first.
/// One pass of insertion into a K-long sorted list: O(n*K), registers only, so one GPU
/// thread can run it per token.
template <int K>
EPMOE_HD void top_k(const float* v, int n, int* ids, float* keys) {
  int count = 0;
  for (int i = 0; i < n; ++i) {
    const float x = selection_key(v[i]);
    if (count == K && !(x > keys[K - 1])) continue;
    int p = count < K ? count++ : K - 1;
    while (p > 0 && x > keys[p - 1]) {
      keys[p] = keys[p - 1];
      ids[p] = ids[p - 1];
      --p;
    }
    keys[p] = x;
    ids[p] = i;
  }
}

/// e^(x - max): the stable softmax numerator.
EPMOE_HD float shifted_exp(float x, float max) { return expf(x - max); }

}  // namespace epmoe::math
