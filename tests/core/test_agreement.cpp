// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <epmoe/comm/local.hpp>
#include <epmoe/comm/threads.hpp>
#include <epmoe/core/agreement.hpp>

using namespace epmoe;

namespace {

struct bundle_a {};
struct bundle_b {};
template <int N>
struct knob {};
template <class T>
struct outer {};

// Runs f(comm) on R in-process ranks; per rank "" when f returned, else the config_error's
// "field = value" ("not run" if the rank never finished). Any other exception fails the test.
template <class F>
std::vector<std::string> on_ranks(int R, F f) {
  std::vector<std::string> got(static_cast<std::size_t>(R), "not run");
  auto run = std::async(std::launch::async, [&] {
    comm::threads_world world(R);
    world.run([&](comm::threads c) {
      try {
        f(c);
        got[c.rank()] = "";
      } catch (const config_error& e) {
        got[c.rank()] = e.field() + " = " + e.value();
      }
    });
  });
  // A rank left waiting in the exchange would hang the test: end it with a message instead.
  if (run.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "test_agreement: the ranks did not finish within 20 s\n");
    std::_Exit(3);
  }
  run.get();
  return got;
}

// What agree_on did on each rank: "" when it passed, else the error's field and value.
std::vector<std::string> agree_on_threads(int R, int odd_rank, std::int64_t odd_value) {
  return on_ranks(R, [&](comm::threads& c) {
    const agreement_field fields[] = {{"hidden", 64},
                                      {"experts", c.rank() == odd_rank ? odd_value : 8},
                                      {"policies", type_hash<bundle_a>()}};
    agree_on(c, std::span<const agreement_field>(fields));
  });
}

// A placement given slot by slot: rank r's slot j holds ids[r * per_rank + j] (wrapping, so a
// config with more ranks still reads a table).
struct slots {
  std::vector<int> ids;
  int per_rank = 2;
  int slots_per_rank() const { return per_rank; }
  int expert_at(int r, int j) const {
    return ids[static_cast<std::size_t>(r * per_rank + j) % ids.size()];
  }
};

const layer_config base{.hidden = 8,
                        .ffn = 6,
                        .experts = 6,
                        .top_k = 2,
                        .ranks = 3,
                        .max_tokens = 4,
                        .capacity_factor = 1.25};
const slots base_slots{{0, 1, 2, 3, 4, 5}};

// agree_on_layer on 3 ranks, rank 1 with its own config, bundle or placement.
template <class Rank1Bundle = bundle_a>
std::vector<std::string> layer_agreement(const layer_config& rank1_cfg,
                                         const slots& rank1_slots = base_slots) {
  return on_ranks(3, [&](comm::threads& c) {
    const auto nothing = [] {};
    if (c.rank() == 1)
      agree_on_layer<Rank1Bundle>(rank1_cfg, c, rank1_slots, nothing);
    else
      agree_on_layer<bundle_a>(base, c, base_slots, nothing);
  });
}

// True when every rank failed on `field` (the value after it varies).
bool all_failed_on(const std::vector<std::string>& got, const std::string& field) {
  for (const std::string& g : got)
    if (g.rfind(field + " = ", 0) != 0) return false;
  return !got.empty();
}

}  // namespace

TEST_CASE("agreement: equal fields on every rank pass", "[agreement]") {
  for (int R : {1, 2, 3}) {
    INFO("R=" << R);
    const auto got = agree_on_threads(R, -1, 0);
    REQUIRE(got.size() == static_cast<std::size_t>(R));
    for (const std::string& g : got) CHECK(g.empty());
  }
  comm::local one;
  const agreement_field fields[] = {{"hidden", 1}};
  CHECK_NOTHROW(agree_on(one, std::span<const agreement_field>(fields)));
}

TEST_CASE("agreement: one rank differing makes every rank throw the same error", "[agreement]") {
  const auto got = agree_on_threads(3, 2, 9);
  REQUIRE(got.size() == 3);
  for (const std::string& g : got) CHECK(g == "experts = rank 0: 8, rank 2: 9");
  const auto first = agree_on_threads(3, 0, 7);
  REQUIRE(first.size() == 3);
  for (const std::string& g : first) CHECK(g == "experts = rank 0: 7, rank 1: 8");
}

TEST_CASE("agreement: type_hash tells policy bundles apart", "[agreement]") {
  // Distinct types, including ones that differ only in a template argument, hash apart.
  const std::int64_t h[] = {type_hash<bundle_a>(),        type_hash<bundle_b>(),
                            type_hash<knob<2>>(),         type_hash<knob<4>>(),
                            type_hash<outer<bundle_a>>(), type_hash<outer<bundle_b>>(),
                            type_hash<outer<knob<2>>>(),  type_hash<int>()};
  const std::set<std::int64_t> distinct(std::begin(h), std::end(h));
  CHECK(distinct.size() == std::size(h));
  CHECK(hash_text("") == static_cast<std::int64_t>(14695981039346656037ull));
  CHECK(hash_text("a") == static_cast<std::int64_t>(0xaf63dc4c8601ec8cull));  // FNV-1a test vector
  CHECK(hash_text("foobar") == static_cast<std::int64_t>(0x85944171f73967e8ull));
  CHECK(hash_text("ab") != hash_text("ba"));
}

TEST_CASE("agreement: the same layer config, bundle and placement pass on every rank",
          "[agreement]") {
  const auto got = layer_agreement(base);
  REQUIRE(got.size() == 3);
  for (const std::string& g : got) CHECK(g.empty());
}

TEST_CASE("agreement: any config field that differs on one rank makes every rank throw",
          "[agreement]") {
  // Each field of the layer's agreement, changed on rank 1 only.
  const std::pair<const char*, void (*)(layer_config&)> changes[] = {
      {"hidden", [](layer_config& c) { c.hidden = 16; }},
      {"ffn", [](layer_config& c) { c.ffn = 7; }},
      {"experts", [](layer_config& c) { c.experts = 12; }},
      {"top_k", [](layer_config& c) { c.top_k = 1; }},
      {"ranks", [](layer_config& c) { c.ranks = 4; }},
      {"max_tokens", [](layer_config& c) { c.max_tokens = 5; }},
      {"shared_experts", [](layer_config& c) { c.shared_experts = 1; }},
      {"shared_ffn", [](layer_config& c) { c.shared_ffn = 3; }},
      {"seq_len", [](layer_config& c) { c.seq_len = 2; }},
      {"chunks", [](layer_config& c) { c.chunks = 2; }},
      {"max_recv_rows", [](layer_config& c) { c.max_recv_rows = 64; }},
      {"capacity_factor (x1e9)", [](layer_config& c) { c.capacity_factor = 1.25 + 1e-6; }},
      {"aux_loss_coef (x1e9)", [](layer_config& c) { c.aux_loss_coef = 0.02; }},
      {"dispatch_rows", [](layer_config& c) { c.dispatch_rows = row_format::int8; }}};
  int fields = 0;
  for (const auto& [field, change] : changes) {
    CAPTURE(field);
    layer_config odd = base;
    change(odd);
    const auto got = layer_agreement(odd);
    INFO(got[0] << " | " << got[1] << " | " << got[2]);
    CHECK(all_failed_on(got, field));
    ++fields;
  }
  CHECK(fields == 14);
}

TEST_CASE("agreement: another policy bundle or placement on one rank makes every rank throw",
          "[agreement]") {
  const auto bundle = layer_agreement<bundle_b>(base);
  INFO(bundle[0] << " | " << bundle[1] << " | " << bundle[2]);
  CHECK(all_failed_on(bundle, "policies (hash of the policy bundle type)"));
  // Tables that hold the same experts in other slots are other placements.
  const slots others[] = {{{3, 1, 2, 0, 4, 5}},      // two experts swapped across ranks
                          {{1, 0, 2, 3, 4, 5}},      // two slots swapped on one rank
                          {{0, 1, 2, 3, 4, 0}},      // a replica instead of an expert
                          {{0, 1, 2, 3, 4, 5}, 3}};  // other slots per rank
  int tables = 0;
  for (const slots& other : others) {
    CAPTURE(tables);
    const auto got = layer_agreement(base, other);
    INFO(got[0] << " | " << got[1] << " | " << got[2]);
    CHECK(all_failed_on(got, "placement (hash of every slot's expert)"));
    ++tables;
  }
  CHECK(tables == 4);
}

TEST_CASE("agreement: a rank whose own check fails throws its error, the others name it",
          "[agreement]") {
  const auto got = on_ranks(3, [](comm::threads& c) {
    agree_on_layer<bundle_a>(base, c, base_slots, [&] {
      if (c.rank() == 2) throw config_error("weights.gate", "3 x 8", "must be [experts, hidden]");
    });
  });
  REQUIRE(got.size() == 3);
  CHECK(got[2] == "weights.gate = 3 x 8");
  for (int r : {0, 1})
    CHECK(got[r].rfind("config_valid (another rank rejected its config or weights) = ", 0) == 0);
}
