// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>

#include "epmoe/core/macros.hpp"

// Counter-based random numbers: a value is a pure function of (seed, pass, token, index),
// so every rank, thread or GPU thread draws the same number for the same element, with no
// generator state to carry or share.
namespace epmoe::math {

/// SplitMix64 finaliser: a bijective mix with full avalanche.
EPMOE_HD std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

EPMOE_HD std::uint64_t hash4(std::uint64_t seed, std::uint64_t a, std::uint64_t b,
                             std::uint64_t c) {
  return mix64(mix64(mix64(mix64(seed) ^ a) ^ b) ^ c);
}

/// Uniform in (0, 1): the top 24 bits, offset by half a step so 0 never comes out.
EPMOE_HD float uniform01(std::uint64_t bits) {
  return (static_cast<float>(bits >> 40) + 0.5f) * (1.f / 16777216.f);
}

/// Standard normal by Box-Muller from one 64-bit draw split into two uniforms.
EPMOE_HD float standard_normal(std::uint64_t bits) {
  const float u1 = uniform01(bits), u2 = uniform01(mix64(bits));
  return sqrtf(-2.f * logf(u1)) * cosf(6.28318530717958648f * u2);
}

}  // namespace epmoe::math
