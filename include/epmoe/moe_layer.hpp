// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/comm/local.hpp"
#include "epmoe/core/agreement.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/placement/relocate.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/router/route.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/schedule/sequential.hpp"
#include "epmoe/space/host.hpp"

namespace epmoe {

/// The policy bundle a layer starts from; derive and override the slots you change:
///   struct my_policies : epmoe::default_policies { using comm = epmoe::comm::threads; };
struct default_policies {
  using space = space::host;
  using router = router::topk_softmax<2>;
  using placement = placement::block;
  using capacity = capacity::dropless;
  using comm = comm::local;
  using expert = expert::swiglu;
  using schedule = schedule::sequential;
};

/// One rank's share of an expert-parallel MoE layer.
///
/// Each forward pass routes the rank's T tokens, sends every (token, expert) row to the rank
/// holding that expert (all-to-all #1), runs the local experts on what arrives, returns the
/// outputs (all-to-all #2) and sums each token's K outputs, weighted, at home. Every rank of
/// the communicator calls forward() the same number of times (T may differ, even be 0).
/// All workspace is allocated at construction from `max_tokens`; forward allocates nothing.
template <class Policies = default_policies>
class moe_layer {
 public:
  using space_type = typename Policies::space;
  using router_type = typename Policies::router;
  using placement_type = typename Policies::placement;
  using capacity_type = typename Policies::capacity;
  using comm_type = typename Policies::comm;
  using expert_type = typename Policies::expert;
  using schedule_type = typename Policies::schedule;

  static_assert(space_policy<space_type>,
                "epmoe: the space policy must provide allocate<T>(n) returning a buffer with "
                "data(), gemm_nt(a, b, c) and synchronize() (see space/host.hpp)");
  static_assert(router_policy<router_type>,
                "epmoe: the router policy must provide `static constexpr int top_k`, "
                "`static constexpr bool uses_gate` and either route_token(const token_input&, "
                "int* ids, float* weights) const (see router/topk_softmax.hpp) or "
                "route_batch(...) with scratch_floats/scratch_ints (see router/expert_choice.hpp)");
  static_assert(placement_policy<placement_type>,
                "epmoe: the placement policy must be constructible from layer_config and "
                "provide slots_per_rank(), expert_at(rank, j) and slot_for(expert, home rank, "
                "token id) (see placement/block.hpp)");
  static_assert(capacity_policy<capacity_type>,
                "epmoe: the capacity policy must provide `static constexpr bool pads` and "
                "limit(const layer_config&, index_t tokens) const (see capacity/factor.hpp)");
  static_assert(communicator<comm_type>,
                "epmoe: the comm policy must provide rank(), size(), alltoall(send, recv, n) "
                "and alltoallv(send, counts, displs, recv, counts, displs) (see comm/local.hpp)");
  static_assert(expert_policy<expert_type>,
                "epmoe: the expert policy must provide a `weights` type and static "
                "validate(cfg, w), validate(w, count, hidden, ffn, name), flops_per_row(hidden, "
                "ffn), scratch_per_row(ffn) and forward(space, w, j, rows, scratch) (see "
                "expert/swiglu.hpp)");
  /// Whether the comm can start an exchange and wait for it later (ialltoallv); without it
  /// every exchange blocks and a pipelined schedule has nothing to overlap.
  static constexpr bool async_comm = detail::exchange<comm_type, space_type, false>::async;
  using request_type = typename detail::request_of<comm_type, async_comm>::type;

  /// Per-rank dedup (Policies::dedup = true): a token sends one row to each rank that holds
  /// any of its experts, that rank returns one weighted sum (as DeepEP and Tutel do).
  static constexpr bool dedup = requires { requires Policies::dedup; };

  /// Exchange units a schedule keeps in flight: with config max_recv_rows the receive buffer
  /// holds this many rounds at once (sequential: one; pipelined: dispatch of i+1, experts of
  /// i, combine of i-1). A schedule may declare `static constexpr int units_in_flight`.
  static constexpr int units_in_flight = [] {
    if constexpr (requires { schedule_type::units_in_flight; })
      return static_cast<int>(schedule_type::units_in_flight);
    else
      return std::is_same_v<schedule_type, schedule::sequential> ? 1 : 3;
  }();
  static_assert(!(dedup && capacity_type::pads),
                "epmoe: per-rank dedup sends one row per (token, rank), which does not combine "
                "with padded capacity (fixed rows per expert): use capacity::factor<false> or "
                "capacity::dropless with dedup");

  static_assert(schedule_policy<schedule_type>,
                "epmoe: the schedule policy must provide static run(stages&) calling route, "
                "plan, permute, shared, counts, then per chunk dispatch_start/wait, experts, "
                "combine_start/wait, then reduce (see schedule/sequential.hpp)");

  /// The weights one rank holds (non-owning; they must outlive the layer).
  struct weights {
    matrix_view<const float> gate;           // [E, H] router gate, the same on every rank
    typename expert_type::weights experts;   // this rank's L = E/R experts
    typename expert_type::weights shared{};  // [N] shared experts (config shared_experts)
    matrix_view<const float> noise_gate{};   // [E, H] noisy top-k's noise projection
  };

  /// Validates everything (throws config_error naming the field), agrees with the other
  /// ranks (collective), and sizes the workspace. The placement defaults to
  /// placement_type(cfg); `w.experts` holds this rank's slots in local-slot order.
  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router = {},
            capacity_type capacity = {})
      : moe_layer(cfg, std::move(comm), w, router, capacity, placement_type(cfg)) {}

  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router,
            capacity_type capacity, placement_type placement, space_type space = {})
      : cfg_(agreed(cfg, comm, w, router, placement)),
        comm_(std::move(comm)),
        w_(w),
        router_(router),
        capacity_(capacity),
        space_(space),
        placement_(std::move(placement)),
        stats_(cfg_.experts, placement_.slots_per_rank(), cfg_.ranks),
        width_(router_type::top_k > 0 ? router_type::top_k : cfg_.experts) {
    chunks_max_ = chunks_ = cfg_.chunks > 0 ? cfg_.chunks : default_chunks();
    ex_.bind(&comm_, &space_, &plan_, &stats_, &pass_start_);
    allocate_workspace();
    adopt_router_bias();  // a bias given with the router starts the layer's own
  }

  /// Chunks of the next passes (1 .. the config's chunks, or the schedule's default): the
  /// run-time override of a pipelined schedule's overlap degree. Every rank must set the same.
  void set_chunks(int chunks) {
    detail::require(
        chunks >= 1 && chunks <= chunks_max_, "chunks", chunks,
        ("must be in [1, " + std::to_string(chunks_max_) + "] (config chunks sizes the workspace)")
            .c_str());
    chunks_ = chunks;
  }
  int chunks() const { return chunks_; }

  moe_layer(const moe_layer&) = delete;
  moe_layer& operator=(const moe_layer&) = delete;

  /// y [T, H] = MoE(x [T, H]), T <= max_tokens, row-major with row strides. Collective:
  /// every rank calls it, each with its own T (0 is fine). token_ids [T] are the tokens'
  /// vocabulary ids, needed by routers that hash them (router::hash); other routers use
  /// them, when given, as the token's identity for seeded training noise. Invalid inputs
  /// throw config_error on this rank and input_error on every peer, before any row moves
  /// and with y untouched.
  void forward(matrix_view<const float> x, matrix_view<float> y,
               std::span<const std::int64_t> token_ids = {}) {
    std::exception_ptr bad;
    try {
      check_inputs(x, y);
      if constexpr (router_needs_token_ids<router_type>)
        detail::require(token_ids.size() == static_cast<std::size_t>(x.rows), "token_ids",
                        token_ids.size(), "this router hashes token ids: pass one per token");
      else
        detail::require(token_ids.empty() || token_ids.size() == static_cast<std::size_t>(x.rows),
                        "token_ids", token_ids.size(), "must be empty or one id per token");
      if constexpr (router_with_noise_gate<router_type>)
        if (router_.training)
          detail::require_shape(w_.noise_gate, cfg_.experts, cfg_.hidden, "weights.noise_gate");
      // The router may have changed since the last pass (router(), router_bias()): a bad
      // setting is rejected here, on every rank, not mid-pass on one.
      if constexpr (router_with_bias<router_type>) adopt_router_bias();
      if constexpr (router_with_validate<router_type>) router_.validate(cfg_);
    } catch (const config_error&) {
      bad = std::current_exception();
    }
    run_pass(x, y, token_ids, nullptr, bad);
  }

  /// The same with the routing given instead of computed: ids [T, K] in [0, E) (or
  /// no_expert = -1 for an empty slot), distinct within a token, weights [T, K] finite and >= 0, K
  /// = the router's top_k (E for expert choice). The router and its gate are not used; losses are
  /// zero. A bad entry throws input_error naming it ("routing.ids[5][1] = 99: must be in [0, 64)")
  /// on this rank and input_error on every peer, before any row moves; y is untouched.
  void forward(matrix_view<const float> x, routing_view routing, matrix_view<float> y) {
    std::exception_ptr bad;
    try {
      check_inputs(x, y);
      check_routing(routing, x.rows);
    } catch (const config_error&) {
      bad = std::current_exception();
    }
    run_pass(x, y, {}, &routing, bad);
  }

  const layer_config& config() const { return cfg_; }
  const pass_stats& stats() const { return stats_; }
  const placement_type& placement() const { return placement_; }
  const comm_type& comm() const { return comm_; }
  int rank() const { return comm_.rank(); }
  /// The router, to inspect or change its settings (e.g. `training`) between passes; they
  /// are checked at the next forward. For sigmoid_bias, `router().bias` points at the
  /// layer's bias (router_bias()); pointing it at other values loads those at the next pass.
  router_type& router() { return router_; }
  const router_type& router() const { return router_; }
  /// Expert ids and weights of the last pass, [T, slots]; empty slots hold no_expert.
  routing_view last_routing() const { return {ids_view(tokens_), weights_view(tokens_)}; }
  /// Rows of the receive buffer: with config max_recv_rows at most that, else R*T*min(K, L).
  index_t receive_buffer_rows() const { return ex_.receive_buffer_rows(); }
  /// Where each assignment of the last pass went.
  const dispatch_plan& last_plan() const { return plan_; }
  /// Which assignments of the last pass capacity dropped: mask(t, k) for t < T, k < slots
  /// (the last_routing() shape); empty slots are not drops; count() == stats().dropped. A
  /// view of the plan (no copy): valid until the next pass.
  drop_mask dropped() const { return {plan_.slot, plan_.phys, tokens_, width_}; }
  /// Passes run so far (the counter behind seeded training noise).
  std::uint64_t passes() const { return pass_; }

  /// The router's per-expert selection bias [E] (routers with has_bias), the layer's own
  /// copy: read it, or write a trained model's bias into it (checked at the next forward).
  /// It starts as the constructor's router.bias (or zeros). Every rank must hold the same.
  std::span<float> router_bias() requires router_with_bias<router_type> {
    adopt_router_bias();
    return {bias_.data(), static_cast<std::size_t>(cfg_.experts)};
  }

  /// Collective live re-placement (placement::table): switches to `next` (same experts,
  /// ranks and slots per rank; the same table on every rank), moving the weights of every
  /// slot whose expert changes from a rank that holds that expert now, through the
  /// communicator. From the first call on the layer keeps its own copy of its slots'
  /// weights. The move lands in staging first, so a pass sees either the old table and
  /// weights or the new ones. Returns the bytes of weights this rank's slots received.
  index_t apply_placement(
      const placement::table& next) requires std::same_as<placement_type, placement::table> {
    auto views = expert_tensors(w_.experts);
    std::array<stacked_view<float>, std::tuple_size_v<decltype(views)>> owned;
    for (std::size_t k = 0; k < views.size(); ++k) {
      stacked_view<const float>& v = *views[k];
      if (owned_experts_.size() < views.size()) {  // first move: a copy the layer may write
        owned_experts_.push_back(space_.template allocate<float>(v.count * v.batch_stride));
        copy_stack(v, owned_experts_.back().data());
        v = {owned_experts_.back().data(), v.count, v.rows, v.cols, v.stride, v.batch_stride};
      }
      owned[k] = {owned_experts_[k].data(), v.count, v.rows, v.cols, v.stride, v.batch_stride};
    }
    const index_t received = placement::relocate(comm_, placement_, next, owned);
    placement_ = next;
    return received;
  }

  /// The last pass seen by all ranks (collective, one all-to-all): rows per logical expert
  /// summed over ranks, and real rows each rank's experts computed.
  struct global_load {
    std::vector<index_t> per_expert;  // [E]
    std::vector<index_t> per_rank;    // [R]
    imbalance experts, ranks;         // the straggler's excess is ranks.excess
  };
  global_load gather_load() {
    const int R = cfg_.ranks, E = cfg_.experts, W = E + 1;
    std::vector<index_t> send(static_cast<std::size_t>(R * W)), recv(send.size());
    index_t computed = 0;
    for (index_t n : stats_.rows_per_local_expert) computed += n;
    for (int r = 0; r < R; ++r) {
      std::copy_n(stats_.routed_per_expert.begin(), E, send.begin() + r * W);
      send[static_cast<std::size_t>(r * W + E)] = computed;
    }
    comm_.alltoall(send.data(), recv.data(), W);
    global_load g{std::vector<index_t>(E, 0), std::vector<index_t>(R, 0), {}, {}};
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < E; ++e) g.per_expert[e] += recv[static_cast<std::size_t>(r * W + e)];
      g.per_rank[r] = recv[static_cast<std::size_t>(r * W + E)];
    }
    g.experts = imbalance::of(g.per_expert);
    g.ranks = imbalance::of(g.per_rank);
    return g;
  }

  /// Collective: sums the last pass's per-expert load over all ranks and applies the
  /// router's bias update (DeepSeek-V3 aux-loss-free balancing). Returns the global load.
  std::span<const index_t> update_router() requires router_with_bias<router_type> {
    const int R = cfg_.ranks, E = cfg_.experts;
    // An all-reduce through the comm's all-to-all: send the local load to every rank.
    for (int r = 0; r < R; ++r)
      std::copy_n(plan_.routed, E, load_send_.begin() + static_cast<std::size_t>(r) * E);
    comm_.alltoall(load_send_.data(), load_recv_.data(), E);
    for (int e = 0; e < E; ++e) {
      index_t sum = 0;
      for (int r = 0; r < R; ++r) sum += load_recv_[static_cast<std::size_t>(r) * E + e];
      global_load_[static_cast<std::size_t>(e)] = sum;
    }
    router_.update_bias(router_bias(), global_load_);
    return global_load_;
  }

 private:
  using clock = std::chrono::steady_clock;
  template <class T>
  using buffer = typename space_type::template buffer<T>;

  static int default_chunks() {
    if constexpr (requires { schedule_type::default_chunks; })
      return schedule_type::default_chunks;
    else
      return 1;
  }

  static double seconds_since(clock::time_point t) {
    return std::chrono::duration<double>(clock::now() - t).count();
  }

  void check_inputs(matrix_view<const float> x, matrix_view<float> y) const {
    detail::require(x.rows <= cfg_.max_tokens, "x.rows", x.rows,
                    "tokens per pass must be <= config max_tokens");
    detail::require_shape(x, x.rows, cfg_.hidden, "x");
    detail::require_shape(y, x.rows, cfg_.hidden, "y");
  }

  // Every entry of a user-supplied routing, before anything is written.
  void check_routing(routing_view r, index_t T) const {
    detail::require_shape(r.ids, T, width_, "routing.ids");
    detail::require_shape(r.weights, T, width_, "routing.weights");
    const auto at = [](const char* field, index_t t, int k) {
      return std::string(field) + "[" + std::to_string(t) + "][" + std::to_string(k) + "]";
    };
    for (index_t t = 0; t < T; ++t)
      for (int k = 0; k < width_; ++k) {
        const std::int32_t e = r.ids(t, k);
        if (e != no_expert && (e < 0 || e >= cfg_.experts))
          throw input_error(
              at("routing.ids", t, k), std::to_string(e),
              "must be in [0, " + std::to_string(cfg_.experts) + ") or -1 (an empty slot)");
        for (int q = 0; q < k; ++q)  // buffers hold at most one row per (token, expert)
          if (e != no_expert && r.ids(t, q) == e)
            throw input_error(
                at("routing.ids", t, k), std::to_string(e),
                "repeats " + at("routing.ids", t, q) + ": a token's experts must be distinct");
        const float w = r.weights(t, k);
        if (!(std::isfinite(w) && w >= 0))
          throw input_error(at("routing.weights", t, k), detail::to_text(w),
                            "must be finite and >= 0");
      }
  }

  // One pass. `bad` holds this rank's input error, if any: the rank then runs an empty pass
  // up to the counts exchange, which tells every rank, and all throw before a row moves.
  void run_pass(matrix_view<const float> x, matrix_view<float> y,
                std::span<const std::int64_t> token_ids, const routing_view* routing,
                std::exception_ptr bad) {
    input_error_ = bad;
    x_ = bad ? matrix_view<const float>{x.data, 0, cfg_.hidden, x.stride} : x;
    y_ = y;
    token_ids_ = bad ? std::span<const std::int64_t>{} : token_ids;
    given_ = bad ? nullptr : routing;
    plan_.chunks = chunks_;
    stats_.time = {};
    stats_.began = {};
    stats_.expert_flops = stats_.comm_seconds = stats_.exposed_comm_seconds = stats_.overlap = 0;
    stats_.timeline.clear();  // keeps its capacity: no allocation
    stats_.chunks = chunks_;
    pass_start_ = clock::now();
    stats_.started = std::chrono::duration<double>(pass_start_ - built_).count();
    const auto start = clock::now();
    stage_runner stages{*this};
    schedule_type::run(stages);
    space_.synchronize();
    stats_.time.total = seconds_since(start);
    ++pass_;
  }

  static const layer_config& checked(const layer_config& cfg, const comm_type& comm,
                                     const weights& w, const router_type& router,
                                     const placement_type& placement) {
    check_layer_policies(cfg, comm.size(), router, placement);
    if constexpr (router_type::uses_gate)
      detail::require_shape(w.gate, cfg.experts, cfg.hidden, "weights.gate");
    expert_type::validate(w.experts, placement.slots_per_rank(), cfg.hidden, cfg.ffn,
                          "weights.experts");
    if (cfg.shared_experts > 0)
      expert_type::validate(w.shared, cfg.shared_experts, cfg.hidden, cfg.shared_width(),
                            "weights.shared");
    if (cfg.max_recv_rows > 0) {
      detail::require(!capacity_type::pads, "max_recv_rows", cfg.max_recv_rows,
                      "must be 0 with padded capacity (its blocks are fixed): use "
                      "capacity::dropless or capacity::factor<false> for a receive bound");
      detail::require(!dedup, "max_recv_rows", cfg.max_recv_rows,
                      "must be 0 with per-rank dedup (rounds split assignment rows, not unique "
                      "rows): use dedup = false for a receive bound");
      detail::require(cfg.max_recv_rows >= cfg.ranks * units_in_flight, "max_recv_rows",
                      cfg.max_recv_rows,
                      ("must be >= ranks * " + std::to_string(units_in_flight) +
                       " (rounds this schedule keeps in flight): every pair moves a row per round")
                          .c_str());
    }
    return cfg;
  }

  // Collective start-up check: every rank validates its own inputs, then all ranks compare
  // their configs and policy bundle in one exchange. Any failure or difference makes every
  // rank throw (the failing rank its own error), so no rank is left waiting in an exchange.
  static const layer_config& agreed(const layer_config& cfg, comm_type& comm, const weights& w,
                                    const router_type& router, const placement_type& placement) {
    agree_on_layer<Policies>(cfg, comm, placement,
                             [&] { checked(cfg, comm, w, router, placement); });
    return cfg;
  }

  // The stacked tensors of an expert weight bundle (SwiGLU: w1, w3, w2), to move them.
  static auto expert_tensors(typename expert_type::weights& w) {
    static_assert(
        requires {
          w.w1;
          w.w3;
          w.w2;
        },
        "epmoe: apply_placement moves expert weights with members w1, w3, w2 "
        "(stacked_view); teach expert_tensors about this expert's weights");
    return std::array<stacked_view<const float>*, 3>{&w.w1, &w.w3, &w.w2};
  }

  static void copy_stack(const stacked_view<const float>& v, float* out) {
    for (index_t s = 0; s < v.count; ++s)
      for (index_t i = 0; i < v.rows; ++i)
        std::copy_n(v[s].row(i), v.cols, out + s * v.batch_stride + i * v.stride);
  }

  // The router reads the layer's bias; values it was pointed at instead (the constructor's
  // router, router().bias = p) are copied in first, so no setting is silently dropped.
  void adopt_router_bias() {
    if constexpr (router_with_bias<router_type>) {
      float* own = bias_.data();
      if (router_.bias == own) return;
      if (router_.bias)
        std::copy_n(router_.bias, cfg_.experts, own);
      else
        std::fill_n(own, cfg_.experts, 0.f);
      router_.bias = own;
    }
  }

  void allocate_workspace() {
    const index_t T = cfg_.max_tokens, K = width_, E = cfg_.experts, R = cfg_.ranks;
    const index_t L = placement_.slots_per_rank(), H = cfg_.hidden;
    // Rows one source sends one expert: bounded by capacity, and by T (distinct experts).
    index_t per_expert = std::min(T, capacity_.limit(cfg_, T));
    if constexpr (requires { router_type::capacity(cfg_, T); })
      per_expert = std::min(per_expert, router_type::capacity(cfg_, T));  // expert choice
    const index_t per_expert_buf = capacity_type::pads ? capacity_.limit(cfg_, T) : per_expert;
    const index_t send_rows =
        capacity_type::pads ? R * L * per_expert_buf : std::min(T * K, R * L * per_expert);
    const index_t from_one_rank =
        capacity_type::pads ? L * per_expert_buf : std::min(T * std::min(K, L), L * per_expert);
    const index_t recv_rows = R * from_one_rank;
    index_t expert_rows = R * per_expert_buf;
    const index_t M = cfg_.max_recv_rows;
    const index_t quota = M > 0 ? std::max<index_t>(1, M / (R * units_in_flight)) : 0;
    if (M > 0) expert_rows = std::min(expert_rows, R * std::min(quota, from_one_rank));
    const index_t N = cfg_.shared_experts;

    const bool gate = router_type::uses_gate;
    logits_ = space_.template allocate<float>(gate ? T * E : 0);
    if constexpr (router_with_noise_gate<router_type>)
      noise_logits_ = space_.template allocate<float>(T * E);
    if constexpr (router_with_jitter<router_type>)
      gate_input_ = space_.template allocate<float>(T * H);
    if constexpr (batch_router<router_type>) {
      batch_floats_ = space_.template allocate<float>(router_type::scratch_floats(cfg_));
      batch_ints_ = space_.template allocate<std::int32_t>(router_type::scratch_ints(cfg_));
    }
    if constexpr (router_type::uses_gate && has_probabilities<router_type>) {
      loss_probs_.resize(static_cast<std::size_t>(T * E));
      loss_acc_.resize(static_cast<std::size_t>(2 * E));
    }
    if constexpr (router_with_bias<router_type>) {
      bias_ = space_.template allocate<float>(E);
      load_send_.resize(static_cast<std::size_t>(R * E));
      load_recv_.resize(static_cast<std::size_t>(R * E));
      global_load_.resize(static_cast<std::size_t>(E));
    }
    ids_ = space_.template allocate<std::int32_t>(T * K);
    weights_ = space_.template allocate<float>(T * K);
    slot_ = space_.template allocate<std::int32_t>(T * K);
    phys_ = space_.template allocate<std::int32_t>(T * K);
    row_token_ = space_.template allocate<std::int32_t>(send_rows);
    const index_t C = chunks_max_, B = C * R * L;
    counts_ = space_.template allocate<index_t>(7 * B + 2 + R * L + C * L + 1 + E);
    if constexpr (dedup) {
      unique_slot_ = space_.template allocate<std::int32_t>(T * K);
      unique_token_ = space_.template allocate<std::int32_t>(T * std::min(K, R));
      unique_counts_ = space_.template allocate<index_t>(4 * C * R + 2);
      meta_ = space_.template allocate<std::int64_t>(send_rows);
      meta_recv_ = space_.template allocate<std::int64_t>(M > 0 ? 0 : recv_rows);
      plan_.unique_slot = unique_slot_.data();
      plan_.unique_token = unique_token_.data();
      plan_.unique_counts = unique_counts_.data();
      plan_.unique_offsets = plan_.unique_counts + C * R;
      plan_.recv_unique_counts = plan_.unique_offsets + C * R + 1;
      plan_.recv_unique_offsets = plan_.recv_unique_counts + C * R;
      plan_.meta = meta_.data();
      plan_.meta_recv = meta_recv_.data();
    }
    typename exchange_type::shape shape;
    shape.ranks = cfg_.ranks;
    shape.local_experts = static_cast<int>(L);
    shape.chunks_max = chunks_max_;
    shape.hidden = H;
    shape.send_rows = send_rows;
    shape.recv_rows = recv_rows;
    shape.from_one_rank = from_one_rank;
    shape.bound = M;
    shape.live_units = units_in_flight;
    shape.max_rounds = M > 0 ? (from_one_rank + quota - 1) / quota : 1;
    ex_.allocate(shape, dedup ? meta_recv_.data() : nullptr);
    const index_t shared_scratch =
        N > 0 ? T * expert_type::scratch_per_row(cfg_.shared_width()) : 0;
    scratch_ = space_.template allocate<float>(
        std::max(expert_rows * expert_type::scratch_per_row(cfg_.ffn), shared_scratch));
    if (N > 0) {
      shared_in_ = space_.template allocate<float>(T * H);
      shared_out_ = space_.template allocate<float>(T * H);
    }

    index_t* c = counts_.data();
    plan_.ranks = cfg_.ranks;
    plan_.local_experts = static_cast<int>(L);
    plan_.top_k = width_;
    plan_.chunks = chunks_;
    plan_.slot = slot_.data();
    plan_.phys = phys_.data();
    plan_.row_token = row_token_.data();
    plan_.kept = c;
    plan_.send_counts = c += R * L;
    plan_.send_valid = c += B;
    plan_.send_offsets = c += B;
    plan_.recv_counts = c += B + 1;
    plan_.recv_valid = c += B;
    plan_.recv_offsets = c += B;
    plan_.regroup_offsets = c += B + 1;
    plan_.expert_offsets = c += B;
    plan_.routed = c += C * L + 1;
  }

  matrix_view<std::int32_t> ids_view(index_t T) const { return {ids_.data(), T, width_}; }
  matrix_view<float> weights_view(index_t T) const { return {weights_.data(), T, width_}; }

  // The stages a schedule drives, in the order route, plan, permute, shared, counts, then per
  // unit u (a chunk, or with max_recv_rows one round of a chunk): dispatch_start(u),
  // dispatch_wait(u), experts(u), combine_start(u), combine_wait(u); then reduce. A schedule
  // may interleave units and run shared while a dispatch is in flight. Each stage adds its
  // time into stats().time.
  struct stage_runner {
    moe_layer& l;
    int chunks() const { return l.ex_.units(); }
    void route() {
      l.timed(&stage_times::route, [&] { l.do_route(); });
    }
    void plan() {
      l.timed(&stage_times::plan, [&] { l.do_plan(); });
    }
    void permute() {
      l.timed(&stage_times::permute, [&] { l.do_permute(); });
    }
    void shared() {
      l.timed(&stage_times::shared, [&] { l.do_shared(); });
    }
    void counts() {
      l.timed(&stage_times::dispatch, [&] { l.do_counts(); });
    }
    void dispatch_start(int u) {
      l.timed(&stage_times::dispatch, [&] { l.ex_.start_dispatch(u); });
    }
    void dispatch_wait(int u) {
      l.timed(&stage_times::dispatch, [&] { l.ex_.wait_dispatch(u); });
    }
    void experts(int u) {
      l.timed(&stage_times::experts, [&] { l.do_experts(u); });
    }
    void combine_start(int u) {
      l.timed(&stage_times::combine, [&] { l.ex_.start_combine(u); });
    }
    void combine_wait(int u) {
      l.timed(&stage_times::combine, [&] { l.ex_.wait_combine(u); });
    }
    void reduce() {
      l.timed(&stage_times::reduce, [&] { l.do_reduce(); });
    }
  };

  // Runs one stage, adds its time to stats().time and notes when it first began.
  template <class F>
  void timed(double stage_times::*stage, F&& f) {
    const auto start = clock::now();
    if (stats_.time.*stage == 0) stats_.began.*stage = now();
    f();
    space_.synchronize();
    stats_.time.*stage += seconds_since(start);
  }

  double now() const { return seconds_since(pass_start_); }

  void do_route() {
    const index_t T = x_.rows, E = cfg_.experts, H = cfg_.hidden;
    tokens_ = T;
    if (given_) {  // a user-supplied routing, checked by forward
      const matrix_view<std::int32_t> ids = ids_view(T);
      const matrix_view<float> w = weights_view(T);
      for (index_t t = 0; t < T; ++t)
        for (int k = 0; k < width_; ++k) {
          ids(t, k) = given_->ids(t, k);
          w(t, k) = given_->weights(t, k);
        }
      stats_.losses = {};
      return;
    }
    // Without ids, a token's identity for noise is its global position.
    const std::int64_t first = std::int64_t{rank()} * cfg_.max_tokens;
    const std::int64_t* tid = token_ids_.empty() ? nullptr : token_ids_.data();
    matrix_view<float> logits(logits_.data(), router_type::uses_gate ? T : 0, E);
    matrix_view<float> noise{};
    if constexpr (router_type::uses_gate) {
      matrix_view<const float> in = x_;
      if constexpr (router_with_jitter<router_type>) {
        if (router_.training) {  // Switch jitter: the gate sees x * U(1-eps, 1+eps)
          matrix_view<float> j(gate_input_.data(), T, H);
          for (index_t t = 0; t < T; ++t)
            for (index_t h = 0; h < H; ++h)
              j(t, h) = x_(t, h) * router_.factor(pass_, tid ? tid[t] : first + t, h);
          in = j;
        }
      }
      space_.gemm_nt(in, w_.gate, logits);
      if constexpr (router_with_noise_gate<router_type>) {
        if (router_.training) {
          noise = {noise_logits_.data(), T, E};
          space_.gemm_nt(in, w_.noise_gate, noise);
        }
      }
    }
    // The public entry point's path (router::route), its arguments checked by forward.
    detail::run_router(
        router_, cfg_, logits, {ids_view(T), weights_view(T)},
        {.noise = noise,
         .token_ids = token_ids_,
         .first_token = first,
         .pass = pass_,
         .float_scratch = {batch_floats_.data(), static_cast<std::size_t>(batch_floats_.size())},
         .int_scratch = {batch_ints_.data(), static_cast<std::size_t>(batch_ints_.size())}},
        space_);
    compute_losses(router_, cfg_, logits, last_routing(), std::span<float>(loss_probs_),
                   std::span<double>(loss_acc_), stats_.losses);
  }

  void do_plan() {
    const index_t limit = capacity_.limit(cfg_, tokens_);
    const token_origin origin{rank(), token_ids_.empty() ? nullptr : token_ids_.data(),
                              std::int64_t{rank()} * cfg_.max_tokens};
    build_send_plan(last_routing(), placement_, cfg_.experts, limit, capacity_type::pads, origin,
                    plan_);
    if constexpr (dedup) build_dedup_plan(last_routing(), plan_);
    stats_.tokens = tokens_;
    stats_.assignments = plan_.assignments;
    stats_.dropped = plan_.dropped;
    stats_.capacity = std::same_as<capacity_type, capacity::dropless>
                          ? std::nullopt
                          : std::optional<index_t>(limit);
    stats_.padding_rows = plan_.padding;
    std::copy_n(plan_.routed, cfg_.experts, stats_.routed_per_expert.begin());
    stats_.expert_imbalance = imbalance::of(stats_.routed_per_expert);
  }

  // Send rows: one per assignment, or with dedup one per (token, destination rank).
  void do_permute() {
    if constexpr (dedup)
      space_.for_each(unique_send_rows(),
                      rows::gather{x_, plan_.unique_token, send_view(unique_send_rows())});
    else
      space_.for_each(plan_.send_rows(),
                      rows::gather{x_, plan_.row_token, send_view(plan_.send_rows())});
  }

  // Shared experts: every token, on its home rank; their sum waits in shared_out for reduce.
  void do_shared() {
    const index_t N = cfg_.shared_experts, T = tokens_, H = cfg_.hidden;
    stats_.shared_flops = 0;
    if (N == 0 || T == 0) return;
    matrix_view<float> in(shared_in_.data(), T, H), out(shared_out_.data(), T, H);
    for (index_t n = 0; n < N; ++n) {
      for (index_t t = 0; t < T; ++t) std::copy_n(x_.row(t), H, in.row(t));
      expert_type::forward(space_, w_.shared, n, in, scratch_.data());
      space_.for_each(T * H, accumulate{out.data, in.data, n == 0});
    }
    stats_.shared_flops = double(N * T) * expert_type::flops_per_row(H, cfg_.shared_width());
  }

  struct accumulate {
    float* into;
    const float* add;
    bool first;
    EPMOE_HD void operator()(index_t i) const { into[i] = first ? add[i] : into[i] + add[i]; }
  };

  // The counts exchange; it also tells every rank whether all accepted their inputs.
  void do_counts() {
    const int rejected = ex_.counts(!input_error_);
    if (input_error_) std::rethrow_exception(std::exchange(input_error_, nullptr));
    if (rejected >= 0)
      throw input_error("forward inputs of rank " + std::to_string(rejected), "rejected",
                        "every rank must pass valid inputs; no rank ran this pass (rank " +
                            std::to_string(rejected) + " threw the reason)");
  }

  void do_experts(int u) {
    const int L = plan_.local_experts;
    const double t0 = now();
    index_t rows = 0;
    for (int j = 0; j < L; ++j) {
      const matrix_view<float> in = ex_.expert_rows(u, j);
      expert_type::forward(space_, w_.experts, j, in, scratch_.data());
      rows += in.rows;
      ex_.progress();
    }
    stats_.expert_flops +=
        static_cast<double>(rows) * expert_type::flops_per_row(cfg_.hidden, cfg_.ffn);
    ex_.record(
        {ex_.chunk_of_unit(u), stage_kind::experts, t0, now(), ex_.round_of_unit(u), rows, 0});
  }

  void do_reduce() {
    if constexpr (dedup)
      space_.for_each(
          tokens_, rows::sum_unique{send_view(unique_send_rows()), plan_.unique_slot, width_, y_});
    else
      space_.for_each(tokens_, rows::weighted_reduce{send_view(plan_.send_rows()), plan_.slot,
                                                     weights_view(tokens_), y_});
    if (cfg_.shared_experts > 0 && tokens_ > 0)
      for (index_t t = 0; t < tokens_; ++t)  // y rows may be strided: add row by row
        space_.for_each(cfg_.hidden,
                        accumulate{y_.row(t), shared_out_.data() + t * cfg_.hidden, false});
    const double comm = stats_.comm_seconds;
    stats_.overlap = comm > 0 ? 1.0 - stats_.exposed_comm_seconds / comm : 0.0;
  }

  index_t unique_send_rows() const { return ex_.unique_send_rows(); }
  matrix_view<float> send_view(index_t rows) const { return ex_.send_view(rows); }

  layer_config cfg_;
  comm_type comm_;
  weights w_;
  router_type router_;
  capacity_type capacity_;
  space_type space_;
  placement_type placement_;
  pass_stats stats_;
  dispatch_plan plan_;
  int width_;  // routing slots per token

  buffer<float> logits_, noise_logits_, gate_input_, batch_floats_, weights_, scratch_, shared_in_,
      shared_out_, bias_;
  buffer<std::int32_t> ids_, slot_, phys_, row_token_, batch_ints_;
  buffer<index_t> counts_;
  std::vector<float> loss_probs_;  // host: losses are computed on the host for now
  std::vector<double> loss_acc_;
  std::vector<index_t> load_send_, load_recv_, global_load_;
  std::vector<buffer<float>> owned_experts_;  // expert weights after a live re-placement
  using exchange_type = detail::exchange<comm_type, space_type, dedup>;
  exchange_type ex_;  // the exchanges: counts, then per unit dispatch/combine (core/exchange.hpp)
  int chunks_max_ = 1, chunks_ = 1;
  clock::time_point built_ = clock::now(), pass_start_{};
  buffer<std::int32_t> unique_slot_, unique_token_;
  buffer<index_t> unique_counts_;
  buffer<std::int64_t> meta_, meta_recv_;

  matrix_view<const float> x_;
  matrix_view<float> y_;
  std::span<const std::int64_t> token_ids_;
  const routing_view* given_ = nullptr;  // a user-supplied routing for this pass, else null
  std::exception_ptr input_error_;       // this rank's rejected input, thrown at counts
  index_t tokens_ = 0;
  std::uint64_t pass_ = 0;
};

}  // namespace epmoe
