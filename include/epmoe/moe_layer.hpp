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
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/schedule/sequential.hpp"
#include "epmoe/space/host.hpp"

namespace epmoe {

namespace detail {
/// The request type of a comm's ialltoallv (int for a comm without one).
template <class Comm, bool Async>
struct request_of {
  using type = int;
};
template <class Comm>
struct request_of<Comm, true> {
  using type = decltype(std::declval<Comm&>().ialltoallv(
      std::declval<const float*>(), std::declval<const index_t*>(), std::declval<const index_t*>(),
      std::declval<float*>(), std::declval<const index_t*>(), std::declval<const index_t*>()));
};
}  // namespace detail

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
  static constexpr bool async_comm =
      requires(comm_type & c, const float* s, float* r, const index_t* n) {
    c.ialltoallv(s, n, n, r, n, n).wait();
  };
  using request_type = typename detail::request_of<comm_type, async_comm>::type;

  /// Per-rank dedup (Policies::dedup = true): a token sends one row to each rank that holds
  /// any of its experts, that rank returns one weighted sum (as DeepEP and Tutel do).
  static constexpr bool dedup = requires { requires Policies::dedup; };
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
    event_start_.resize(static_cast<std::size_t>(3 * chunks_max_));
    allocate_workspace();
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
  /// them, when given, as the token's identity for seeded training noise.
  void forward(matrix_view<const float> x, matrix_view<float> y,
               std::span<const std::int64_t> token_ids = {}) {
    detail::require(x.rows <= cfg_.max_tokens, "x.rows", x.rows,
                    "tokens per pass must be <= config max_tokens");
    detail::require_shape(x, x.rows, cfg_.hidden, "x");
    detail::require_shape(y, x.rows, cfg_.hidden, "y");
    if constexpr (router_needs_token_ids<router_type>)
      detail::require(token_ids.size() == static_cast<std::size_t>(x.rows), "token_ids",
                      token_ids.size(), "this router hashes token ids: pass one per token");
    else
      detail::require(token_ids.empty() || token_ids.size() == static_cast<std::size_t>(x.rows),
                      "token_ids", token_ids.size(), "must be empty or one id per token");
    if constexpr (router_with_noise_gate<router_type>)
      if (router_.training)
        detail::require_shape(w_.noise_gate, cfg_.experts, cfg_.hidden, "weights.noise_gate");
    x_ = x;
    y_ = y;
    token_ids_ = token_ids;
    plan_.chunks = chunks_;
    stats_.time = {};
    stats_.expert_flops = stats_.comm_seconds = stats_.exposed_comm_seconds = stats_.overlap = 0;
    stats_.timeline.clear();  // keeps its capacity: no allocation
    stats_.chunks = chunks_;
    pass_start_ = clock::now();
    if constexpr (router_with_bias<router_type>) router_.bias = bias_.data();
    const auto start = clock::now();
    stage_runner stages{*this};
    schedule_type::run(stages);
    space_.synchronize();
    stats_.time.total = seconds_since(start);
    ++pass_;
  }

  const layer_config& config() const { return cfg_; }
  const pass_stats& stats() const { return stats_; }
  const placement_type& placement() const { return placement_; }
  const comm_type& comm() const { return comm_; }
  int rank() const { return comm_.rank(); }
  /// The router, to inspect or change its settings (e.g. `training`) between passes.
  router_type& router() { return router_; }
  const router_type& router() const { return router_; }
  /// Expert ids and weights of the last pass, [T, slots]; empty slots hold no_expert.
  routing_view last_routing() const { return {ids_view(tokens_), weights_view(tokens_)}; }
  /// Where each assignment of the last pass went.
  const dispatch_plan& last_plan() const { return plan_; }
  /// Passes run so far (the counter behind seeded training noise).
  std::uint64_t passes() const { return pass_; }

  /// The router's per-expert selection bias [E] (routers with has_bias): read it, or write
  /// a trained model's bias into it. Every rank must hold the same values.
  std::span<float> router_bias() requires router_with_bias<router_type> {
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

  static const layer_config& checked(const layer_config& cfg, const comm_type& comm,
                                     const weights& w, const router_type& router,
                                     const placement_type& placement) {
    cfg.validate();
    if constexpr (placement_with_validate<placement_type>) placement.validate(cfg);
    if constexpr (router_type::top_k > 0)
      detail::require(
          cfg.top_k == router_type::top_k, "top_k", cfg.top_k,
          ("must equal the router's top_k (" + std::to_string(router_type::top_k) + ")").c_str());
    detail::require(
        cfg.ranks == comm.size(), "ranks", cfg.ranks,
        ("must equal the communicator's size (" + std::to_string(comm.size()) + ")").c_str());
    if constexpr (router_with_validate<router_type>) router.validate(cfg);
    if constexpr (router_type::uses_gate)
      detail::require_shape(w.gate, cfg.experts, cfg.hidden, "weights.gate");
    expert_type::validate(w.experts, placement.slots_per_rank(), cfg.hidden, cfg.ffn,
                          "weights.experts");
    if (cfg.shared_experts > 0)
      expert_type::validate(w.shared, cfg.shared_experts, cfg.hidden, cfg.shared_width(),
                            "weights.shared");
    return cfg;
  }

  // Collective start-up check: every rank validates its own inputs, then all ranks compare
  // their configs and policy bundle in one exchange. Any failure or difference makes every
  // rank throw (the failing rank its own error), so no rank is left waiting in an exchange.
  static const layer_config& agreed(const layer_config& cfg, comm_type& comm, const weights& w,
                                    const router_type& router, const placement_type& placement) {
    std::exception_ptr local;
    std::int64_t where = 0;  // every slot's expert, hashed: all ranks must share one table
    try {
      checked(cfg, comm, w, router, placement);
      for (int r = 0; r < cfg.ranks; ++r)
        for (int j = 0; j < placement.slots_per_rank(); ++j)
          where = where * 1000003 + placement.expert_at(r, j) + 1;
    } catch (const config_error&) {
      local = std::current_exception();
    }
    const auto scaled = [](double v) { return static_cast<std::int64_t>(std::llround(v * 1e9)); };
    const agreement_field fields[] = {
        {"config_valid (another rank rejected its config or weights)", local ? 0 : 1},
        {"hidden", cfg.hidden},
        {"ffn", cfg.ffn},
        {"experts", cfg.experts},
        {"top_k", cfg.top_k},
        {"ranks", cfg.ranks},
        {"max_tokens", cfg.max_tokens},
        {"shared_experts", cfg.shared_experts},
        {"shared_ffn", cfg.shared_ffn},
        {"seq_len", cfg.seq_len},
        {"chunks", cfg.chunks},
        {"capacity_factor (x1e9)", scaled(cfg.capacity_factor)},
        {"aux_loss_coef (x1e9)", scaled(cfg.aux_loss_coef)},
        {"policies (hash of the policy bundle type)", type_hash<Policies>()},
        {"placement (hash of every slot's expert)", where}};
    try {
      agree_on(comm, std::span<const agreement_field>(fields));
    } catch (const config_error&) {
      if (local) std::rethrow_exception(local);
      throw;
    }
    if (local) std::rethrow_exception(local);  // every rank failed: each reports its own
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
    const index_t expert_rows = R * per_expert_buf;
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
    exchange_ = space_.template allocate<index_t>(2 * R * C * (2 * L + 1) + 8 * R * C);
    ex_.resize(static_cast<std::size_t>(C));
    for (index_t c = 0; c < C; ++c) {
      index_t* x = exchange_.data() + 2 * R * C * (2 * L + 1) + 8 * R * c;
      ex_[c] = {x, x + R, x + 2 * R, x + 3 * R, x + 4 * R, x + 5 * R, x + 6 * R, x + 7 * R};
    }
    if constexpr (async_comm) {
      dispatch_req_.resize(static_cast<std::size_t>(C));
      meta_req_.resize(static_cast<std::size_t>(C));
      combine_req_.resize(static_cast<std::size_t>(C));
    }
    stats_.timeline.reserve(static_cast<std::size_t>(3 * C));
    if constexpr (dedup) {
      unique_slot_ = space_.template allocate<std::int32_t>(T * K);
      unique_token_ = space_.template allocate<std::int32_t>(T * std::min(K, R));
      unique_counts_ = space_.template allocate<index_t>(4 * C * R + 2);
      meta_ = space_.template allocate<std::int64_t>(send_rows);
      meta_recv_ = space_.template allocate<std::int64_t>(recv_rows);
      plan_.unique_slot = unique_slot_.data();
      plan_.unique_token = unique_token_.data();
      plan_.unique_counts = unique_counts_.data();
      plan_.unique_offsets = plan_.unique_counts + C * R;
      plan_.recv_unique_counts = plan_.unique_offsets + C * R + 1;
      plan_.recv_unique_offsets = plan_.recv_unique_counts + C * R;
      plan_.meta = meta_.data();
      plan_.meta_recv = meta_recv_.data();
    }
    x_send_ = space_.template allocate<float>(send_rows * H);
    x_recv_ = space_.template allocate<float>(recv_rows * H);
    x_expert_ = space_.template allocate<float>(recv_rows * H);
    const index_t shared_scratch =
        N > 0 ? T * expert_type::scratch_per_row(cfg_.shared_width()) : 0;
    scratch_ = space_.template allocate<float>(
        std::max(expert_rows * expert_type::scratch_per_row(cfg_.ffn), shared_scratch));
    if (N > 0) {
      shared_in_ = space_.template allocate<float>(T * H);
      shared_out_ = space_.template allocate<float>(T * H);
    }
    recv_capacity_ = recv_rows;

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
  // chunk c: dispatch_start(c), dispatch_wait(c), experts(c), combine_start(c),
  // combine_wait(c); then reduce. A schedule may interleave chunks and run shared while a
  // dispatch is in flight. Each stage adds its time into stats().time.
  struct stage_runner {
    moe_layer& l;
    int chunks() const { return l.plan_.chunks; }
    void route() {
      l.timed(l.stats_.time.route, [&] { l.do_route(); });
    }
    void plan() {
      l.timed(l.stats_.time.plan, [&] { l.do_plan(); });
    }
    void permute() {
      l.timed(l.stats_.time.permute, [&] { l.do_permute(); });
    }
    void shared() {
      l.timed(l.stats_.time.shared, [&] { l.do_shared(); });
    }
    void counts() {
      l.timed(l.stats_.time.dispatch, [&] { l.do_counts(); });
    }
    void dispatch_start(int c) {
      l.timed(l.stats_.time.dispatch, [&] { l.start_dispatch(c); });
    }
    void dispatch_wait(int c) {
      l.timed(l.stats_.time.dispatch, [&] { l.wait_dispatch(c); });
    }
    void experts(int c) {
      l.timed(l.stats_.time.experts, [&] { l.do_experts(c); });
    }
    void combine_start(int c) {
      l.timed(l.stats_.time.combine, [&] { l.start_combine(c); });
    }
    void combine_wait(int c) {
      l.timed(l.stats_.time.combine, [&] { l.wait_combine(c); });
    }
    void reduce() {
      l.timed(l.stats_.time.reduce, [&] { l.do_reduce(); });
    }
  };

  template <class F>
  void timed(double& into, F&& f) {
    const auto start = clock::now();
    f();
    space_.synchronize();
    into += seconds_since(start);
  }

  double now() const { return seconds_since(pass_start_); }

  void do_route() {
    const index_t T = x_.rows, E = cfg_.experts, H = cfg_.hidden;
    tokens_ = T;
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
    if constexpr (token_router<router_type>) {
      space_.for_each(
          T, rows::route_tokens<router_type>{router_, logits, noise, ids_view(T), weights_view(T),
                                             tid, first, pass_, cfg_.experts});
    } else {
      router_.route_batch(cfg_, logits, {ids_view(T), weights_view(T)},
                          {batch_floats_.data(), static_cast<std::size_t>(batch_floats_.size())},
                          {batch_ints_.data(), static_cast<std::size_t>(batch_ints_.size())});
    }
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

  // Counts for every chunk, per destination: L padded counts, L real counts, the unique rows
  // (dedup), then the receive layout of the whole pass.
  void do_counts() {
    const int R = cfg_.ranks, L = plan_.local_experts, C = plan_.chunks, P = C * (2 * L + 1);
    const auto t0 = clock::now();
    index_t* send_counts = exchange_.data();
    index_t* recv_counts = send_counts + R * P;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        index_t* out = send_counts + r * P + c * (2 * L + 1);
        for (int j = 0; j < L; ++j) {
          out[j] = plan_.send_counts[plan_.block(c, r, j)];
          out[L + j] = plan_.send_valid[plan_.block(c, r, j)];
        }
        out[2 * L] = dedup ? plan_.unique_counts[c * R + r] : 0;
      }
    comm_.alltoall(send_counts, recv_counts, P);
    for (int s = 0; s < R; ++s)
      for (int c = 0; c < C; ++c) {
        const index_t* in = recv_counts + s * P + c * (2 * L + 1);
        for (int j = 0; j < L; ++j) {
          plan_.recv_counts[plan_.block(c, s, j)] = in[j];
          plan_.recv_valid[plan_.block(c, s, j)] = in[L + j];
        }
        if constexpr (dedup) plan_.recv_unique_counts[c * R + s] = in[2 * L];
      }
    build_recv_plan(plan_);
    if constexpr (dedup) {
      plan_.recv_unique_offsets[0] = 0;
      for (int b = 0; b < C * R; ++b)
        plan_.recv_unique_offsets[b + 1] =
            plan_.recv_unique_offsets[b] + plan_.recv_unique_counts[b];
    }
    if (plan_.recv_rows() > recv_capacity_)
      throw comm_error("epmoe: rank " + std::to_string(rank()) + " would receive " +
                       std::to_string(plan_.recv_rows()) + " rows, more than its workspace (" +
                       std::to_string(recv_capacity_) +
                       "); a peer passed more tokens than max_tokens?");
    for (int c = 0; c < C; ++c) set_rank_counts(c);
    fill_comm_stats();
    const double t = seconds_since(t0);
    stats_.comm_seconds += t;  // a blocking exchange: all of it exposed
    stats_.exposed_comm_seconds += t;
  }

  // One exchange: non-blocking when the comm can, else blocking; requests live per chunk.
  template <class T, class Req>
  void start_exchange(std::optional<Req>* req, const T* send, const index_t* sn, const index_t* sd,
                      T* recv, const index_t* rn, const index_t* rd) {
    if constexpr (async_comm)
      req->emplace(comm_.ialltoallv(send, sn, sd, recv, rn, rd));
    else
      comm_.alltoallv(send, sn, sd, recv, rn, rd);
  }

  template <class Req>
  void finish_exchange(std::optional<Req>* req) {
    if constexpr (async_comm) {
      const auto t0 = clock::now();
      (*req)->wait();
      const double blocked = seconds_since(t0);
      double wire = blocked;
      if constexpr (requires { (*req)->modeled_seconds(); })
        wire = std::max(blocked, (*req)->modeled_seconds());
      req->reset();
      stats_.comm_seconds += wire;
      stats_.exposed_comm_seconds += blocked;
    }
  }

  // Lets the comm progress pending exchanges (MPI moves data inside its calls).
  void progress() {
    if constexpr (async_comm)
      for (auto* reqs : {&dispatch_req_, &meta_req_, &combine_req_})
        for (auto& r : *reqs)
          if (r) r->test();
  }

  void start_dispatch(int c) {
    event_start_[c * 3 + 0] = now();
    rank_counts& x = ex_[c];
    start_exchange(&dispatch_req_[c], x_send_.data(), x.send_n, x.send_d, x_recv_.data(), x.recv_n,
                   x.recv_d);
    if constexpr (dedup)
      start_exchange(&meta_req_[c], plan_.meta, x.meta_send_n, x.meta_send_d, plan_.meta_recv,
                     x.meta_recv_n, x.meta_recv_d);
  }

  void wait_dispatch(int c) {
    finish_exchange(&dispatch_req_[c]);
    if constexpr (dedup) {
      finish_exchange(&meta_req_[c]);
      expand_unique_rows(c);
    } else {
      const int B = cfg_.ranks * plan_.local_experts, b = c * B;
      space_.copy_blocks(recv_view(), expert_view(), B, plan_.recv_offsets + b,
                         plan_.regroup_offsets + b, plan_.recv_counts + b);
    }
    stats_.timeline.push_back({c, stage_kind::dispatch, event_start_[c * 3 + 0], now()});
  }

  // Dedup: expert-major row of each received assignment of chunk c <- its unique row.
  void expand_unique_rows(int c) {
    const int R = cfg_.ranks, L = plan_.local_experts;
    const matrix_view<float> in = unique_recv_view(), out = expert_view();
    for (int s = 0; s < R; ++s)
      for (int j = 0; j < L; ++j) {
        const int b = plan_.block(c, s, j);
        for (index_t i = 0; i < plan_.recv_counts[b]; ++i) {
          const index_t u = plan_.recv_unique_offsets[c * R + s] +
                            meta_index(plan_.meta_recv[plan_.recv_offsets[b] + i]);
          std::copy_n(in.row(u), cfg_.hidden, out.row(plan_.regroup_offsets[b] + i));
        }
      }
  }

  void do_experts(int c) {
    const int L = plan_.local_experts;
    const double t0 = now();
    double rows = 0;
    for (int j = 0; j < L; ++j) {
      const index_t begin = plan_.expert_offsets[c * L + j];
      const index_t n = plan_.expert_offsets[c * L + j + 1] - begin;
      expert_type::forward(space_, w_.experts, j, expert_view().rows_slice(begin, n),
                           scratch_.data());
      rows += static_cast<double>(n);
      progress();
    }
    stats_.expert_flops += rows * expert_type::flops_per_row(cfg_.hidden, cfg_.ffn);
    stats_.timeline.push_back({c, stage_kind::experts, t0, now()});
  }

  void start_combine(int c) {
    event_start_[c * 3 + 2] = now();
    const int R = cfg_.ranks, L = plan_.local_experts;
    if constexpr (dedup) {
      // The expert rank sums each token's weighted outputs: one row per (token, rank) goes home.
      const matrix_view<float> out = unique_recv_view(), in = expert_view();
      for (index_t u = plan_.recv_unique_offsets[c * R]; u < plan_.recv_unique_offsets[(c + 1) * R];
           ++u)
        std::fill_n(out.row(u), cfg_.hidden, 0.f);
      for (int s = 0; s < R; ++s)
        for (int j = 0; j < L; ++j) {
          const int b = plan_.block(c, s, j);
          for (index_t i = 0; i < plan_.recv_counts[b]; ++i) {
            const std::int64_t m = plan_.meta_recv[plan_.recv_offsets[b] + i];
            const float w = meta_weight(m);
            const float* src = in.row(plan_.regroup_offsets[b] + i);
            float* dst = out.row(plan_.recv_unique_offsets[c * R + s] + meta_index(m));
            for (index_t h = 0; h < cfg_.hidden; ++h) dst[h] += w * src[h];
          }
        }
    } else {
      const int B = R * L, b = c * B;
      space_.copy_blocks(expert_view(), recv_view(), B, plan_.regroup_offsets + b,
                         plan_.recv_offsets + b, plan_.recv_counts + b);
    }
    // The reverse exchange: what came from rank s goes back to rank s.
    rank_counts& x = ex_[c];
    start_exchange(&combine_req_[c], x_recv_.data(), x.recv_n, x.recv_d, x_send_.data(), x.send_n,
                   x.send_d);
  }

  void wait_combine(int c) {
    finish_exchange(&combine_req_[c]);
    stats_.timeline.push_back({c, stage_kind::combine, event_start_[c * 3 + 2], now()});
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

  // Per-rank element counts and displacements of chunk c's exchanges: rows (per assignment,
  // or unique with dedup) and, with dedup, the per-assignment metadata.
  void set_rank_counts(int c) {
    const int R = cfg_.ranks;
    const index_t H = cfg_.hidden;
    rank_counts& x = ex_[c];
    for (int r = 0; r < R; ++r) {
      const int b = plan_.block(c, r, 0);
      const index_t rows_to = dedup ? plan_.unique_counts[c * R + r] : plan_.send_rows_to(c, r);
      const index_t rows_at = dedup ? plan_.unique_offsets[c * R + r] : plan_.send_offsets[b];
      const index_t rows_from =
          dedup ? plan_.recv_unique_counts[c * R + r] : plan_.recv_rows_from(c, r);
      const index_t rows_in = dedup ? plan_.recv_unique_offsets[c * R + r] : plan_.recv_offsets[b];
      x.send_n[r] = rows_to * H;
      x.send_d[r] = rows_at * H;
      x.recv_n[r] = rows_from * H;
      x.recv_d[r] = rows_in * H;
      x.meta_send_n[r] = plan_.send_rows_to(c, r);
      x.meta_send_d[r] = plan_.send_offsets[b];
      x.meta_recv_n[r] = plan_.recv_rows_from(c, r);
      x.meta_recv_d[r] = plan_.recv_offsets[b];
    }
  }

  void fill_comm_stats() {
    const int R = cfg_.ranks, L = plan_.local_experts, C = plan_.chunks, me = rank();
    const index_t H = cfg_.hidden;
    const index_t row_bytes = H * static_cast<index_t>(sizeof(float));
    const index_t meta_bytes = dedup ? static_cast<index_t>(sizeof(std::int64_t)) : 0;
    index_t sent = 0, received = 0, meta_sent = 0, meta_received = 0;
    for (int r = 0; r < R; ++r) {
      stats_.assignment_rows_sent[r] = plan_.send_rows_to(r);
      stats_.assignment_rows_received[r] = plan_.recv_rows_from(r);
      stats_.rows_sent[r] = stats_.rows_received[r] = 0;
      for (int c = 0; c < C; ++c) {
        stats_.rows_sent[r] += ex_[c].send_n[r] / H;
        stats_.rows_received[r] += ex_[c].recv_n[r] / H;
      }
      if (r != me) {
        sent += stats_.rows_sent[r];
        received += stats_.rows_received[r];
        meta_sent += stats_.assignment_rows_sent[r];
        meta_received += stats_.assignment_rows_received[r];
      }
    }
    stats_.dispatch_bytes_sent = sent * row_bytes + meta_sent * meta_bytes;
    stats_.dispatch_bytes_received = received * row_bytes + meta_received * meta_bytes;
    stats_.rank_imbalance = imbalance::of(stats_.rows_sent);
    stats_.combine_bytes_sent = received * row_bytes;
    stats_.combine_bytes_received = sent * row_bytes;
    for (int j = 0; j < L; ++j) {
      index_t real = 0, padded = 0;
      for (int c = 0; c < C; ++c)
        for (int s = 0; s < R; ++s) {
          real += plan_.recv_valid[plan_.block(c, s, j)];
          padded += plan_.recv_counts[plan_.block(c, s, j)];
        }
      stats_.rows_per_local_expert[j] = real;
      stats_.padded_rows_per_local_expert[j] = padded;
    }
  }

  index_t unique_send_rows() const { return plan_.unique_offsets[plan_.chunks * cfg_.ranks]; }
  matrix_view<float> unique_recv_view() const {
    return {x_recv_.data(), plan_.recv_unique_offsets[plan_.chunks * cfg_.ranks], cfg_.hidden};
  }
  matrix_view<float> send_view(index_t rows) const { return {x_send_.data(), rows, cfg_.hidden}; }
  matrix_view<float> recv_view() const { return {x_recv_.data(), plan_.recv_rows(), cfg_.hidden}; }
  matrix_view<float> expert_view() const {
    return {x_expert_.data(), plan_.recv_rows(), cfg_.hidden};
  }

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

  buffer<float> logits_, noise_logits_, gate_input_, batch_floats_, weights_, x_send_, x_recv_,
      x_expert_, scratch_, shared_in_, shared_out_, bias_;
  buffer<std::int32_t> ids_, slot_, phys_, row_token_, batch_ints_;
  buffer<index_t> counts_, exchange_;
  std::vector<float> loss_probs_;  // host: losses are computed on the host for now
  std::vector<double> loss_acc_;
  std::vector<index_t> load_send_, load_recv_, global_load_;
  std::vector<buffer<float>> owned_experts_;  // expert weights after a live re-placement
  index_t recv_capacity_ = 0;
  struct rank_counts {  // per-rank counts/displacements (elements) of one chunk's exchanges
    index_t *send_n, *send_d, *recv_n, *recv_d;
    index_t *meta_send_n, *meta_send_d, *meta_recv_n, *meta_recv_d;
  };
  std::vector<rank_counts> ex_;                                                     // [chunks]
  std::vector<std::optional<request_type>> dispatch_req_, meta_req_, combine_req_;  // [chunks]
  std::vector<double> event_start_;  // [3 * chunks]: when each chunk's stages began
  int chunks_max_ = 1, chunks_ = 1;
  clock::time_point pass_start_{};
  buffer<std::int32_t> unique_slot_, unique_token_;
  buffer<index_t> unique_counts_;
  buffer<std::int64_t> meta_, meta_recv_;

  matrix_view<const float> x_;
  matrix_view<float> y_;
  std::span<const std::int64_t> token_ids_;
  index_t tokens_ = 0;
  std::uint64_t pass_ = 0;
};

}  // namespace epmoe
