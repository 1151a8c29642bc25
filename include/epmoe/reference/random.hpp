// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

// The seeded draws of the training noise, jitter, hash routing and replica choice, written
// from their documented definitions (docs/routers.md, core/random.hpp's contract): a draw is
// a pure function of (seed, pass, token, index). Nothing here calls epmoe::math, so a change
// to the library's generator shows up as a layer-vs-reference mismatch.
namespace epmoe::reference::draws {

/// The output of SplitMix64 (Steele, Lea and Flood 2014) whose state is `state`: advance by
/// the golden-ratio increment, then Stafford's variant-13 finaliser.
constexpr std::uint64_t splitmix64(std::uint64_t state) {
  std::uint64_t z = state + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// The 64 bits for (seed, a, b, c): seed, then each coordinate xor-ed in and mixed again.
constexpr std::uint64_t bits(std::uint64_t seed, std::uint64_t a, std::uint64_t b,
                             std::uint64_t c) {
  std::uint64_t h = splitmix64(seed);
  for (std::uint64_t v : {a, b, c}) h = splitmix64(h ^ v);
  return h;
}

/// Uniform in (0, 1) from the top 24 bits, at the middle of its 2^-24 step (never 0 or 1).
inline double uniform(std::uint64_t b) { return (static_cast<double>(b >> 40) + 0.5) / 16777216.0; }

/// N(0, 1) by Box-Muller's cosine branch: u1 from the draw, u2 from the draw mixed once more.
inline double normal(std::uint64_t b) {
  const double u1 = uniform(b), u2 = uniform(splitmix64(b));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace epmoe::reference::draws
