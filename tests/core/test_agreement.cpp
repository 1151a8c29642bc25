// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <string>
#include <vector>

#include <epmoe/comm/local.hpp>
#include <epmoe/comm/threads.hpp>
#include <epmoe/core/agreement.hpp>

using namespace epmoe;

namespace {

struct bundle_a {};
struct bundle_b {};

// What agree_on did on each rank: "" when it passed, else the error's field and value.
std::vector<std::string> agree_on_threads(int R, int odd_rank, std::int64_t odd_value) {
  std::vector<std::string> got(static_cast<std::size_t>(R), "not run");
  auto run = std::async(std::launch::async, [&] {
    comm::threads_world world(R);
    world.run([&](comm::threads c) {
      const agreement_field fields[] = {{"hidden", 64},
                                        {"experts", c.rank() == odd_rank ? odd_value : 8},
                                        {"policies", type_hash<bundle_a>()}};
      try {
        agree_on(c, std::span<const agreement_field>(fields));
        got[c.rank()] = "";
      } catch (const config_error& e) {
        got[c.rank()] = e.field() + " = " + e.value();
      }
    });
  });
  // A rank left waiting in the exchange would hang the test: end it with a message instead.
  if (run.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "test_agreement: agree_on did not finish within 20 s\n");
    std::_Exit(3);
  }
  run.get();
  return got;
}

}  // namespace

TEST_CASE("agreement: equal fields on every rank pass", "[agreement]") {
  for (int R : {1, 2, 3}) {
    INFO("R=" << R);
    for (const std::string& g : agree_on_threads(R, -1, 0)) CHECK(g.empty());
  }
  comm::local one;
  const agreement_field fields[] = {{"hidden", 1}};
  CHECK_NOTHROW(agree_on(one, std::span<const agreement_field>(fields)));
}

TEST_CASE("agreement: one rank differing makes every rank throw the same error", "[agreement]") {
  const auto got = agree_on_threads(3, 2, 9);
  for (const std::string& g : got) CHECK(g == "experts = rank 0: 8, rank 2: 9");
  const auto first = agree_on_threads(3, 0, 7);
  for (const std::string& g : first) CHECK(g == "experts = rank 0: 7, rank 1: 8");
}

TEST_CASE("agreement: type_hash tells policy bundles apart", "[agreement]") {
  CHECK(type_hash<bundle_a>() == type_hash<bundle_a>());
  CHECK(type_hash<bundle_a>() != type_hash<bundle_b>());
  CHECK(hash_text("") == static_cast<std::int64_t>(14695981039346656037ull));
  CHECK(hash_text("a") == static_cast<std::int64_t>(0xaf63dc4c8601ec8cull));  // FNV-1a test vector
}
