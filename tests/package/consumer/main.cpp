// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Uses epmoe as an outside project would; exits 0 when the package works.
#include <cstdio>

#include <epmoe/core/config.hpp>

#if defined(EPMOE_HAS_CBLAS) != EXPECT_CBLAS
#error "epmoe::epmoe lost (or gained) its EPMOE_HAS_CBLAS usage requirement"
#endif
#if defined(EPMOE_HAS_CBLAS)
#include <cblas.h>
#endif

int main() {
  epmoe::layer_config cfg;
  cfg.hidden = 64;
  cfg.ffn = 128;
  cfg.experts = 8;
  cfg.top_k = 2;
  cfg.ranks = 2;
  cfg.max_tokens = 16;
  cfg.capacity_factor = 1.25;
  cfg.validate();

  cfg.top_k = 0;  // an invalid value must be refused
  try {
    cfg.validate();
    std::puts("validate() accepted top_k = 0");
    return 1;
  } catch (const epmoe::config_error&) {
  }

#if defined(EPMOE_HAS_CBLAS)
  // Links only if BLAS::BLAS came along with epmoe::epmoe.
  const double x[2] = {1.0, 2.0};
  if (cblas_ddot(2, x, 1, x, 1) != 5.0) return 1;
#endif
  std::puts("epmoe consumer: ok");
  return 0;
}
