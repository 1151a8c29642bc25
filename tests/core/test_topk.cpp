// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <type_traits>
#include <vector>

#include <epmoe/core/topk.hpp>

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

// The K largest by value, ties to the lower index: a stable sort by descending value.
std::vector<int> brute_top_k(const std::vector<float>& v, int k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(static_cast<std::size_t>(k));
  return idx;
}

template <int K>
std::vector<int> run_top_k(const std::vector<float>& v) {
  int ids[K];
  float keys[K];
  std::fill_n(ids, K, -1);  // an id top_k did not write shows as invalid
  std::fill_n(keys, K, nan_f);
  epmoe::math::top_k<K>(v.data(), static_cast<int>(v.size()), ids, keys);
  return std::vector<int>(ids, ids + K);
}

}  // namespace

template <int K>
using k_ = std::integral_constant<int, K>;

TEMPLATE_TEST_CASE("topk: matches a stable brute-force sort on random vectors", "[topk]", k_<1>,
                   k_<2>, k_<3>, k_<4>, k_<8>) {
  constexpr int K = TestType::value;
  std::mt19937 rng(1234 + K);
  std::uniform_real_distribution<float> any(-10.f, 10.f);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = K + static_cast<int>(rng() % 40);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = any(rng);
    int ids[K];
    float keys[K];
    std::fill_n(ids, K, -1);
    std::fill_n(keys, K, nan_f);
    epmoe::math::top_k<K>(v.data(), n, ids, keys);
    const auto want = brute_top_k(v, K);
    for (int k = 0; k < K; ++k) {
      REQUIRE(ids[k] == want[k]);
      REQUIRE(keys[k] == v[ids[k]]);
    }
  }
}

TEMPLATE_TEST_CASE("topk: ties keep the lower index first", "[topk]", k_<1>, k_<2>, k_<3>, k_<4>,
                   k_<8>) {
  constexpr int K = TestType::value;
  std::mt19937 rng(99 + K);
  const float pool[] = {-2.f, -1.f, 0.f, 0.5f, 1.f};  // a small set: ties everywhere
  for (int trial = 0; trial < 300; ++trial) {
    const int n = K + static_cast<int>(rng() % 30);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = pool[rng() % 5];
    REQUIRE(run_top_k<K>(v) == brute_top_k(v, K));
  }
  // All equal: the first K indices, in order.
  const std::vector<float> flat(static_cast<std::size_t>(K + 5), 3.f);
  std::vector<int> first(K);
  std::iota(first.begin(), first.end(), 0);
  CHECK(run_top_k<K>(flat) == first);
}

TEMPLATE_TEST_CASE("topk: n == K returns every index, sorted by value", "[topk]", k_<1>, k_<2>,
                   k_<3>, k_<4>, k_<8>) {
  constexpr int K = TestType::value;
  std::mt19937 rng(7 + K);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> v(K);
    for (float& x : v) x = static_cast<float>(static_cast<int>(rng() % 7) - 3);
    const auto got = run_top_k<K>(v);
    CHECK(got == brute_top_k(v, K));
    CHECK(std::set<int>(got.begin(), got.end()).size() == static_cast<std::size_t>(K));
  }
}

TEST_CASE("topk: K == 1 is the arg-max, first on ties", "[topk]") {
  CHECK(run_top_k<1>({0.f, 5.f, -1.f, 5.f}) == std::vector<int>{1});
  CHECK(run_top_k<1>({-3.f, -2.f, -7.f}) == std::vector<int>{1});
  CHECK(run_top_k<1>({4.f}) == std::vector<int>{0});
  CHECK(run_top_k<1>({1.f, 2.f, 3.f, 4.f, 5.f}) == std::vector<int>{4});
}

TEMPLATE_TEST_CASE("topk: NaN entries are never selected over numbers", "[topk][nan]", k_<1>, k_<2>,
                   k_<3>, k_<4>) {
  constexpr int K = TestType::value;
  std::mt19937 rng(4242 + K);
  std::uniform_real_distribution<float> any(-5.f, 5.f);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = K + static_cast<int>(rng() % 20);
    std::vector<float> v(n);
    int numbers = 0;
    for (float& x : v) {
      x = (rng() % 3 == 0) ? nan_f : any(rng);
      numbers += !std::isnan(x);
    }
    const auto got = run_top_k<K>(v);
    REQUIRE(std::set<int>(got.begin(), got.end()).size() == static_cast<std::size_t>(K));
    for (int id : got) REQUIRE((id >= 0 && id < n));
    // The numbers ranked as if the NaNs were not there, then (if K > numbers) NaN ids.
    std::vector<float> only_numbers;
    std::vector<int> where;
    for (int i = 0; i < n; ++i)
      if (!std::isnan(v[i])) {
        only_numbers.push_back(v[i]);
        where.push_back(i);
      }
    const int m = std::min(K, numbers);
    const auto best = brute_top_k(only_numbers, m);
    for (int k = 0; k < m; ++k) REQUIRE(got[k] == where[best[k]]);
    for (int k = m; k < K; ++k) REQUIRE(std::isnan(v[got[k]]));
  }
  // A single number among NaNs, anywhere, comes first.
  std::vector<float> v(9, nan_f);
  v[6] = -1e30f;
  CHECK(run_top_k<K>(v)[0] == 6);
}

TEMPLATE_TEST_CASE("topk: all-NaN input still yields K distinct valid ids", "[topk][nan]", k_<1>,
                   k_<2>, k_<4>, k_<8>) {
  constexpr int K = TestType::value;
  for (int n : {K, K + 1, K + 13}) {
    const std::vector<float> v(static_cast<std::size_t>(n), nan_f);
    int ids[K];
    float keys[K];
    std::fill_n(ids, K, -1);
    std::fill_n(keys, K, nan_f);
    epmoe::math::top_k<K>(v.data(), n, ids, keys);
    std::set<int> distinct;
    for (int k = 0; k < K; ++k) {
      CHECK((ids[k] >= 0 && ids[k] < n));
      CHECK(std::isinf(keys[k]));  // NaN ranks as -inf
      distinct.insert(ids[k]);
    }
    CHECK(distinct.size() == static_cast<std::size_t>(K));
  }
}

TEST_CASE("topk: selection_key maps NaN to -inf and keeps numbers", "[topk][nan]") {
  CHECK(epmoe::math::selection_key(nan_f) == -std::numeric_limits<float>::infinity());
  CHECK(epmoe::math::selection_key(2.5f) == 2.5f);
  CHECK(epmoe::math::selection_key(-1e30f) == -1e30f);
  CHECK(epmoe::math::shifted_exp(3.f, 3.f) == 1.f);
  CHECK(epmoe::math::shifted_exp(-1e4f, 1e4f) == 0.f);  // underflows, no inf
}
