// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Fuzz driver: random configs, tokens and routings (ids out of range, NaN/Inf weights and
// logits, T = 0, T > max_tokens, all tokens to one expert, receive bounds that force rounds)
// through plan -> dispatch -> combine on comm::threads, checking after every input:
//   - an invalid config throws config_error on every rank (agreement), none hangs;
//   - an invalid input throws on every rank before any row moves: outputs untouched;
//   - a valid input runs: outputs equal the plain reference where the token's inputs are
//     finite (and are finite there), rows are conserved (sent = received over all ranks,
//     computed = assignments - dropped), drops happen only past capacity, a receive bound
//     is never exceeded.
// Seeded driver (any compiler): epmoe_fuzz [--runs N] [--seed S] [--quiet]
// libFuzzer (clang, -DEPMOE_FUZZ_LIBFUZZER=ON): each input's bytes seed one case.
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../examples/args.hpp"
#include <epmoe/capacity/factor.hpp>
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/schedule/pipelined.hpp>

using namespace epmoe;

namespace {

constexpr int K = 2;

template <class Capacity, class Schedule, bool Dedup = false>
struct policies : default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using capacity = Capacity;
  using comm = epmoe::comm::threads;
  using schedule = Schedule;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};
using p_seq = policies<capacity::dropless, schedule::sequential>;
using p_pipe = policies<capacity::dropless, schedule::pipelined<2>>;
using p_factor = policies<capacity::factor<false>, schedule::sequential>;
using p_padded = policies<capacity::factor<true>, schedule::pipelined<3>>;
using p_dedup = policies<capacity::dropless, schedule::sequential, true>;
constexpr int n_policies = 5;

// The reference's router for a given routing (by global token position).
struct table_router {
  static constexpr int top_k = K;
  static constexpr bool uses_gate = false;
  const std::int32_t* ids = nullptr;
  const float* weights = nullptr;
  void route_token(const token_input& in, int* out_ids, float* out_w) const {
    for (int k = 0; k < K; ++k) {
      out_ids[k] = ids[in.token * K + k];
      out_w[k] = weights[in.token * K + k];
    }
  }
};

struct fuzz_case {
  std::uint64_t seed = 0;
  int policy = 0;
  layer_config cfg;
  bool given = false;             // routing supplied by the caller
  std::vector<index_t> tokens;    // per rank (may exceed max_tokens: invalid)
  std::vector<float> x;           // [sum tokens, H]
  std::vector<std::int32_t> ids;  // [R * max(T), K] by rank-major position (given)
  std::vector<float> weights;     // same
  reference::full_weights w;
  // Outcome, per rank.
  std::vector<int> error;  // 0 none, 1 config_error at construction, 2 at forward
  std::vector<std::string> message;
  std::vector<pass_stats> stats;
  std::vector<float> y;  // [sum tokens, H], prefilled with a sentinel
};

// The sentinel is a NaN with a payload no input carries: a row a valid pass leaves unwritten
// fails (NaN), and "a rejected pass wrote nothing" compares bits.
constexpr std::uint32_t sentinel_bits = 0x7fc01234u;
const float sentinel = std::bit_cast<float>(sentinel_bits);
bool untouched(float v) { return std::bit_cast<std::uint32_t>(v) == sentinel_bits; }

template <class Rng>
float odd_value(Rng& rng) {
  switch (rng() % 3) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return std::numeric_limits<float>::infinity();
    default:
      return -std::numeric_limits<float>::infinity();
  }
}

fuzz_case make_case(std::uint64_t seed, int ranks) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return lo + static_cast<int>(rng() % (hi - lo + 1)); };
  auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
  fuzz_case c;
  c.seed = seed;
  c.policy = pick(0, n_policies - 1);
  layer_config& cfg = c.cfg;
  cfg.ranks = ranks;
  cfg.hidden = pick(1, 6);
  cfg.ffn = pick(1, 5);
  cfg.experts = ranks * pick(1, 3) + (chance(3) ? 1 : 0);  // sometimes not divisible: invalid
  if (cfg.experts < K) cfg.experts = chance(50) ? K : cfg.experts;  // top_k > experts: invalid
  cfg.top_k = chance(2) ? 3 : K;                                    // != router's: invalid
  cfg.max_tokens = pick(1, 12);
  cfg.capacity_factor = chance(2) ? -1.0 : 0.25 * pick(1, 8);
  cfg.chunks = pick(0, 3);
  const int in_flight = c.policy == 1 || c.policy == 3 ? 3 : 1;  // pipelined: 3 rounds live
  cfg.max_recv_rows = chance(50) ? 0 : pick(in_flight * ranks - (chance(5) ? 1 : 0), 8 * ranks);
  c.given = chance(50);
  const bool all_to_one = chance(15);
  const int hot = pick(0, std::max(0, cfg.experts - 1));
  c.tokens.resize(static_cast<std::size_t>(ranks));
  index_t total = 0;
  for (auto& t : c.tokens) {
    t = chance(15) ? 0 : pick(1, cfg.max_tokens);
    if (chance(2)) t = cfg.max_tokens + 1;  // too many tokens: invalid input
    total += t;
  }
  const index_t H = cfg.hidden;
  c.x = reference::random_tokens(total, H, seed ^ 0x78);
  if (all_to_one && !c.given)
    for (float& v : c.x) v = std::abs(v) + 0.25f;
  if (chance(10))  // non-finite token entries: NaN/Inf logits for that token
    for (int n = pick(1, 3); n > 0 && total > 0; --n) c.x[rng() % c.x.size()] = odd_value(rng);
  const index_t width = std::max<index_t>(1, *std::max_element(c.tokens.begin(), c.tokens.end()));
  c.ids.resize(static_cast<std::size_t>(ranks * width * K));
  c.weights.resize(c.ids.size());
  const bool bad_ids = chance(8), bad_weights = chance(8);
  for (std::size_t i = 0; i < c.ids.size(); ++i) {
    c.ids[i] = all_to_one && i % K == 0 ? hot : pick(-1, std::max(0, cfg.experts - 1));
    if (i % K == 1 && c.ids[i] == c.ids[i - 1] && c.ids[i] >= 0 && !chance(3))
      c.ids[i] = (c.ids[i] + 1) % std::max(1, cfg.experts);  // mostly distinct, as routers give
    c.weights[i] = static_cast<float>(pick(0, 16)) / 16.f;
  }
  if (bad_ids) c.ids[rng() % c.ids.size()] = chance(50) ? cfg.experts + pick(0, 3) : -2;
  if (bad_weights) c.weights[rng() % c.weights.size()] = chance(50) ? -0.5f : odd_value(rng);
  layer_config wcfg = cfg;
  wcfg.experts = std::max(1, cfg.experts);
  wcfg.top_k = std::min(wcfg.top_k, wcfg.experts);
  c.w = reference::full_weights::random(wcfg, seed ^ 0x77);
  if (all_to_one && !c.given)
    for (int h = 0; h < H; ++h) c.w.gate[hot * H + h] = 1.f;
  c.error.assign(static_cast<std::size_t>(ranks), 0);
  c.message.assign(static_cast<std::size_t>(ranks), "");
  c.stats.assign(static_cast<std::size_t>(ranks), pass_stats{});
  c.y.assign(c.x.size(), sentinel);
  return c;
}

bool config_valid(const fuzz_case& c) {
  const layer_config& cfg = c.cfg;
  if (cfg.top_k != K || cfg.experts < K || cfg.experts % cfg.ranks != 0) return false;
  if (!(cfg.capacity_factor > 0)) return false;
  if (cfg.max_recv_rows > 0) {
    const int in_flight = (c.policy == 0 || c.policy == 2 || c.policy == 4) ? 1 : 3;
    if (c.policy == 3) return false;  // padded: no bound (dedup: windows of tokens)
    if (cfg.max_recv_rows < cfg.ranks * in_flight) return false;
  }
  return true;
}

bool input_valid(const fuzz_case& c) {
  const index_t width = std::max<index_t>(1, *std::max_element(c.tokens.begin(), c.tokens.end()));
  for (int r = 0; r < c.cfg.ranks; ++r) {
    const index_t T = c.tokens[r];
    if (T > c.cfg.max_tokens) return false;
    if (!c.given) continue;
    for (index_t i = 0; i < T * K; ++i) {
      const std::size_t at = static_cast<std::size_t>(r * width * K + i);
      const int e = c.ids[at];
      const float w = c.weights[at];
      if (e < -1 || e >= c.cfg.experts || !std::isfinite(w) || w < 0) return false;
      for (index_t q = i - i % K; q < i; ++q)
        if (e != -1 && c.ids[at - (i - q)] == e) return false;  // a repeated expert
    }
  }
  return true;
}

index_t offset_of(const fuzz_case& c, int r) {
  index_t o = 0;
  for (int q = 0; q < r; ++q) o += c.tokens[q];
  return o;
}

template <class P>
void run_rank(fuzz_case& c, comm::threads comm) {
  const int r = comm.rank();
  const layer_config& cfg = c.cfg;
  const index_t T = c.tokens[r], H = cfg.hidden;
  std::unique_ptr<moe_layer<P>> layer;
  try {
    // Weights of this rank. A config the layer rejects (E % R != 0) still gets views in
    // range: it throws on every rank before reading them.
    const int E = std::max(1, cfg.experts), R = cfg.ranks;
    const int L = std::max(1, E / R);
    const stacked_view<const float> w1(c.w.w1.data() + std::min(r * L, E - 1) * cfg.ffn * H, L,
                                       cfg.ffn, H);
    const stacked_view<const float> w3(c.w.w3.data() + std::min(r * L, E - 1) * cfg.ffn * H, L,
                                       cfg.ffn, H);
    const stacked_view<const float> w2(c.w.w2.data() + std::min(r * L, E - 1) * H * cfg.ffn, L, H,
                                       cfg.ffn);
    layer = std::make_unique<moe_layer<P>>(
        cfg, comm, typename moe_layer<P>::weights{c.w.gate_view(), {w1, w3, w2}});
  } catch (const config_error& e) {
    c.error[r] = 1;
    c.message[r] = e.what();
    return;
  }
  const index_t off = offset_of(c, r);
  const matrix_view<const float> x(c.x.data() + off * H, T, H);
  const matrix_view<float> y(c.y.data() + off * H, T, H);
  try {
    if (c.given) {
      const index_t width =
          std::max<index_t>(1, *std::max_element(c.tokens.begin(), c.tokens.end()));
      const std::size_t at = static_cast<std::size_t>(r * width * K);
      layer->forward(x, routing_view{{c.ids.data() + at, T, K}, {c.weights.data() + at, T, K}}, y);
    } else {
      layer->forward(x, y);
    }
    c.stats[r] = layer->stats();
  } catch (const config_error& e) {
    c.error[r] = 2;
    c.message[r] = e.what();
  }
}

void run_case(fuzz_case& c, comm::threads comm) {
  switch (c.policy) {
    case 0:
      return run_rank<p_seq>(c, comm);
    case 1:
      return run_rank<p_pipe>(c, comm);
    case 2:
      return run_rank<p_factor>(c, comm);
    case 3:
      return run_rank<p_padded>(c, comm);
    default:
      return run_rank<p_dedup>(c, comm);
  }
}

[[noreturn]] void fail(const fuzz_case& c, const std::string& what) {
  std::fprintf(stderr,
               "epmoe_fuzz: FAILED seed %llu (policy %d, R %d, E %d, H %d, F %d, max_tokens %d, "
               "chunks %d, max_recv_rows %d, given %d): %s\n",
               static_cast<unsigned long long>(c.seed), c.policy, c.cfg.ranks, c.cfg.experts,
               c.cfg.hidden, c.cfg.ffn, c.cfg.max_tokens, c.cfg.chunks, c.cfg.max_recv_rows,
               int(c.given), what.c_str());
  std::abort();
}

// The reference of a valid case (capacity as the policy applies it).
std::vector<float> reference_of(const fuzz_case& c) {
  std::vector<float> y(c.x.size());
  const index_t n = static_cast<index_t>(c.x.size()) / c.cfg.hidden, H = c.cfg.hidden;
  const bool factor = c.policy == 2 || c.policy == 3;
  auto go = [&](const auto& router) {
    if (factor)
      reference::forward(c.w, router, capacity::factor<false>{}, {c.x.data(), n, H}, c.tokens,
                         {y.data(), n, H});
    else
      reference::forward(c.w, router, capacity::dropless{}, {c.x.data(), n, H}, c.tokens,
                         {y.data(), n, H});
  };
  if (c.given) {
    // The table is indexed by global position r * max_tokens + t: re-lay it out so.
    const index_t width = std::max<index_t>(1, *std::max_element(c.tokens.begin(), c.tokens.end()));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(c.cfg.ranks * c.cfg.max_tokens * K));
    std::vector<float> w(ids.size());
    for (int r = 0; r < c.cfg.ranks; ++r)
      for (index_t i = 0; i < c.tokens[r] * K; ++i) {
        ids[r * c.cfg.max_tokens * K + i] = c.ids[r * width * K + i];
        w[r * c.cfg.max_tokens * K + i] = c.weights[r * width * K + i];
      }
    go(table_router{ids.data(), w.data()});
  } else {
    go(router::topk_softmax<K>{});
  }
  return y;
}

// What the inputs exercised, for the summary line.
struct tally {
  long long bad_config = 0, bad_input = 0, valid = 0, rounds = 0, drops = 0, non_finite = 0,
            empty = 0, given = 0;
};

void check_case(const fuzz_case& c, tally& seen) {
  const int R = c.cfg.ranks;
  const bool cfg_ok = config_valid(c), in_ok = input_valid(c);
  for (int r = 0; r < R; ++r) {
    if (!cfg_ok && c.error[r] != 1) fail(c, "invalid config not rejected at construction");
    if (cfg_ok && c.error[r] == 1) fail(c, "valid config rejected: " + c.message[r]);
    if (cfg_ok && !in_ok && c.error[r] != 2) fail(c, "invalid input not rejected on every rank");
    if (cfg_ok && in_ok && c.error[r] != 0) fail(c, "valid input rejected: " + c.message[r]);
  }
  seen.given += c.given;
  seen.bad_config += !cfg_ok;
  seen.bad_input += cfg_ok && !in_ok;
  if (!cfg_ok || !in_ok) {
    for (float v : c.y)
      if (!untouched(v)) fail(c, "a rejected pass wrote to an output");
    return;
  }
  ++seen.valid;
  bool rounds = false, drops = false, finite = true, empty = false;
  for (int r = 0; r < R; ++r) {
    rounds |= c.stats[r].rounds > 1;
    drops |= c.stats[r].dropped > 0;
    empty |= c.tokens[r] == 0;
  }
  for (float v : c.x) finite &= std::isfinite(v);
  seen.rounds += rounds, seen.drops += drops, seen.non_finite += !finite, seen.empty += empty;
  // Conservation and drops.
  index_t sent = 0, received = 0, computed = 0, kept = 0;
  for (int r = 0; r < R; ++r) {
    const pass_stats& s = c.stats[r];
    index_t routed = 0;
    for (index_t n : s.routed_per_expert) routed += n;
    if (routed != s.assignments) fail(c, "routed_per_expert does not sum to assignments");
    if (s.dropped < 0 || s.dropped > s.assignments) fail(c, "dropped out of range");
    if ((c.policy == 0 || c.policy == 1 || c.policy == 4) && s.dropped != 0)
      fail(c, "dropless dropped");
    for (index_t n : s.assignment_rows_sent) sent += n;
    for (index_t n : s.assignment_rows_received) received += n;
    for (index_t n : s.rows_per_local_expert) computed += n;
    kept += s.assignments - s.dropped;
    if (c.cfg.max_recv_rows > 0 &&
        (s.peak_recv_rows > c.cfg.max_recv_rows || s.recv_buffer_rows > c.cfg.max_recv_rows))
      fail(c, "receive bound exceeded");
  }
  if (c.policy != 3 && sent != kept) fail(c, "rows sent != assignments kept");
  if (sent != received) fail(c, "rows sent != rows received over all ranks");
  if (computed != kept) fail(c, "rows computed != assignments kept");
  // Outputs: the reference where the token is finite.
  const std::vector<float> want = reference_of(c);
  const index_t H = c.cfg.hidden, n = static_cast<index_t>(c.x.size()) / H;
  double scale = 1e-3;
  for (float v : want)
    if (std::isfinite(v)) scale = std::max(scale, double(std::abs(v)));
  for (index_t t = 0; t < n; ++t) {
    bool finite = true;
    for (index_t h = 0; h < H; ++h) {
      finite &= std::isfinite(c.x[t * H + h]);
      if (untouched(c.y[t * H + h])) fail(c, "token " + std::to_string(t) + "'s row not written");
    }
    if (!finite) continue;
    for (index_t h = 0; h < H; ++h) {
      const float got = c.y[t * H + h];
      if (!std::isfinite(got)) fail(c, "non-finite output for a finite token");
      if (std::abs(double(got) - want[t * H + h]) > 1e-4 * scale)
        fail(c, "output differs from the reference at token " + std::to_string(t));
    }
  }
}

// Runs cases [first, first + count) of `ranks` ranks in one threads world.
void run_batch(std::uint64_t seed, std::uint64_t first, int count, int ranks, tally& n) {
  std::vector<fuzz_case> cases;
  cases.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i)
    cases.push_back(make_case(seed * 0x9e3779b97f4a7c15ull + first + i, ranks));
  comm::threads_world world(ranks);
  world.run([&](comm::threads comm) {
    for (auto& c : cases) run_case(c, comm);
  });
  for (const auto& c : cases) check_case(c, n);
}

}  // namespace

#ifdef EPMOE_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint64_t seed = 1469598103934665603ull;
  for (std::size_t i = 0; i < size; ++i) seed = (seed ^ data[i]) * 1099511628211ull;
  tally n;
  run_batch(seed, 0, 1, 1 + static_cast<int>(seed % 4), n);
  return 0;
}
#else
int main(int argc, char** argv) {
  long long runs = 1000;
  std::uint64_t seed = 1;
  bool quiet = false;
  cli::command_line cl(argc, argv,
                       "usage: epmoe_fuzz [--runs N] [--seed S] [--quiet]\n"
                       "  Runs N random configs and inputs (seeded by S) through the layer and\n"
                       "  checks each against the reference; aborts on the first failure.\n");
  while (cl.next()) {
    if (cl.is("--runs"))
      runs = cl.integer();
    else if (cl.is("--seed"))
      seed = static_cast<std::uint64_t>(cl.integer());
    else if (cl.is("--quiet"))
      quiet = true;
    else
      cl.unknown();
  }
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int batch = 256;
  long long done = 0;
  tally n;
  for (std::uint64_t b = 0; done < runs; ++b) {
    const int count = static_cast<int>(std::min<long long>(batch, runs - done));
    run_batch(seed, static_cast<std::uint64_t>(done), count, 1 + static_cast<int>(b % 4), n);
    done += count;
    if (!quiet && (b + 1) % 100 == 0)
      std::printf("epmoe_fuzz: %lld inputs\n", done), std::fflush(stdout);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "epmoe_fuzz: %lld inputs (seed %llu) passed every check in %.1f s: %lld invalid configs, "
      "%lld invalid inputs, %lld valid (%lld split in rounds, %lld with drops, %lld with "
      "NaN/Inf tokens, %lld with an idle rank); %lld with a given routing\n",
      done, static_cast<unsigned long long>(seed), s, n.bad_config, n.bad_input, n.valid, n.rounds,
      n.drops, n.non_finite, n.empty, n.given);
  return 0;
}
#endif
