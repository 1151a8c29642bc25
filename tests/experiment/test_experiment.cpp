// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// epmoe::experiment on three bundles with tiny shapes: the table's counts equal each bundle's
// own layer stats (run apart through the test harness), its error column is the reference's,
// and the outputs (JSON, CSV, text) carry every row.
#include <catch2/catch.hpp>
#include <cmath>
#include <sstream>
#include <vector>

#include "../layer/harness.hpp"
#include <epmoe/experiment.hpp>

using namespace epmoe;

namespace {

template <class Capacity = capacity::dropless, bool Dedup = false,
          class Placement = placement::block>
struct mixtral : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using capacity = Capacity;
  using placement = Placement;
  using comm = epmoe::comm::threads;
  static constexpr layer_options options{.dedup = Dedup};
};

using three = experiment::list<experiment::bundle<"dropless", mixtral<>>,
                               experiment::bundle<"capacity 1.0", mixtral<capacity::factor<false>>>,
                               experiment::bundle<"dedup", mixtral<capacity::dropless, true>>>;

layer_config tiny() {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .top_k = 2,
          .ranks = 4,
          .max_tokens = 24,
          .capacity_factor = 1.0};
}

test::global_tokens global(const experiment::inputs& in) {
  test::global_tokens g;
  for (int r = 0; r < in.cfg.ranks; ++r) {
    g.per_rank.push_back(in.tokens_of(r));
    g.x.insert(g.x.end(), in.tokens[r].begin(), in.tokens[r].end());
  }
  return g;
}

/// The table's counts against the bundle's layer run apart, every rank summed.
template <class P>
void check_counts(const experiment::row& row, const experiment::inputs& in) {
  const auto got = test::run_layer<P>(in.cfg, in.weights, global(in));
  index_t rows = 0, back = 0, bytes = 0, combine = 0, dropped = 0, peak = 0;
  for (int r = 0; r < in.cfg.ranks; ++r) {
    const pass_stats& s = got.stats[r][0];
    for (int q = 0; q < in.cfg.ranks; ++q)
      if (q != r) rows += s.rows_sent[q], back += s.rows_received[q];
    bytes += s.dispatch_bytes_sent;
    combine += s.combine_bytes_sent;
    dropped += s.dropped;
    peak = std::max(peak, s.peak_recv_rows);
  }
  CHECK(row.dispatch_rows == rows);
  CHECK(row.combine_rows == back);
  CHECK(row.dispatch_bytes == bytes);
  CHECK(row.combine_bytes == combine);
  CHECK(row.dropped == dropped);
  CHECK(row.peak_recv_rows == peak);
  CHECK(test::relative_error(got.y, test::run_reference<P>(in.cfg, in.weights, global(in))) <=
        1e-4);
}

}  // namespace

TEST_CASE("experiment: three bundles, counts equal each layer's own stats, error the reference's",
          "[experiment]") {
  const auto in = experiment::inputs::skewed(tiny(), 3, 5, 2.0);
  const auto table = experiment::run(three{}, experiment::thread_ranks{4}, in, {.passes = 3});
  REQUIRE(table.size() == 3);
  CHECK(table[0].name == "dropless");
  CHECK(table[1].name == "capacity 1.0");
  CHECK(table[2].name == "dedup");
  check_counts<mixtral<>>(table[0], in);
  check_counts<mixtral<capacity::factor<false>>>(table[1], in);
  check_counts<mixtral<capacity::dropless, true>>(table[2], in);
  int checked = 0;
  for (const auto& row : table) {
    CAPTURE(row.name);
    CHECK(row.error <= 1e-4);  // NaN or an unwritten row would be +inf
    CHECK(row.time.total > 0);
    CHECK(row.time.experts > 0);
    CHECK(row.expert_imbalance >= 1);
    CHECK(row.rank_imbalance >= 1);
    CHECK(row.straggler_excess == Approx(row.rank_imbalance - 1));
    CHECK(row.topology == "h200");
    CHECK(row.predicted_seconds > 0);
    ++checked;
  }
  CHECK(checked == 3);
  CHECK(table[0].dropped == 0);
  CHECK(table[1].dropped > 0);                             // skewed tokens at capacity factor 1
  CHECK(table[2].dispatch_rows < table[0].dispatch_rows);  // dedup sends fewer rows
}

TEST_CASE("experiment: balanced replicas run on the balancer's table and match the reference",
          "[experiment]") {
  using bundles = experiment::list<
      experiment::bundle<"block", mixtral<capacity::dropless, false, placement::table>>,
      experiment::bundle<"balanced +4", mixtral<capacity::dropless, false, placement::table>,
                         experiment::treatment{.from_load = true, .extra_slots = 4}>>;
  const auto in = experiment::inputs::skewed(tiny(), 4, 1, 3.0);
  const auto table =
      experiment::run(bundles{}, experiment::thread_ranks{4}, in, {.passes = 1, .topology = ""});
  REQUIRE(table.size() == 2);
  CHECK(table[0].error <= 1e-4);
  CHECK(table[1].error <= 1e-4);
  CHECK(table[1].rank_imbalance < table[0].rank_imbalance);
  CHECK(table[0].topology.empty());
  CHECK(table[0].predicted_seconds == 0);
}

namespace {
struct relu_mlp : mixtral<> {
  using expert = epmoe::expert::mlp<act::relu, true>;
};
struct deepseek : mixtral<> {
  using router = epmoe::router::sigmoid_bias<2>;
  static router make_router(const layer_config&) { return {.groups = 2, .gamma = 0.05f}; }
};
}  // namespace

TEST_CASE("experiment: bias_steps learn the DeepSeek bias, the reference routes with it",
          "[experiment]") {
  using bundles = experiment::list<
      experiment::bundle<"no steps", deepseek>,
      experiment::bundle<"20 steps", deepseek, experiment::treatment{.bias_steps = 20}>>;
  const auto in = experiment::inputs::skewed(tiny(), 5, 2, 3.0);
  const auto table =
      experiment::run(bundles{}, experiment::thread_ranks{4}, in, {.passes = 2, .topology = ""});
  REQUIRE(table.size() == 2);
  // The reference with the bias the layer learnt: one without it routes differently and fails.
  CHECK(table[0].error <= 1e-4);
  CHECK(table[1].error <= 1e-4);
  CHECK(table[1].expert_imbalance < table[0].expert_imbalance);
}

namespace {
/// DeepSeek-V4-like: sqrtsoftplus scores with a selection bias (eps 1e-20, scaling 1.5) and
/// the clamped SwiGLU expert; its hash layers route by a [vocab, K] table of token ids (the
/// experiment's ids: rank * max_tokens + t, so vocab = ranks * max_tokens).
struct deepseek_v4 : mixtral<> {
  using router = epmoe::router::deepseek_v4<2>;
  using expert = epmoe::expert::deepseek_v4;
  static router make_router(const layer_config&) {
    router r{};
    r.scaling = 1.5f, r.eps = 1e-20f, r.gamma = 0.05f;
    return r;
  }
};
struct deepseek_v4_hash : deepseek_v4 {
  using router = epmoe::router::deepseek_v4_hash<2>;
  static router make_router(const layer_config& cfg) {
    static const std::vector<std::int32_t> table = [&] {  // the table the layer copies
      std::vector<std::int32_t> t;
      for (int v = 0; v < cfg.ranks * cfg.max_tokens; ++v)
        t.insert(t.end(), {v % cfg.experts,  // a distinct second expert: offset 1 .. E - 1
                           (v + 1 + (v / cfg.experts) % (cfg.experts - 1)) % cfg.experts});
      return t;
    }();
    router r{};
    r.ids = table.data(), r.vocab = cfg.ranks * cfg.max_tokens;
    r.scaling = 1.5f, r.eps = 1e-20f;
    return r;
  }
};
}  // namespace

TEST_CASE("experiment: DeepSeek-V4-like bundles (sqrtsoftplus + bias, the hash table)",
          "[experiment]") {
  using bundles = experiment::list<
      experiment::bundle<"deepseek-v4", deepseek_v4>,
      experiment::bundle<"deepseek-v4 +bias", deepseek_v4, experiment::treatment{.bias_steps = 10}>,
      experiment::bundle<"deepseek-v4 hash", deepseek_v4_hash>>;
  const auto in = experiment::inputs::skewed(tiny(), 5, 2, 3.0);
  const auto table =
      experiment::run(bundles{}, experiment::thread_ranks{4}, in, {.passes = 2, .topology = ""});
  REQUIRE(table.size() == 3);
  int checked = 0;
  for (const auto& row : table) {
    CAPTURE(row.name);
    CHECK(row.error <= 1e-4);  // NaN or an unwritten row would be +inf
    CHECK(row.dispatch_rows > 0);
    ++checked;
  }
  CHECK(checked == 3);
}

TEST_CASE("experiment: shared experts, their gate and an output bias reach layer and reference",
          "[experiment]") {
  using bundles = experiment::list<experiment::bundle<"swiglu", mixtral<>>,
                                   experiment::bundle<"relu mlp + biases", relu_mlp>>;
  layer_config cfg = tiny();
  cfg.shared_experts = 1;
  cfg.shared_ffn = 6;
  cfg.shared_gate = true;
  cfg.output_bias = true;
  const auto in = experiment::inputs::uniform(cfg, 8);
  const auto table =
      experiment::run(bundles{}, experiment::thread_ranks{4}, in, {.passes = 1, .topology = ""});
  REQUIRE(table.size() == 2);
  CHECK(table[0].error <= 1e-4);
  CHECK(table[1].error <= 1e-4);
}

TEST_CASE("experiment: a wrong rank count, batch count, passes or nodes is named", "[experiment]") {
  const auto in = experiment::inputs::uniform(tiny(), 5);
  using one = experiment::list<experiment::bundle<"dropless", mixtral<>>>;
  CHECK_THROWS_WITH(experiment::run(one{}, experiment::thread_ranks{2}, in),
                    Catch::Contains("experiment.ranks"));
  auto fewer = in;
  fewer.tokens.pop_back();
  CHECK_THROWS_WITH(experiment::run(one{}, experiment::thread_ranks{4}, fewer),
                    Catch::Contains("experiment.inputs.tokens"));
  CHECK_THROWS_WITH(experiment::run(one{}, experiment::thread_ranks{4}, in, {.passes = 0}),
                    Catch::Contains("experiment.options.passes"));
  CHECK_THROWS_WITH(experiment::run(one{}, experiment::thread_ranks{4}, in, {.nodes = 3}),
                    Catch::Contains("experiment.options.nodes"));
}

TEST_CASE("experiment: JSON, CSV and text carry every row", "[experiment]") {
  std::vector<experiment::row> table(2);
  table[0].name = "a \"quoted\" name";
  table[1].name = "b";
  table[1].error = std::numeric_limits<double>::infinity();
  std::ostringstream json, csv, text;
  experiment::write_json(json, table);
  experiment::write_csv(csv, table);
  experiment::print(text, table);
  CHECK(json.str().find("\"bundle\":\"a \\\"quoted\\\" name\"") != std::string::npos);
  CHECK(json.str().find("\"error\":null") != std::string::npos);  // JSON has no inf
  std::istringstream lines(csv.str());
  int n = 0;
  for (std::string l; std::getline(lines, l);) ++n;
  CHECK(n == 3);
  CHECK(csv.str().find("\"a \"\"quoted\"\" name\"") != std::string::npos);
  CHECK(text.str().find("b ") != std::string::npos);
}
