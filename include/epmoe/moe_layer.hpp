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
#include "epmoe/core/checks.hpp"
#include "epmoe/core/clock.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/options.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/core/workspace.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/placement/relocate.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/router/gate.hpp"
#include "epmoe/router/route.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/schedule/sequential.hpp"
#include "epmoe/space/host.hpp"

namespace epmoe {

namespace detail {
/// An expert policy's gradient bundle (grads_of<float>), or nothing for a forward-only one.
struct no_expert_grads {};
template <class X>
auto expert_grads_of() {
  if constexpr (requires { typename X::template grads_of<float>; })
    return typename X::template grads_of<float>{};
  else
    return no_expert_grads{};
}
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
  static constexpr layer_options options{};
};

namespace detail {
/// The packed copies a layer keeps for its space (space::host's packed_weights), or nothing.
template <class S>
struct packed_store_of {
  struct type {};
};
template <class S>
requires requires { typename S::packed_store; }
struct packed_store_of<S> {
  using type = typename S::packed_store;
};
}  // namespace detail

/// One rank's share of an expert-parallel MoE layer, on any space (host threads, CUDA).
///
/// Each forward pass routes the rank's T tokens, sends every (token, expert) row to the rank
/// holding that expert (all-to-all #1), runs the local experts on what arrives, returns the
/// outputs (all-to-all #2) and sums each token's K outputs, weighted, at home. Every rank of
/// the communicator calls forward() the same number of times (T may differ, even be 0).
/// All workspace is allocated at construction from `max_tokens`; forward allocates nothing.
/// The layer owns what is the same on every space (checks, agreement, workspace layout,
/// schedule, stats, API); the stages are the space's primitives and the comm's transport.
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
  /// Element type of activations and weights (float on the host; float/bf16/fp16 on CUDA).
  using value_type = typename space_type::value_type;

  // One check per member each slot must provide; a missing one is named (core/checks.hpp).
  static_assert(checks::space<space_type>());
  static_assert(checks::router<router_type>());
  static_assert(checks::placement<placement_type>());
  static_assert(checks::capacity<capacity_type>());
  static_assert(checks::comm<comm_type>());
  static_assert(checks::expert<expert_type, space_type>());
  static_assert(checks::schedule<schedule_type>());
  static_assert(
      !requires { Policies::dedup; },
      "epmoe: declare per-rank dedup as `static constexpr epmoe::layer_options options{.dedup = "
      "true};` in the policy bundle (core/options.hpp), not as a member `dedup`");

  /// The bundle's options (core/options.hpp).
  static constexpr layer_options options = detail::options_of<Policies>();
  /// Per-rank dedup: a token sends one row to each rank that holds any of its experts, that
  /// rank returns one weighted sum (as DeepEP and Tutel do).
  static constexpr bool dedup = options.dedup || options.hierarchical;
  /// Hierarchical dispatch and combine: one row per (token, node) crosses between nodes.
  static constexpr bool hierarchical = options.hierarchical;
  static_assert(!(dedup && capacity_type::pads),
                "epmoe: per-rank dedup sends one row per (token, rank), which does not combine "
                "with padded capacity (fixed rows per expert): use capacity::factor<false> or "
                "capacity::dropless with dedup");

  using transport_type = transport<comm_type, space_type>;
  /// Whether the comm can start an exchange and wait for it later; without it every exchange
  /// blocks and a pipelined schedule has nothing to overlap.
  static constexpr bool async_comm = transport_type::async;

  /// Exchange units a schedule keeps in flight: with config max_recv_rows the receive buffer
  /// holds this many rounds at once (sequential: one; pipelined: dispatch of i+1, experts of
  /// i, combine of i-1). A schedule may declare `static constexpr int units_in_flight`.
  static constexpr int units_in_flight = units_in_flight_of<schedule_type>();

  using expert_weights = typename expert_type::template weights_of<value_type>;

  /// The weights one rank holds (non-owning views in the space's memory; they must outlive
  /// the layer).
  struct weights {
    matrix_view<const value_type> gate;           // [E, H] router gate, the same on every rank
    expert_weights experts;                       // this rank's slots, local-slot order
    expert_weights shared{};                      // [N] shared experts (config shared_experts)
    matrix_view<const value_type> noise_gate{};   // [E, H] noisy top-k's noise projection
    matrix_view<const value_type> shared_gate{};  // [N, H] (config shared_gate)
    matrix_view<const value_type> output_bias{};  // [1, H] (config output_bias)
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
        space_(std::move(space)),
        placement_(std::move(placement)),
        stats_(cfg_.experts, placement_.slots_per_rank(), cfg_.ranks),
        width_(router::routing_width<router_type>(cfg_)),
        chunks_max_(cfg_.chunks > 0 ? cfg_.chunks : default_chunks()),
        chunks_(chunks_max_),
        layout_(layout_of(cfg_, width_, placement_.slots_per_rank(), chunks_max_, capacity_,
                          node_size_of(cfg_, comm_))),
        plan_(space_, layout_, dedup),
        ex_(comm_, space_, layout_),
        clock_(space_.make_clock(32 + 12 * units_max()), 16 + 2 * layout_.blocks, 3 * units_max(),
               2 * units_max() + 1) {
    if constexpr (requires { space_.set_fixed_order(true); })
      space_.set_fixed_order(options.deterministic);
    allocate_workspace();
    place_placement();
    adopt_router_bias();  // a bias given with the router starts the layer's own
    if constexpr (options.pack_weights) pack_weights(options.pack_as);
  }

  moe_layer(const moe_layer&) = delete;
  moe_layer& operator=(const moe_layer&) = delete;

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

  /// y [T, H] = MoE(x [T, H]), T <= max_tokens, row-major with row strides, in the space's
  /// memory. Collective: every rank calls it, each with its own T (0 is fine). token_ids [T]
  /// are the tokens' vocabulary ids, needed by routers that hash them (router::hash); other
  /// routers use them, when given, as the token's identity for seeded training noise.
  /// Invalid inputs throw config_error on this rank and input_error on every peer, before any
  /// row moves and with y untouched.
  void forward(matrix_view<const value_type> x, matrix_view<value_type> y,
               std::span<const std::int64_t> token_ids = {}) {
    std::exception_ptr bad;
    try {
      check_inputs(x, y);
      check_token_ids(token_ids, x.rows);
      check_router();
    } catch (const config_error&) {
      bad = std::current_exception();
    }
    run_pass(x, y, token_ids, nullptr, bad);
  }

  /// The same with the routing given instead of computed: ids [T, K] in [0, E) (or
  /// no_expert = -1 for an empty slot), distinct within a token, weights [T, K] finite and >= 0,
  /// K = the router's top_k (E for expert choice), host memory. The router and its gate are
  /// not used; losses are zero. A bad entry throws input_error naming it
  /// ("routing.ids[5][1] = 99: must be in [0, 64)") on this rank and input_error on every peer,
  /// before any row moves; y is untouched.
  void forward(matrix_view<const value_type> x, routing_view routing, matrix_view<value_type> y) {
    std::exception_ptr bad;
    try {
      check_inputs(x, y);
      check_routing(routing, x.rows);
    } catch (const config_error&) {
      bad = std::current_exception();
    }
    run_pass(x, y, {}, &routing, bad);
  }

  // --- training (docs/training.md) ------------------------------------------------------

  /// Gradients of one rank's parameters (float, in the space's memory), shaped as `weights`;
  /// a tensor the configuration does not use may stay empty.
  using expert_grads = decltype(detail::expert_grads_of<expert_type>());
  struct gradients {
    matrix_view<float> gate{};         // [E, H]: from this rank's tokens; the gate is replicated,
                                       //   so sum it over the ranks (sum_over_ranks, or the
                                       //   framework's all-reduce)
    expert_grads experts{};            // this rank's slots, local-slot order; a replicated
                                       //   expert's gradient is the sum over its copies
    expert_grads shared{};             // [N] shared experts
    matrix_view<float> shared_gate{};  // [N, H] (config shared_gate)
    matrix_view<float> output_bias{};  // [1, H] (config output_bias)
    matrix_view<float> noise_gate{};   // [E, H] noisy top-k's noise projection (while training)
  };
  struct backward_options {
    loss_scales losses{};     // add d(scale * loss)/d(gate, x) for each router loss of the pass
    bool accumulate = false;  // add into `grads` instead of overwriting them
  };

  /// The backward of the last forward (config `training`), collective like forward: from
  /// dy = dL/dy [T, H] (T of that pass) writes dx = dL/dx [T, H] and every gradient of `grads`.
  /// The combine's backward is a dispatch of weighted dy rows, the experts' backward runs dX
  /// and dW per local expert on the rows they computed, the dispatch's backward a combine of
  /// dX rows; the routing weights' gradient goes through the router into the gate. Routing and
  /// capacity are held fixed: a dropped assignment gets no gradient. It reads the forward's x
  /// again (keep it unchanged) and consumes the saved state: one backward per forward.
  /// Invalid arguments throw config_error here and input_error on every peer, before a row
  /// moves; nothing is written then.
  void backward(matrix_view<const value_type> dy, matrix_view<value_type> dx,
                const gradients& grads, const backward_options& opt = {}) {
    static_assert(training_space<space_type> && std::same_as<value_type, float>,
                  "epmoe: moe_layer::backward needs a float space with the backward GEMMs "
                  "(space::host, space::cuda<float>)");
    static_assert(
        requires { expert_type::backward_scratch_per_row(index_t{}); },
        "epmoe: this expert policy has no backward: moe_layer::backward needs "
        "Expert::backward and Expert::backward_scratch_per_row (expert/swiglu.hpp)");
    static_assert(!router_type::uses_gate || router_with_backward<router_type>,
                  "epmoe: this router has no backward yet: moe_layer::backward needs "
                  "router.backward_token(in, ids, g, dlogits) (docs/training.md lists the routers "
                  "that have one)");
    usable();
    stats();  // the forward's numbers are read before the clock starts again
    back_opt_ = opt;
    std::exception_ptr bad;
    try {
      check_backward(dy, dx, grads);
    } catch (const config_error&) {
      bad = std::current_exception();
    }
    input_error_ = bad;
    call_ = "backward";
    dy_ = dy;
    dx_ = dx;
    grads_ = grads;
    saved_ = false;  // consumed, whatever happens next
    grads_started_ = false;
    stats_.backward = true;
    ex_.set_backward(true);
    drive(backward_runner{{*this}}, false);
    ex_.set_backward(false);
    if (input_error_) std::rethrow_exception(std::exchange(input_error_, nullptr));
  }

  /// Collective, after backward: makes `grads` what an optimizer step needs on every rank.
  /// The replicated parameters' gradients (gate, shared experts, shared gate, output bias: each
  /// rank's holds its own tokens' share) become their sum over the ranks, and every copy of a
  /// replicated routed expert holds the sum over its copies. Each element is summed in rank
  /// order by one rank and sent to all, so every rank gets bit-identical values. Staged through
  /// host memory and the comm's all-to-all (a reduce-scatter, then an all-gather); a framework
  /// with its own all-reduce may sum these tensors itself instead.
  void reduce_gradients(const gradients& grads) {
    detail::require(cfg_.training, "config.training", cfg_.training,
                    "must be true for reduce_gradients (it sizes the staging buffers)");
    usable();
    // Every rank checks its tensors, then all learn whether every rank may go on.
    std::exception_ptr bad;
    try {
      check_grads(grads);
    } catch (const config_error&) {
      bad = std::current_exception();
    }
    const int R = cfg_.ranks;
    std::vector<int> ok(static_cast<std::size_t>(R), bad ? 0 : 1), all(ok.size());
    comm_.alltoall(ok.data(), all.data(), 1);
    if (bad) std::rethrow_exception(bad);
    for (int r = 0; r < R; ++r)
      if (!all[static_cast<std::size_t>(r)])
        throw input_error("reduce_gradients inputs of rank " + std::to_string(r), "rejected",
                          "every rank must pass valid gradients; nothing was summed");
    gradients g = grads;
    const index_t n = stage_segments(g, true);
    const index_t P = (n + R - 1) / R;  // each rank sums one piece
    space_.to_host(stage_, 0, n);
    space_.synchronize();
    float* v = stage_.host();
    std::fill(v + n, v + P * R, 0.f);
    comm_.alltoall(v, reduce_recv_.data(), P);
    for (index_t i = 0; i < P; ++i) {
      float sum = 0.f;
      for (int r = 0; r < R; ++r) sum += reduce_recv_[static_cast<std::size_t>(r * P + i)];
      for (int r = 0; r < R; ++r) reduce_send_[static_cast<std::size_t>(r * P + i)] = sum;
    }
    comm_.alltoall(reduce_send_.data(), v, P);
    space_.to_device(stage_, 0, n);
    stage_segments(g, false);
    space_.synchronize();
  }

  /// Points the layer at other weights of the same shapes (a framework that replaced its
  /// parameter tensors, or moved them). Local, between passes: every rank rebinds its own;
  /// a bad view throws config_error naming it and the layer keeps the old ones. Not after a
  /// live re-placement (the layer then holds its own copy of the experts).
  void set_weights(const weights& w) {
    detail::require(owned_experts_.empty(), "set_weights", "after apply_placement",
                    "the layer owns its experts after a live re-placement; build a new layer");
    checked(cfg_, comm_, w, router_, placement_);
    w_ = w;
    repack();
  }

  /// Packs this rank's expert weights (routed and shared) into storage the layer owns, in
  /// the space's own layout (space::host: panels of 32 output columns that one pass reads
  /// once whatever the rows per expert, space/host_packed.hpp); the passes then read the
  /// packed copies. Local. Call it again after changing the weights' values in place (an
  /// optimizer step): the copies are of the values now. set_weights and apply_placement
  /// repack by themselves; a repack of the same tensors allocates nothing.
  void pack_weights() { pack_weights(pack_as_); }
  /// The same with packed copies of element type `as` (packed_precision::bf16: half the bytes
  /// per pass, the weights rounded to bf16; the later repacks keep it).
  void pack_weights(packed_precision as) {
    static_assert(
        requires { typename space_type::packed_store; },
        "epmoe: this space has no packed weight layout (space::host has one); drop "
        "layer_options::pack_weights or pack_weights()");
    std::array<stacked_view<const value_type>, 8> all{};
    std::size_t n = 0;
    for (auto* v : expert_type::tensors(w_.experts)) all.at(n++) = *v;
    if (cfg_.shared_experts > 0)
      for (auto* v : expert_type::tensors(w_.shared)) all.at(n++) = *v;
    packed_.pack_only(std::span(all.data(), n), as);
    // Room for the passes' inputs as bf16 (the AVX512-BF16 path): a unit's expert rows, or
    // the tokens of the shared experts.
    if (as == packed_precision::bf16 && space_.kernel_path() == space::cpu_path::avx512_bf16)
      packed_.reserve_inputs(std::max<index_t>(layout_.expert_rows, cfg_.max_tokens));
    pack_as_ = as;
    space_.use_packed(&packed_);
  }
  /// Back to reading the weights themselves; frees the packed copies.
  void unpack_weights() {
    if constexpr (requires { typename space_type::packed_store; }) {
      packed_.clear();
      space_.use_packed(nullptr);
    }
  }
  bool weights_packed() const {
    if constexpr (requires { typename space_type::packed_store; })
      return !packed_.empty();
    else
      return false;
  }

  /// Losing ranks (issue 23): the layer of the ranks that survive, collective over them (a
  /// lost rank does not call). lost[r] != 0 marks rank r lost (size: ranks). Each survivor
  /// keeps its slots and their weights; placement::surviving re-plans the placement over the
  /// survivors, renumbered in rank order, so that every expert is served by a surviving copy
  /// (config_error naming the experts that have none, on every survivor, before any
  /// exchange). The comm is comm.exclude(lost) (comm::threads). The survivors' passes then
  /// equal the reference over their tokens alone. This layer is left as it was: its
  /// exchanges include the lost ranks, so do not run its passes again. The new layer packs
  /// its weights as its options say (pack_weights() after, for a layer packed at run time).
  moe_layer exclude_ranks(std::span<const char> lost)
      const requires std::same_as<placement_type, epmoe::placement::table> &&
      requires(const comm_type& c, std::span<const char> m) {
    c.exclude(m);
  }
  {
    epmoe::placement::table where = epmoe::placement::surviving(placement_, lost);
    layer_config cfg = cfg_;
    cfg.ranks = where.ranks();
    cfg.ranks_per_node = 0;  // the survivors' nodes are uneven: one node (a flat exchange)
    return moe_layer(cfg, comm_.exclude(lost), w_, router_, capacity_, std::move(where), space_);
  }

 private:
  // After the weights changed: packed again when they were packed.
  void repack() {
    if constexpr (requires { typename space_type::packed_store; })
      if (weights_packed()) pack_weights();
  }

 public:
  const layer_config& config() const { return cfg_; }
  /// What the last pass did (waits for it on a device space): rows, drops, bytes, FLOPs,
  /// losses and stage times.
  const pass_stats& stats() const {
    if (pending_) resolve_stats();
    return stats_;
  }
  const placement_type& placement() const { return placement_; }
  const comm_type& comm() const { return comm_; }
  const space_type& space() const { return space_; }
  int rank() const { return comm_.rank(); }
  /// The router, to inspect or change its settings (e.g. `training`) between passes; they
  /// are checked at the next forward. For sigmoid_bias, `router().bias` points at the
  /// layer's bias (router_bias()); pointing it at other values loads those at the next pass.
  router_type& router() { return router_; }
  const router_type& router() const { return router_; }
  /// Expert ids and weights of the last pass, [T, slots], host memory; empty slots hold
  /// no_expert (waits for the pass on a device space).
  routing_view last_routing() const {
    space_.to_host(ids_, 0, tokens_ * width_);
    space_.to_host(weights_, 0, tokens_ * width_);
    space_.synchronize();
    return {{ids_.host(), tokens_, width_}, {weights_.host(), tokens_, width_}};
  }
  /// Rows of the receive buffer: with config max_recv_rows at most that, else R*T*min(K, L).
  index_t receive_buffer_rows() const { return ex_.receive_buffer_rows(); }
  /// Where each assignment of the last pass went (per-assignment arrays in the space's
  /// memory, per-block arrays on the host).
  const dispatch_plan& last_plan() const { return plan_.host(); }
  /// Which assignments of the last pass capacity dropped: mask(t, k) for t < T, k < slots
  /// (the last_routing() shape); empty slots are not drops; count() == stats().dropped. A
  /// view of the plan's host copy (on a device space the call copies it and waits): valid
  /// until the next pass.
  drop_mask dropped() const {
    const auto& m = plan_.routes();
    const index_t n = layout_.tokens * width_;
    space_.to_host(m, 0, 2 * n);
    space_.synchronize();
    return {m.host(), m.host() + n, tokens_, width_};
  }
  /// Passes run so far (the counter behind seeded training noise).
  std::uint64_t passes() const { return pass_; }
  /// The workspace's sizes (the same on every space).
  const workspace_layout& layout() const { return layout_; }
  /// Waits for the rank's last pass (a no-op on the host). With static shapes on a device
  /// (padded capacity, one chunk: nothing waits during a pass) this is where a pass whose
  /// inputs a rank rejected throws input_error; it wrote nothing to y.
  void synchronize() const { stats(); }
  /// Whether passes have static shapes (padded capacity, one chunk, a router that decides per
  /// token): the layout is fixed by max_tokens, and on a device a pass never waits for the
  /// host, so it can be captured in a CUDA graph.
  bool static_shapes() const {
    return capacity_type::pads && token_router<router_type> && chunks_ == 1;
  }

  /// The router's per-expert selection bias [E] (routers with has_bias), the layer's own
  /// host copy: read it, or write a trained model's bias into it (checked at the next
  /// forward). It starts as the constructor's router.bias (or zeros). Every rank must hold
  /// the same.
  std::span<float> router_bias() requires router_with_bias<router_type> {
    adopt_router_bias();
    return {bias_.host(), static_cast<std::size_t>(cfg_.experts)};
  }

  /// Collective live re-placement (placement::table): switches to `next` (same experts,
  /// ranks and slots per rank; the same table on every rank), moving the weights of every
  /// slot whose expert changes from a rank that holds that expert now, through the
  /// communicator. From the first call on the layer keeps its own copy of its slots'
  /// weights. The move lands in staging first, so a pass sees either the old table and
  /// weights or the new ones. Returns the bytes of weights this rank's slots received.
  index_t apply_placement(
      const placement::table& next) requires std::same_as<placement_type, placement::table> {
    auto views = expert_type::tensors(w_.experts);
    constexpr std::size_t N = std::tuple_size_v<decltype(views)>;
    if (owned_experts_.empty()) own_experts(views);
    // The move runs on host copies (a device space stages its slots through them).
    std::array<stacked_view<value_type>, N> staged;
    for (std::size_t k = 0; k < N; ++k) {
      const stacked_view<const value_type>& v = *views[k];
      space_.to_host(owned_experts_[k], 0, owned_experts_[k].size());
      staged[k] = {owned_experts_[k].host(), v.count, v.rows, v.cols};
    }
    space_.synchronize();
    const index_t received = placement::relocate(comm_, placement_, next, staged);
    for (auto& m : owned_experts_) space_.to_device(m, 0, m.size());
    space_.synchronize();
    placement_ = next;
    place_placement();
    repack();        // the slots hold other experts now
    saved_ = false;  // another expert set: the last forward's state no longer applies
    if (cfg_.training) plan_replicas();
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
    usable();
    const int R = cfg_.ranks, E = cfg_.experts, W = E + 1;
    const pass_stats& s = stats();
    std::vector<index_t> send(static_cast<std::size_t>(R * W)), recv(send.size());
    index_t computed = 0;
    for (index_t n : s.rows_per_local_expert) computed += n;
    for (int r = 0; r < R; ++r) {
      std::copy_n(s.routed_per_expert.begin(), E, send.begin() + r * W);
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
    usable();
    const int R = cfg_.ranks, E = cfg_.experts;
    // An all-reduce through the comm's all-to-all: send the local load to every rank.
    for (int r = 0; r < R; ++r)
      std::copy_n(plan_.host().routed, E, load_send_.begin() + static_cast<std::size_t>(r) * E);
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
  template <class T>
  using buffer = typename space_type::template buffer<T>;
  template <class T>
  using mirror = typename space_type::template mirror<T>;
  using exchange_type = exchange<comm_type, space_type, dedup>;
  using mark = typename pass_clock<space_type>::mark;

  static int default_chunks() {
    if constexpr (requires { schedule_type::default_chunks; })
      return schedule_type::default_chunks;
    else
      return 1;
  }

  static workspace_layout layout_of(const layer_config& cfg, int width, int L, int chunks,
                                    const capacity_type& capacity, int node_size) {
    index_t router_cap = 0;
    if constexpr (requires { router_type::capacity(cfg, index_t{}); })
      router_cap = router_type::capacity(cfg, cfg.max_tokens);  // expert choice
    return workspace_layout::of(
        cfg, width, L, chunks, units_in_flight, capacity_type::pads,
        [&](index_t T) { return capacity.limit(cfg, T); }, router_cap, sizeof(value_type),
        node_size, hierarchical, dedup);
  }
  // Most exchange units of a pass (chunks, or with a bound every round of every chunk).
  int units_max() const { return static_cast<int>(layout_.max_units); }
  // Windows of tokens per schedule chunk when a receive bound meets dedup (token rounds):
  // each holds at most `quota` tokens of every rank whatever its T.
  int rounds_per_chunk() const {
    if (!layout_.token_rounds) return 1;
    const index_t per_chunk = (cfg_.max_tokens + chunks_ - 1) / chunks_;
    return static_cast<int>((per_chunk + layout_.quota - 1) / layout_.quota);
  }

  void check_inputs(matrix_view<const value_type> x, matrix_view<value_type> y) const {
    detail::require(x.rows <= cfg_.max_tokens, "x.rows", x.rows,
                    "tokens per pass must be <= config max_tokens");
    detail::require_shape(x, x.rows, cfg_.hidden, "x");
    detail::require_shape(y, x.rows, cfg_.hidden, "y");
  }

  void check_token_ids(std::span<const std::int64_t> ids, index_t T) const {
    if constexpr (router_needs_token_ids<router_type>)
      detail::require(ids.size() == static_cast<std::size_t>(T), "token_ids", ids.size(),
                      "this router hashes token ids: pass one per token");
    else
      detail::require(ids.empty() || ids.size() == static_cast<std::size_t>(T), "token_ids",
                      ids.size(), "must be empty or one id per token");
  }

  // The router may have changed since the last pass (router(), router_bias()): a bad setting
  // is rejected here, on every rank, not mid-pass on one.
  void check_router() {
    if constexpr (requires { router_.check(cfg_, w_.noise_gate); })
      router_.check(cfg_, w_.noise_gate);  // e.g. noisy top-k's noise gate while training
    adopt_router_bias();
    if constexpr (router_with_validate<router_type>) {
      router_type r = router_;  // its bias checked where the host can read it
      if constexpr (router_with_bias<router_type>) r.bias = bias_.host();
      r.validate(cfg_);
    }
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
  void run_pass(matrix_view<const value_type> x, matrix_view<value_type> y,
                std::span<const std::int64_t> token_ids, const routing_view* routing,
                std::exception_ptr bad) {
    usable();
    input_error_ = bad;
    call_ = "forward";
    ex_.set_backward(false);  // (a backward that threw may have left it set)
    saved_ = false;
    saved_rows_ = 0;
    stats_.backward = false;
    x_ = bad ? matrix_view<const value_type>{x.data, 0, cfg_.hidden, x.stride} : x;
    y_ = y;
    tokens_ = x_.rows;
    token_ids_ = bad ? std::span<const std::int64_t>{} : token_ids;
    given_ = bad ? nullptr : routing;
    routing_given_ = given_ != nullptr;
    plan_.host().rounds = rounds_per_chunk();
    plan_.host().chunks = chunks_ * plan_.host().rounds;
    stats_.chunks = chunks_;
    drive(stage_runner{*this}, true);
    ++pass_;
    // Static shapes on a device: this rank's own error, once its part of the pass is queued.
    if (input_error_) std::rethrow_exception(std::exchange(input_error_, nullptr));
    if (cfg_.training) {
      saved_ = true;
      const index_t T = tokens_;
      stats_.saved_bytes =
          saved_rows_ * (cfg_.hidden * (dedup ? 2 : 1) + keep_per_row()) *
              static_cast<index_t>(sizeof(value_type)) +
          T * width_ * static_cast<index_t>(sizeof(float) + sizeof(std::int32_t)) +
          (router_type::uses_gate ? T * cfg_.experts * static_cast<index_t>(sizeof(float)) : 0);
    }
  }

  // Runs the schedule over `stages` (a forward's or a backward's) as one timed pass; a
  // forward then advances the pass counter on the space.
  template <class Stages>
  void drive(Stages stages, bool advance_pass) {
    stats_.expert_flops = 0;
    stats_.started = seconds_since(built_);
    pending_ = true;
    space_.enter();
    clock_.begin_pass();
    const mark start = clock_.now();
    try {
      schedule_type::run(stages);
    } catch (...) {
      failed_pass();  // rethrows, with the stage, unless every rank rejected the inputs
      throw;
    }
    if (advance_pass) space_.for_each(1, rows::advance{pass_counter_.device()});
    clock_.stage(&stage_times::total, start, clock_.now());
    space_.leave();
  }

  // A pass that failed past the agreement (a rank threw mid-pass, an exchange timed out or
  // was aborted by a peer): the peers learn it through the comm's abort(), within their next
  // exchange, and this layer refuses every later call (an exchange in flight cannot be
  // resumed). Comm errors gain the stage this rank was in. Called inside a catch handler.
  void failed_pass() {
    if (std::exchange(agreed_failure_, false)) return;  // every rank rejected the inputs
    const auto where = [&] {
      std::string s = std::string("epmoe: ") + call_ + " pass " + std::to_string(pass_) +
                      ", stage " + stage_name(stage_now_);
      if (unit_now_ >= 0) {
        const dispatch_plan& p = plan_.host();
        s += " (chunk " + std::to_string(ex_.chunk_of_unit(p, unit_now_)) + ", round " +
             std::to_string(ex_.round_of_unit(p, unit_now_)) + ")";
      }
      return s;
    }();
    const auto tell_peers = [&](const std::string& why) {
      if constexpr (requires { comm_.abort(why); }) comm_.abort(why);
    };
    try {
      throw;
    } catch (const comm_timeout& e) {
      failed_ = where + ": " + e.what();
      tell_peers(failed_);
      throw comm_timeout(failed_);
    } catch (const comm_aborted& e) {
      failed_ = where + ": " + e.what();
      throw comm_aborted(failed_, e.origin());
    } catch (const std::exception& e) {
      failed_ = where + ": " + e.what();
      tell_peers(failed_);
      throw;
    } catch (...) {
      failed_ = where + ": an exception that is no std::exception";
      tell_peers(failed_);
      throw;
    }
  }
  static const char* stage_name(double stage_times::*s) {
    if (s == &stage_times::route) return "route";
    if (s == &stage_times::plan) return "plan";
    if (s == &stage_times::permute) return "permute";
    if (s == &stage_times::shared) return "shared";
    if (s == &stage_times::dispatch) return "dispatch";
    if (s == &stage_times::experts) return "experts";
    if (s == &stage_times::combine) return "combine";
    if (s == &stage_times::reduce) return "reduce";
    return "start";
  }
  // Throws when an earlier pass failed mid-exchange.
  void usable() const {
    if (!failed_.empty())
      throw comm_aborted("epmoe: this layer is unusable: an earlier pass failed mid-exchange (" +
                         failed_ +
                         "); its exchanges cannot be resumed: build a new layer and comm");
  }

  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }

  static void checked(const layer_config& cfg, const comm_type& comm, const weights& w,
                      const router_type& router, const placement_type& placement) {
    check_layer_policies(cfg, comm.size(), router, placement);
    if constexpr (router_type::uses_gate)
      detail::require_shape(w.gate, cfg.experts, cfg.hidden, "weights.gate");
    expert_type::validate(w.experts, placement.slots_per_rank(), cfg.hidden, cfg.ffn,
                          "weights.experts");
    if (cfg.shared_experts > 0)
      expert_type::validate(w.shared, cfg.shared_experts, cfg.hidden, cfg.shared_width(),
                            "weights.shared");
    if (cfg.shared_gate)
      detail::require_shape(w.shared_gate, cfg.shared_experts, cfg.hidden, "weights.shared_gate");
    if (cfg.output_bias) detail::require_shape(w.output_bias, 1, cfg.hidden, "weights.output_bias");
    if (const int G = node_size_of(cfg, comm); G != cfg.ranks_per_node)  // the comm's
      detail::require(G >= 0 && G <= cfg.ranks && (G == 0 || cfg.ranks % G == 0), "ranks_per_node",
                      G,
                      "from the comm (config ranks_per_node = 0) must divide ranks: set "
                      "ranks_per_node in the config, or place as many ranks on every node");
    if constexpr (hierarchical)
      detail::require(node_size_of(cfg, comm) <= 64, "ranks_per_node", node_size_of(cfg, comm),
                      "must be <= 64 with options.hierarchical (a row's mask of the node's "
                      "ranks is 64 bits)");
    if (cfg.max_recv_rows > 0) {
      detail::require(!capacity_type::pads, "max_recv_rows", cfg.max_recv_rows,
                      "must be 0 with padded capacity (its blocks are fixed): use "
                      "capacity::dropless or capacity::factor<false> for a receive bound");
      detail::require(cfg.max_recv_rows >= cfg.ranks * units_in_flight, "max_recv_rows",
                      cfg.max_recv_rows,
                      ("must be >= ranks * " + std::to_string(units_in_flight) +
                       " (rounds this schedule keeps in flight): every pair moves a row per round")
                          .c_str());
    }
  }

  // Collective start-up check: every rank validates its own inputs, then all ranks compare
  // their configs and policy bundle in one exchange. Any failure or difference makes every
  // rank throw (the failing rank its own error), so no rank is left waiting in an exchange.
  static const layer_config& agreed(const layer_config& cfg, comm_type& comm, const weights& w,
                                    const router_type& router, const placement_type& placement) {
    // The deadline covers the agreement's own exchange too (a bad value: checked() names it).
    if constexpr (requires { comm.set_timeout(1.0); })
      if (std::isfinite(cfg.exchange_timeout) && cfg.exchange_timeout >= 0 &&
          cfg.exchange_timeout <= 1e9)
        comm.set_timeout(cfg.exchange_timeout);
    agree_on_layer<Policies>(cfg, comm, placement,
                             [&] { checked(cfg, comm, w, router, placement); });
    return cfg;
  }

  // A live re-placement's first move: the layer's own contiguous copy of its slots' weights
  // (the caller's views stay untouched), copied in the space's memory.
  template <class Views>
  void own_experts(Views& views) {
    for (stacked_view<const value_type>* v : views) {
      detail::require(v->batch_stride % v->stride == 0, "weights.experts", v->batch_stride,
                      "a live re-placement needs each tensor's batch stride to be a multiple of "
                      "its row stride");
      auto& m = owned_experts_.emplace_back(
          space_.template allocate_mirror<value_type>(v->count * v->rows * v->cols));
      auto& d = owned_desc_.emplace_back(space_.template allocate_mirror<index_t>(3 * v->count));
      for (index_t s = 0; s < v->count; ++s) {  // slot s's rows: from, to, how many
        d.host()[s] = s * (v->batch_stride / v->stride);
        d.host()[v->count + s] = s * v->rows;
        d.host()[2 * v->count + s] = v->rows;
      }
      space_.to_device(d, 0, d.size());
      const index_t rows_in = (v->count - 1) * (v->batch_stride / v->stride) + v->rows;
      space_.copy_blocks({v->data, rows_in, v->cols, v->stride},
                         {m.device(), v->count * v->rows, v->cols}, v->count, d.device(),
                         d.device() + v->count, d.device() + 2 * v->count);
      *v = {m.device(), v->count, v->rows, v->cols};
    }
    space_.synchronize();
  }

  // What the plan's per-assignment step holds of the placement: its view (plain pointers)
  // with the arrays in the space's memory, or the placement itself (a small value).
  void place_placement() {
    if constexpr (requires {
                    placement_.view_in([](std::span<const int>) -> const int* { return nullptr; });
                  } &&
                  device_space<space_type>) {
      placement_arrays_.clear();
      where_ = placement_.view_in([&](std::span<const int> v) -> const int* {
        placement_arrays_.push_back(
            space_.template allocate_mirror<int>(static_cast<index_t>(v.size())));
        std::copy(v.begin(), v.end(), placement_arrays_.back().host());
        space_.to_device(placement_arrays_.back(), 0, static_cast<index_t>(v.size()));
        return placement_arrays_.back().device();
      });
      space_.synchronize();
    } else {
      where_ = placement_view(placement_);
    }
  }

  // The router reads the layer's bias; values it was pointed at instead (the constructor's
  // router, router().bias = p) are copied in first, so no setting is silently dropped.
  void adopt_router_bias() {
    if constexpr (router_with_bias<router_type>) {
      float* own = bias_.host();
      if (router_.bias != bias_.device() || router_.bias == nullptr) {
        if (router_.bias && router_.bias != own)
          std::copy_n(router_.bias, cfg_.experts, own);
        else if (!router_.bias)
          std::fill_n(own, cfg_.experts, 0.f);
        router_.bias = bias_.device();
      }
      space_.to_device(bias_, 0, cfg_.experts);
    }
  }

  void allocate_workspace() {
    const index_t T = cfg_.max_tokens, K = width_, E = cfg_.experts, H = cfg_.hidden;
    const index_t N = cfg_.shared_experts;
    // A pass's grouped GEMMs: three per unit and per shared expert (the gate's are not).
    space_.reserve(3 * units_max() + 3 * static_cast<int>(N) + 2,
                   std::max(1, placement_.slots_per_rank()),
                   std::max(layout_.plan_keys(), layout_.recv_buffer_rows) + 1);
    logits_ = space_.template allocate_mirror<float>(router_type::uses_gate ? T * E : 0);
    if constexpr (router_with_noise_gate<router_type>)
      noise_logits_ = space_.template allocate<float>(T * E);
    gate_scratch_ = space_.template allocate<value_type>(router::gate_scratch<router_type>(cfg_));
    if constexpr (batch_router<router_type>) {
      batch_floats_.resize(static_cast<std::size_t>(router_type::scratch_floats(cfg_)));
      batch_ints_.resize(static_cast<std::size_t>(router_type::scratch_ints(cfg_)));
    }
    if constexpr (router_type::uses_gate && has_probabilities<router_type>) {
      loss_probs_.resize(static_cast<std::size_t>(T * E));
      loss_acc_.resize(static_cast<std::size_t>(2 * E));
    }
    if constexpr (router_with_bias<router_type>) {
      bias_ = space_.template allocate_mirror<float>(E);
      load_send_.resize(static_cast<std::size_t>(cfg_.ranks * E));
      load_recv_.resize(static_cast<std::size_t>(cfg_.ranks * E));
      global_load_.resize(static_cast<std::size_t>(E));
    }
    ids_ = space_.template allocate_mirror<std::int32_t>(T * K);
    pass_counter_ = space_.template allocate_mirror<std::uint64_t>(1);
    shared_offsets_ = space_.template allocate_mirror<index_t>(2);
    weights_ = space_.template allocate_mirror<float>(T * K);
    const index_t shared_scratch =
        N > 0 ? T * expert_type::scratch_per_row(layout_.padded(cfg_.shared_width())) : 0;
    scratch_ = space_.template allocate<value_type>(
        std::max(layout_.expert_rows * expert_type::scratch_per_row(layout_.padded(cfg_.ffn)),
                 shared_scratch));
    if (N > 0) shared_in_ = space_.template allocate<value_type>(T * layout_.row_stride);
    if (home_terms()) shared_out_ = space_.template allocate<float>(T * H);
    if (cfg_.shared_gate) shared_scale_ = space_.template allocate<float>(T);
    stats_.timeline.reserve(static_cast<std::size_t>(3 * units_max()));
    stats_.recv_buffer_rows = ex_.receive_buffer_rows();
    if (cfg_.training) allocate_training();
  }

  // What a training forward keeps and backward works in: the experts' input rows of a whole
  // pass (every unit's), the routing weights' gradient, dlogits, dx's home-rank terms.
  void allocate_training() {
    if constexpr (requires { expert_type::backward_scratch_per_row(index_t{}); }) {
      const index_t T = cfg_.max_tokens, K = width_, E = cfg_.experts, H = cfg_.hidden;
      const index_t N = cfg_.shared_experts, S = layout_.row_stride;
      saved_in_ = space_.template allocate<value_type>(layout_.recv_rows * S);
      if (dedup) saved_out_ = space_.template allocate<value_type>(layout_.recv_rows * S);
      if (keep_per_row() > 0)
        saved_hidden_ = space_.template allocate<value_type>(layout_.recv_rows * keep_per_row());
      saved_at_.assign(static_cast<std::size_t>(units_max()), 0);
      weight_grad_ = space_.template allocate<float>(T * K);
      if (router_type::uses_gate) dlogits_ = space_.template allocate_mirror<float>(T * E);
      if constexpr (router_with_noise_gate<router_type>)
        dnoise_ = space_.template allocate<float>(T * E);
      if constexpr (requires { router_type::jitters_input; })
        jitter_dx_ = space_.template allocate<float>(T * H);
      dx_home_ = space_.template allocate<float>(T * H);
      if (N > 0) shared_dy_ = space_.template allocate<value_type>(T * S);
      if (cfg_.shared_gate) shared_ds_ = space_.template allocate<float>(T);
      plan_replicas();
      const index_t need = std::max(
          layout_.expert_rows * expert_type::backward_scratch_per_row(layout_.padded(cfg_.ffn)),
          N > 0 ? T * expert_type::backward_scratch_per_row(layout_.padded(cfg_.shared_width()))
                : index_t{0});
      if (need > scratch_.size()) scratch_ = space_.template allocate<value_type>(need);
      // Backward's grouped GEMMs: eight per unit, eleven per shared expert, two for the gate.
      space_.reserve(8 * units_max() + 11 * static_cast<int>(N) + 4,
                     std::max(1, placement_.slots_per_rank()),
                     std::max(layout_.plan_keys(), layout_.recv_buffer_rows) + 1);
    }
  }

  matrix_view<std::int32_t> ids_view(index_t T) const { return {ids_.device(), T, width_}; }
  matrix_view<float> weights_view(index_t T) const { return {weights_.device(), T, width_}; }
  routing_view device_routing() const { return {ids_view(tokens_), weights_view(tokens_)}; }
  exchange_context<space_type> context() const {
    return {space_, plan_.host(), plan_.device(), plan_.recv_blocks(), clock_, stats_};
  }

  // The stages a schedule drives, in the order route, plan, permute, shared, counts, then per
  // unit u (a chunk, or with max_recv_rows one round of a chunk): dispatch_start(u),
  // dispatch_wait(u), experts(u), combine_start(u), combine_wait(u); then reduce. A schedule
  // may interleave units and run shared while a dispatch is in flight. Each stage adds its
  // time into stats().time. space() is the layer's space (a schedule may ask it for more).
  struct stage_runner {
    moe_layer& l;
    int chunks() const { return l.ex_.units(l.plan_.host()); }
    const space_type& space() const { return l.space_; }
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
      l.timed(&stage_times::dispatch, u, [&] {
        auto x = l.context();
        l.ex_.start_dispatch(x, u);
      });
    }
    void dispatch_wait(int u) {
      l.timed(&stage_times::dispatch, u, [&] {
        auto x = l.context();
        l.ex_.wait_dispatch(x, u);
      });
    }
    void experts(int u) {
      l.timed(&stage_times::experts, u, [&] { l.do_experts(u); });
    }
    void combine_start(int u) {
      l.timed(&stage_times::combine, u, [&] {
        auto x = l.context();
        l.ex_.start_combine(x, u);
      });
    }
    void combine_wait(int u) {
      l.timed(&stage_times::combine, u, [&] {
        auto x = l.context();
        l.ex_.wait_combine(x, u);
      });
    }
    void reduce() {
      l.timed(&stage_times::reduce, [&] { l.do_reduce(); });
    }
  };

  // Backward runs the same schedule over the same exchange: only the stages around the
  // exchanges differ (route: the routing weights' and the router's backward; permute: the
  // combine's backward; experts: dX and dW; reduce: dx).
  struct backward_runner : stage_runner {
    void route() {
      this->l.timed(&stage_times::route, [&] { this->l.back_route(); });
    }
    void plan() {}  // the forward's plan
    void permute() {
      this->l.timed(&stage_times::permute, [&] { this->l.back_permute(); });
    }
    void shared() {
      this->l.timed(&stage_times::shared, [&] { this->l.back_shared(); });
    }
    void experts(int u) {
      this->l.timed(&stage_times::experts, u, [&] { this->l.back_experts(u); });
    }
    void reduce() {
      this->l.timed(&stage_times::reduce, [&] { this->l.back_reduce(); });
    }
  };

  // Runs one stage (of unit u, or -1) and notes its span on the stage clock, and which stage
  // ran last (what a failed pass names).
  template <class F>
  void timed(double stage_times::*stage, F&& f) {
    timed(stage, -1, std::forward<F>(f));
  }
  template <class F>
  void timed(double stage_times::*stage, int u, F&& f) {
    stage_now_ = stage;
    unit_now_ = u;
    const mark a = clock_.now();
    f();
    clock_.stage(stage, a, clock_.now());
  }

  void do_route() {
    const index_t T = tokens_;
    if (given_) return copy_given_routing();
    const std::int64_t first = std::int64_t{rank()} * cfg_.max_tokens;
    const matrix_view<float> logits(logits_.device(), router_type::uses_gate ? T : 0, cfg_.experts);
    const matrix_view<float> noise(noise_logits_.data(), noise_logits_.data() ? T : 0,
                                   cfg_.experts);
    router::gate(
        router_, space_,
        gate_pass<value_type>{x_, w_.gate, w_.noise_gate, logits, noise, gate_scratch_.data(),
                              token_ids_.empty() ? nullptr : token_ids_.data(), first, pass_,
                              pass_counter_.device()});
    const router::route_options opt{.noise = noise,
                                    .token_ids = token_ids_,
                                    .first_token = first,
                                    .pass = pass_,
                                    .pass_counter = pass_counter_.device(),
                                    .float_scratch = batch_floats_,
                                    .int_scratch = batch_ints_};
    if constexpr (token_router<router_type>) {
      detail::run_router(router_, cfg_, logits, {ids_view(T), weights_view(T)}, opt, space_);
    } else {  // a batch decides on the host: logits there, routing back (no-ops on the host)
      space_.to_host(logits_, 0, T * cfg_.experts);
      space_.synchronize();
      detail::run_router(router_, cfg_, {logits_.host(), T, cfg_.experts},
                         {{ids_.host(), T, width_}, {weights_.host(), T, width_}}, opt,
                         router::serial{});
      space_.to_device(ids_, 0, T * width_);
      space_.to_device(weights_, 0, T * width_);
    }
  }

  // A user-supplied routing (host memory, checked by forward) into the layer's buffers.
  void copy_given_routing() {
    const index_t T = tokens_;
    for (index_t t = 0; t < T; ++t)
      for (int k = 0; k < width_; ++k) {
        ids_.host()[t * width_ + k] = given_->ids(t, k);
        weights_.host()[t * width_ + k] = given_->weights(t, k);
      }
    space_.to_device(ids_, 0, T * width_);
    space_.to_device(weights_, 0, T * width_);
  }

  void do_plan() {
    dispatch_plan& p = plan_.host();
    limit_ = capacity_.limit(cfg_, tokens_);
    const token_origin origin{rank(), token_ids_.empty() ? nullptr : token_ids_.data(),
                              std::int64_t{rank()} * cfg_.max_tokens};
    build_send_plan(space_, device_routing(), where_, cfg_.experts, limit_, layout_.pad_rows,
                    origin, p, plan_.device(), plan_.scratch());
    if constexpr (dedup)
      build_dedup_plan(space_, device_routing(), p, plan_.device(), plan_.scratch());
    if constexpr (hierarchical) build_node_plan(space_, p, plan_.device(), plan_.scratch());
    if (!deferred()) space_.to_host(plan_.send_blocks(), 0, plan_.send_blocks().size());
  }

  // Send rows: one per assignment, or with dedup one per (token, destination rank); their
  // count is the plan's last offset, in the space's memory.
  void do_permute() {
    const dispatch_plan& p = plan_.host();
    const device_plan& d = plan_.device();
    if constexpr (hierarchical)
      space_.for_each_row_n(d.node_offsets + p.chunks * p.nodes(), layout_.node_rows, cfg_.hidden,
                            rows::gather<value_type>{x_, p.node_token, send_view()});
    else if constexpr (dedup)
      space_.for_each_row_n(d.unique_offsets + p.chunks * cfg_.ranks, layout_.send_rows,
                            cfg_.hidden, rows::gather<value_type>{x_, p.unique_token, send_view()});
    else
      space_.for_each_row_n(d.send_offsets + p.blocks(), layout_.send_rows, cfg_.hidden,
                            rows::gather<value_type>{x_, p.row_token, send_view()});
  }

  // The home rank's terms: shared experts on every token (each scaled per token by its
  // gate, config shared_gate) and the output bias; their sum waits in shared_out for reduce.
  bool home_terms() const { return cfg_.shared_experts > 0 || cfg_.output_bias; }
  void do_shared() {
    const index_t N = cfg_.shared_experts, T = tokens_, H = cfg_.hidden;
    stats_.shared_flops = 0;
    if (!home_terms() || T == 0) return;
    const value_type* bias = cfg_.output_bias ? w_.output_bias.data : nullptr;
    if (N == 0) {
      space_.for_each_row(
          T, H,
          rows::accumulate<value_type>{{nullptr, T, H}, shared_out_.data(), true, nullptr, bias});
      return;
    }
    const matrix_view<value_type> in(shared_in_.data(), T, H, layout_.row_stride);
    shared_offsets_.host()[1] = T;
    space_.to_device(shared_offsets_, 0, 2);
    for (index_t n = 0; n < N; ++n) {
      float* scale = cfg_.shared_gate ? shared_scale_.data() : nullptr;
      if (scale)
        space_.for_each(T, rows::sigmoid_dot<value_type>{x_, w_.shared_gate.row(n), scale});
      space_.for_each_row(T, H, rows::copy<value_type>{x_, in});
      expert_type::forward(
          space_, expert_type::slice(w_.shared, n, 1),
          grouped_rows<value_type>{in.data, H, in.stride, 1, shared_offsets_.host(),
                                   shared_offsets_.device(), layout_.align},
          scratch_.data());
      space_.for_each_row(T, H,
                          rows::accumulate<value_type>{in, shared_out_.data(), n == 0, scale,
                                                       n == 0 ? bias : nullptr});
    }
    stats_.shared_flops = double(N * T) * expert_type::flops_per_row(H, cfg_.shared_width());
  }

  // The counts exchange; it also tells every rank whether all accepted their inputs (with
  // static shapes on a device: after the pass, see synchronize()).
  void do_counts() {
    auto x = context();
    const int rejected = ex_.counts(x, !input_error_, static_shapes() ? layout_.pad_rows : 0);
    if (deferred()) return;
    agreed_failure_ = input_error_ || rejected >= 0;  // every rank throws here: no abort
    if (input_error_) std::rethrow_exception(std::exchange(input_error_, nullptr));
    if (rejected >= 0)
      throw input_error(std::string(call_) + " inputs of rank " + std::to_string(rejected),
                        "rejected",
                        "every rank must pass valid inputs; no rank ran this pass (rank " +
                            std::to_string(rejected) + " threw the reason)");
    count_plan_stats();
  }

  // The plan's counts into the stats (its host arrays arrived with the counts).
  void count_plan_stats() const {
    dispatch_plan& p = plan_.host();
    count_send_plan(p, cfg_.experts);
    stats_.tokens = tokens_;
    stats_.assignments = p.assignments;
    stats_.dropped = p.dropped;
    stats_.capacity = std::same_as<capacity_type, capacity::dropless>
                          ? std::nullopt
                          : std::optional<index_t>(limit_);
    stats_.padding_rows = p.padding;
    std::copy_n(p.routed, cfg_.experts, stats_.routed_per_expert.begin());
    stats_.expert_imbalance = imbalance::of(stats_.routed_per_expert);
  }

  void do_experts(int u) {
    auto x = context();
    const mark t0 = clock_.now();
    const grouped_rows<value_type> rows = ex_.expert_rows(x, u);
    if (cfg_.training) save_expert_rows(saved_in_, rows, u, true);
    if constexpr (expert_keeps)
      expert_type::forward(space_, w_.experts, rows, scratch_.data(), kept_hidden(u));
    else
      expert_type::forward(space_, w_.experts, rows, scratch_.data());
    if (dedup && cfg_.training) save_expert_rows(saved_out_, rows, u, false);
    ex_.progress();
    stats_.expert_flops +=
        static_cast<double>(rows.rows()) * expert_type::flops_per_row(cfg_.hidden, cfg_.ffn);
    const dispatch_plan& p = plan_.host();
    clock_.event(ex_.chunk_of_unit(p, u), stage_kind::experts, ex_.round_of_unit(p, u), rows.rows(),
                 0, t0, clock_.now());
  }

  void do_reduce() {
    const dispatch_plan& p = plan_.host();
    const float* shared = home_terms() && tokens_ > 0 ? shared_out_.data() : nullptr;
    if constexpr (dedup)
      space_.for_each_row(
          tokens_, cfg_.hidden,
          rows::sum_unique<value_type>{send_view(), home_slot(p), width_, shared, y_});
    else
      space_.for_each_row(
          tokens_, cfg_.hidden,
          rows::weighted_reduce<value_type>{send_view(), p.slot, weights_view(tokens_), shared, y_,
                                            ex_.verdicts(p), ex_.verdict_stride(p), cfg_.ranks});
  }

  // --- training ---------------------------------------------------------------------------

  void check_backward(matrix_view<const value_type> dy, matrix_view<value_type> dx,
                      const gradients& g) const {
    detail::require(cfg_.training, "config.training", cfg_.training,
                    "must be true for backward (forward then keeps what backward needs)");
    detail::require(saved_, "backward", "no saved forward",
                    "needs a forward pass first, and runs once per forward");
    const index_t T = tokens_, H = cfg_.hidden;
    detail::require_shape(dy, T, H, "dy");
    detail::require_shape(dx, T, H, "dx");
    check_grads(g);
    const loss_scales& ls = back_opt_.losses;
    const bool losses = ls.aux != 0 || ls.seq_aux != 0 || ls.z != 0;
    for (double v : {ls.aux, ls.seq_aux, ls.z})
      detail::require(std::isfinite(v), "backward_options.losses", v, "must be finite");
    if constexpr (!has_probabilities_backward<router_type>)
      detail::require(!losses, "backward_options.losses", "nonzero",
                      "this router's losses have no gradient (no probabilities_backward): "
                      "leave them 0");
  }
  void check_grads(const gradients& g) const {
    const index_t H = cfg_.hidden;
    if constexpr (router_type::uses_gate)
      detail::require_shape(g.gate, cfg_.experts, H, "grads.gate");
    if constexpr (requires { expert_type::validate(g.experts, 0, 0, 0, std::string{}); }) {
      expert_type::validate(g.experts, placement_.slots_per_rank(), H, cfg_.ffn, "grads.experts");
      if (cfg_.shared_experts > 0)
        expert_type::validate(g.shared, cfg_.shared_experts, H, cfg_.shared_width(),
                              "grads.shared");
    }
    if (cfg_.shared_gate)
      detail::require_shape(g.shared_gate, cfg_.shared_experts, H, "grads.shared_gate");
    if (cfg_.output_bias) detail::require_shape(g.output_bias, 1, H, "grads.output_bias");
    if (noisy_training()) detail::require_shape(g.noise_gate, cfg_.experts, H, "grads.noise_gate");
  }
  // Whether the gate saw x ⊙ m (input jitter while training).
  bool jittered() const {
    if constexpr (requires { router_type::jitters_input; })
      return router_.training;
    else
      return false;
  }
  // Whether passes draw routing noise through a noise gate (noisy top-k while training).
  bool noisy_training() const {
    if constexpr (router_with_noise_gate<router_type>)
      return router_.training;
    else
      return false;
  }

  // A training forward keeps each unit's expert input rows (the backward's x) and, with
  // dedup, their outputs (the routing weights' gradient is taken on the expert rank).
  void save_expert_rows(buffer<value_type>& into, const grouped_rows<value_type>& rows, int u,
                        bool inputs) {
    const index_t n = rows.rows(), S = layout_.row_stride;
    if (inputs) {
      if (saved_rows_ + n > layout_.recv_rows)
        throw std::logic_error("epmoe: a pass's expert rows exceed the saved-input workspace");
      saved_at_[static_cast<std::size_t>(u)] = saved_rows_;
      saved_rows_ += n;
    }
    const index_t at = saved_at_[static_cast<std::size_t>(u)];
    space_.for_each_row(n, cfg_.hidden,
                        rows::copy<value_type>{{rows.data, n, cfg_.hidden, S},
                                               {into.data() + at * S, n, cfg_.hidden, S}});
  }

  // Whether a training forward keeps the experts' hidden layers (config recompute off and an
  // expert policy that can), and where unit u's go.
  static constexpr bool expert_keeps = requires(const space_type& s, const expert_weights& w,
                                                grouped_rows<value_type> r, value_type* p) {
    expert_type::forward(s, w, r, p, p);
    expert_type::keep_per_row(index_t{});
  };
  index_t keep_per_row() const {
    if constexpr (expert_keeps)
      return cfg_.training && !cfg_.recompute ? expert_type::keep_per_row(layout_.padded(cfg_.ffn))
                                              : 0;
    else
      return 0;
  }
  value_type* kept_hidden(int u) const {
    const index_t per = keep_per_row();
    return per > 0 ? saved_hidden_.data() + saved_at_[static_cast<std::size_t>(u)] * per : nullptr;
  }

  // The experts' backward FLOPs per row (the policy's count, else twice the forward's).
  double backward_flops_per_row() const {
    const index_t H = cfg_.hidden, F = cfg_.ffn;
    if constexpr (requires { expert_type::backward_flops_per_row(H, F, true); })
      return expert_type::backward_flops_per_row(H, F, keep_per_row() == 0);
    else
      return 2.0 * expert_type::flops_per_row(H, F);
  }

  // One group of all T rows (the gate's and the shared experts' GEMMs).
  template <class T>
  grouped_rows<T> all_rows(T* data, index_t cols, index_t stride) const {
    return {data, cols, stride, 1, shared_offsets_.host(), shared_offsets_.device(), 1};
  }

  // The routing weights' gradient from the combined outputs, still in the send buffer (with
  // dedup it is taken on the expert ranks and comes home with the combine).
  void back_route() {
    if (input_error_) return;
    const index_t T = tokens_;
    shared_offsets_.host()[0] = 0;
    shared_offsets_.host()[1] = T;
    space_.to_device(shared_offsets_, 0, 2);
    space_.fill(dx_home_.data(), T * cfg_.hidden, 0.f);
    if constexpr (!dedup)
      space_.for_each(T, rows::routing_weight_grad<value_type>{dy_, send_view(), plan_.host().slot,
                                                               weight_grad_view()});
  }
  // Which local slots hold a replicated expert: each such expert's index among them
  // (reduce_gradients sums its copies' gradients), and the staging buffers sized for it.
  void plan_replicas() {
    const int R = cfg_.ranks, L = placement_.slots_per_rank(), E = cfg_.experts;
    std::vector<int> copies(static_cast<std::size_t>(E), 0), index(copies.size(), -1);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < L; ++j) ++copies[placement_.expert_at(r, j)];
    int q = 0;
    for (int e = 0; e < E; ++e)
      if (copies[e] > 1) index[e] = q++;
    replica_of_slot_.assign(static_cast<std::size_t>(L), -1);
    for (int j = 0; j < L; ++j) replica_of_slot_[j] = index[placement_.expert_at(rank(), j)];
    replicas_ = q;
    gradients none{};
    const index_t n = stage_segments(none, true, true);
    const index_t padded = (n + R - 1) / R * R;
    if (!stage_.host() || stage_.size() < padded)
      stage_ = space_.template allocate_mirror<float>(std::max<index_t>(padded, 1));
    reduce_send_.assign(static_cast<std::size_t>(std::max<index_t>(padded, 1)), 0.f);
    reduce_recv_.assign(reduce_send_.size(), 0.f);
  }

  // Every tensor reduce_gradients sums, in a fixed order, copied into the staging buffer
  // (`in`) or back out of it; returns the elements. `count_only`: sizes only (construction).
  index_t stage_segments(gradients& g, bool in, bool count_only = false) {
    index_t at = 0;
    const auto seg = [&](matrix_view<float> m) {
      if (!count_only && m.rows > 0) {
        const matrix_view<float> st(stage_.device() + at, m.rows, m.cols, m.cols);
        if (in)
          space_.for_each_row(m.rows, m.cols, rows::copy<float>{m, st});
        else
          space_.for_each_row(m.rows, m.cols, rows::copy<float>{st, m});
      }
      at += m.rows * m.cols;
    };
    const index_t E = cfg_.experts, H = cfg_.hidden, N = cfg_.shared_experts;
    if constexpr (router_type::uses_gate)
      seg(count_only ? matrix_view<float>{nullptr, E, H} : g.gate);
    if constexpr (router_with_noise_gate<router_type>)
      seg(count_only ? matrix_view<float>{nullptr, E, H} : g.noise_gate);
    if constexpr (requires { expert_type::tensors(g.shared); }) {
      // The shapes come from the weights (the same as the gradients').
      auto ws = expert_type::tensors(w_.shared);
      auto gs = expert_type::tensors(g.shared);
      for (std::size_t t = 0; t < ws.size(); ++t)
        for (index_t n = 0; n < N; ++n)
          seg(count_only ? matrix_view<float>{nullptr, ws[t]->rows, ws[t]->cols} : (*gs[t])[n]);
      if (cfg_.shared_gate) seg(count_only ? matrix_view<float>{nullptr, N, H} : g.shared_gate);
      if (cfg_.output_bias) seg(count_only ? matrix_view<float>{nullptr, 1, H} : g.output_bias);
      // Replicated routed experts: expert q's tensors at a fixed place, zeros where this rank
      // holds no copy of it.
      auto we = expert_type::tensors(w_.experts);
      auto ge = expert_type::tensors(g.experts);
      index_t per = 0;
      for (auto* t : we) per += t->rows * t->cols;
      if (!count_only && in && replicas_ > 0)
        space_.fill(stage_.device() + at, replicas_ * per, 0.f);
      for (std::size_t j = 0; !count_only && j < replica_of_slot_.size(); ++j) {
        const int q = replica_of_slot_[j];
        if (q < 0) continue;
        index_t o = at + q * per;
        for (std::size_t t = 0; t < we.size(); ++t) {
          const matrix_view<float> m = (*ge[t])[static_cast<index_t>(j)];
          const matrix_view<float> st(stage_.device() + o, m.rows, m.cols, m.cols);
          if (in)
            space_.for_each_row(m.rows, m.cols, rows::copy<float>{m, st});
          else
            space_.for_each_row(m.rows, m.cols, rows::copy<float>{st, m});
          o += m.rows * m.cols;
        }
      }
      at += replicas_ * per;
    }
    return at;
  }

  matrix_view<float> weight_grad_view() const { return {weight_grad_.data(), tokens_, width_}; }

  // The router's backward into dlogits (+ the losses'), then dgate = dlogitsᵀ x and the
  // home-rank term dx += dlogits W_gate.
  void back_router() {
    if constexpr (router_type::uses_gate && router_with_backward<router_type>) {
      const index_t T = tokens_, H = cfg_.hidden, E = cfg_.experts;
      const matrix_view<float> dl(dlogits_.device(), T, E);
      const matrix_view<float> gate = grads_.gate;
      if (routing_given_) {  // no router ran: the gate gets nothing
        if (!back_opt_.accumulate)
          for (index_t e = 0; e < E; ++e) space_.fill(gate.row(e), H, 0.f);
        return;
      }
      const matrix_view<const float> logits(logits_.device(), T, E);
      const bool noisy = noisy_training();
      const matrix_view<float> dn(dnoise_.data(), noisy ? T : 0, E);
      space_.for_each(
          T, rows::backward_tokens<router_type>{router_,
                                                logits,
                                                ids_view(T),
                                                weight_grad_view(),
                                                dl,
                                                {noise_logits_.data(), noisy ? T : 0, E},
                                                dn,
                                                token_ids_.empty() ? nullptr : token_ids_.data(),
                                                std::int64_t{rank()} * cfg_.max_tokens,
                                                pass_ - 1});
      const loss_scales& ls = back_opt_.losses;
      if constexpr (has_probabilities_backward<router_type>)
        if (ls.aux != 0 || ls.seq_aux != 0 || ls.z != 0) {  // the losses are host code
          space_.to_host(logits_, 0, T * E);
          space_.to_host(dlogits_, 0, T * E);
          const routing_view r = last_routing();  // waits for both copies
          loss_backward(router_, cfg_, {logits_.host(), T, E}, r, ls, {dlogits_.host(), T, E},
                        std::span<float>(loss_probs_), std::span<double>(loss_acc_));
          space_.to_device(dlogits_, 0, T * E);
        }
      // The gate's input: x, or x ⊙ m with input jitter (its dx term then goes through m).
      const bool jit = jittered();
      const value_type* gx = jit ? gate_scratch_.data() : x_.data;
      const index_t gs = jit ? H : x_.stride;
      float* dxg = jit ? jitter_dx_.data() : dx_home_.data();
      const auto project_back = [&](matrix_view<const float> d, matrix_view<const value_type> w,
                                    matrix_view<float> dw, bool dx_adds) {
        // A projection logits = x Wᵀ: dW (+)= dᵀ x, dx (+)= d W.
        const grouped_rows<const float> a = all_rows<const float>(d.data, E, E);
        space_.grouped_gemm_tn_accumulate(
            a, all_rows<const value_type>(gx, H, gs),
            stacked_view<float>(dw.data, 1, E, H, dw.stride, E * dw.stride), back_opt_.accumulate);
        space_.grouped_gemm_nn(
            a, stacked_view<const value_type>(w.data, 1, E, H, w.stride, E * w.stride),
            all_rows<float>(dxg, H, H), dx_adds);
      };
      project_back(dl, w_.gate, gate, !jit);
      if (noisy) project_back(dn, w_.noise_gate, grads_.noise_gate, true);  // the noise gate
      if constexpr (requires { typename router_type::unjittered; })
        if (jit)
          space_.for_each_row(
              T, H,
              typename router_type::unjittered{router_, dxg, dx_home_.data(), H,
                                               token_ids_.empty() ? nullptr : token_ids_.data(),
                                               std::int64_t{rank()} * cfg_.max_tokens, pass_ - 1});
    }
  }

  // The combine's backward: each kept assignment's send row = its weight times dy (padding
  // rows zero: their dW terms must vanish).
  void back_permute() {
    if (input_error_) return;
    const dispatch_plan& p = plan_.host();
    if constexpr (hierarchical) {  // one dy row per (token, node)
      space_.for_each_row_n(plan_.device().node_offsets + p.chunks * p.nodes(), layout_.node_rows,
                            cfg_.hidden, rows::gather<value_type>{dy_, p.node_token, send_view()});
      return;
    } else if constexpr (dedup) {  // one dy row per (token, rank): weighted on the expert rank
      space_.for_each_row_n(plan_.device().unique_offsets + p.chunks * cfg_.ranks,
                            layout_.send_rows, cfg_.hidden,
                            rows::gather<value_type>{dy_, p.unique_token, send_view()});
      return;
    }
    if constexpr (capacity_type::pads)
      space_.fill(ex_.send_buffer(), layout_.send_rows * layout_.row_stride, value_type{});
    space_.for_each_row(
        tokens_, cfg_.hidden,
        rows::scatter_weighted<value_type>{dy_, p.slot, weights_view(tokens_), send_view()});
  }

  // The home rank's terms: each shared expert's backward on all T tokens (its gate's, when
  // scaled), and the output bias's gradient (dy's column sums).
  void back_shared() {
    if (input_error_) return;
    const index_t N = cfg_.shared_experts, T = tokens_, H = cfg_.hidden, S = layout_.row_stride;
    const bool acc = back_opt_.accumulate;
    if (cfg_.output_bias)
      space_.for_each(
          H, rows::column_sum<value_type, float>{dy_, nullptr, grads_.output_bias.data, acc});
    if constexpr (requires { expert_type::backward_scratch_per_row(index_t{}); })
      for (index_t n = 0; n < N; ++n) {
        const matrix_view<value_type> in(shared_in_.data(), T, H, S), d(shared_dy_.data(), T, H, S);
        const auto w = expert_type::slice(w_.shared, n, 1);
        float* scale = cfg_.shared_gate ? shared_scale_.data() : nullptr;
        space_.for_each_row(T, H, rows::copy<value_type>{x_, in});
        if (scale) {  // s = σ(x · g_n); its logit's gradient (dy · o) s (1 - s), o recomputed
          const value_type* gn = w_.shared_gate.row(n);
          space_.for_each(T, rows::sigmoid_dot<value_type>{x_, gn, scale});
          space_.for_each_row(T, H, rows::copy<value_type>{x_, d});
          expert_type::forward(space_, w, all_rows<value_type>(d.data, H, S), scratch_.data());
          space_.for_each(T, rows::sigmoid_dot_grad<value_type>{dy_, d, scale, shared_ds_.data()});
          space_.for_each(H, rows::column_sum<value_type, float>{x_, shared_ds_.data(),
                                                                 grads_.shared_gate.row(n), acc});
          space_.for_each_row(
              T, H, rows::add_outer<value_type>{dx_home_.data(), H, shared_ds_.data(), gn});
        }
        space_.for_each_row(T, H, rows::scaled_copy<value_type>{dy_, scale, d});
        const grouped_rows<value_type> drows = all_rows<value_type>(d.data, H, S);
        expert_type::backward(space_, w, all_rows<const value_type>(in.data, H, S),
                              grouped_rows<const value_type>(drows), drows,
                              expert_type::slice(grads_.shared, n, 1), scratch_.data(), acc);
        space_.for_each_row(T, H, rows::accumulate<value_type>{d, dx_home_.data(), false});
      }
  }

  // dX and dW of unit u's rows: dy rows arrived in the expert buffer, x rows were saved by the
  // forward; dX overwrites dy there for the combine.
  void back_experts(int u) {
    if constexpr (requires { expert_type::backward_scratch_per_row(index_t{}); }) {
      auto x = context();
      const mark t0 = clock_.now();
      const grouped_rows<value_type> rows = ex_.expert_rows(x, u);
      const index_t at = saved_at_[static_cast<std::size_t>(u)] * layout_.row_stride;
      const grouped_rows<const value_type> in =
          rows.over(static_cast<const value_type*>(saved_in_.data()) + at, cfg_.hidden);
      if constexpr (dedup) {  // each received row's weight gradient, then its dy times weight
        const auto r = ex_.received(plan_.host(), u);
        const index_t H = cfg_.hidden, S = layout_.row_stride;
        space_.for_each(r.n, exchange_ops::dedup_weight_grad<value_type>{
                                 r.expert_row,
                                 r.meta,
                                 {rows.data, rows.rows(), H, S},
                                 {saved_out_.data() + at, rows.rows(), H, S},
                                 ex_.weight_grad_recv() + r.first});
      }
      const bool acc = back_opt_.accumulate || grads_started_;
      if constexpr (expert_keeps)
        expert_type::backward(space_, w_.experts, in, grouped_rows<const value_type>(rows), rows,
                              grads_.experts, scratch_.data(), acc,
                              static_cast<const value_type*>(kept_hidden(u)));
      else
        expert_type::backward(space_, w_.experts, in, grouped_rows<const value_type>(rows), rows,
                              grads_.experts, scratch_.data(), acc);
      grads_started_ = true;
      ex_.progress();
      stats_.expert_flops += static_cast<double>(rows.rows()) * backward_flops_per_row();
      const dispatch_plan& p = plan_.host();
      clock_.event(ex_.chunk_of_unit(p, u), stage_kind::experts, ex_.round_of_unit(p, u),
                   rows.rows(), 0, t0, clock_.now());
    }
  }

  // The router's backward (its weights' gradients are all home now), then dx = the home-rank
  // terms + the sum of each token's kept assignments' dX rows (with dedup one per rank).
  void back_reduce() {
    if (input_error_) return;
    const dispatch_plan& p = plan_.host();
    if constexpr (dedup)
      space_.for_each(tokens_,
                      rows::gather_weight_grad{ex_.weight_grad_send(), p.slot, weight_grad_view()});
    back_router();
    if constexpr (dedup)
      space_.for_each_row(
          tokens_, cfg_.hidden,
          rows::sum_unique<value_type>{send_view(), home_slot(p), width_, dx_home_.data(), dx_});
    else
      space_.for_each_row(
          tokens_, cfg_.hidden,
          rows::weighted_reduce<value_type>{
              send_view(), p.slot, {nullptr, tokens_, width_}, dx_home_.data(), dx_});
  }

  // Dedup: the send row whose combined sum comes home for each assignment (hierarchical:
  // its node row, else its rank's unique row).
  static const std::int32_t* home_slot(const dispatch_plan& p) {
    return hierarchical ? p.node_slot : p.unique_slot;
  }

  matrix_view<value_type> send_view() const {
    return {ex_.send_buffer(), layout_.send_rows, cfg_.hidden, layout_.row_stride};
  }

  // Fills what a pass leaves for later: stage times from the clock's marks and the router's
  // losses from the pass's logits (after the space finished the pass).
  void resolve_stats() const {
    if (deferred()) space_.to_host(plan_.send_blocks(), 0, plan_.send_blocks().size());
    ex_.synchronize(space_);  // NCCL: a peer's failure or the deadline throws, never hangs
    pending_ = false;
    if (deferred()) {
      auto x = context();
      const int rejected = ex_.resolve(x);
      if (rejected >= 0)
        throw input_error("forward inputs of rank " + std::to_string(rejected), "rejected",
                          "every rank must pass valid inputs; no rank wrote y in that pass");
      count_plan_stats();
    }
    clock_.resolve(stats_);
    stats_.losses = {};
    if constexpr (router_type::uses_gate && has_probabilities<router_type>) {
      if (!routing_given_) {
        const index_t T = tokens_, E = cfg_.experts;
        space_.to_host(logits_, 0, T * E);
        const routing_view r = last_routing();
        compute_losses(router_, cfg_, {logits_.host(), T, E}, r, std::span<float>(loss_probs_),
                       std::span<double>(loss_acc_), stats_.losses);
      }
    }
  }
  // Static shapes on a device: the pass's counts are read after it (resolve_stats).
  bool deferred() const { return device_space<space_type> && static_shapes(); }

  layer_config cfg_;
  comm_type comm_;
  weights w_;
  router_type router_;
  capacity_type capacity_;
  space_type space_;
  placement_type placement_;
  decltype(placement_view(std::declval<const placement_type&>())) where_{
      placement_view(placement_)};
  std::vector<mirror<int>> placement_arrays_;  // a device space: the placement's arrays
  mutable pass_stats stats_;
  int width_;  // routing slots per token
  int chunks_max_ = 1, chunks_ = 1;
  workspace_layout layout_;
  mutable plan_storage<space_type> plan_;  // (mutable: stats() reads a static pass's counts)
  mutable exchange_type ex_;
  mutable pass_clock<space_type> clock_;

  mirror<float> logits_, weights_, bias_;
  mirror<std::int32_t> ids_;
  mirror<index_t> shared_offsets_;  // [2]: the shared experts' one group, all T tokens
  // The pass counter where the routers' noise reads it: a pass captured in a CUDA graph
  // advances it each time it is replayed.
  mirror<std::uint64_t> pass_counter_;
  buffer<float> noise_logits_, shared_out_, shared_scale_;
  buffer<value_type> gate_scratch_, scratch_, shared_in_;
  std::vector<float> batch_floats_;  // batch routers decide on the host
  std::vector<std::int32_t> batch_ints_;
  mutable std::vector<float> loss_probs_;  // losses are computed on the host
  mutable std::vector<double> loss_acc_;
  std::vector<index_t> load_send_, load_recv_, global_load_;
  std::vector<mirror<value_type>> owned_experts_;  // expert weights after a live re-placement
  std::vector<mirror<index_t>> owned_desc_;        // their first copy's block offsets
  [[no_unique_address]] typename detail::packed_store_of<space_type>::type packed_;
  packed_precision pack_as_ = options.pack_as;
  std::chrono::steady_clock::time_point built_ = std::chrono::steady_clock::now();

  matrix_view<const value_type> x_;
  matrix_view<value_type> y_;
  std::span<const std::int64_t> token_ids_;
  const routing_view* given_ = nullptr;  // a user-supplied routing for this pass, else null
  bool routing_given_ = false;           // the last pass's routing was given (no losses)
  std::exception_ptr input_error_;       // this rank's rejected input, thrown at counts
  index_t tokens_ = 0;
  index_t limit_ = 0;             // the capacity of this pass's slots
  const char* call_ = "forward";  // which call's inputs the counts exchange judges
  // Failure (issue 23): the stage running and its unit; whether the pass's failure is one
  // every rank agreed on (rejected inputs); what broke this layer (empty: usable).
  using stage_field = double stage_times::*;  // (an alias: nvcc warns on the plain form)
  stage_field stage_now_ = nullptr;
  int unit_now_ = -1;
  bool agreed_failure_ = false;
  std::string failed_;

  // Training (config training): what forward keeps, and backward's arguments and buffers.
  buffer<value_type> saved_in_;      // the experts' input rows of the pass, unit after unit
  buffer<value_type> saved_out_;     // dedup: their outputs
  buffer<value_type> saved_hidden_;  // without recompute: their hidden layers (keep_per_row)
  std::vector<index_t> saved_at_;    // [units]: each unit's first saved row
  index_t saved_rows_ = 0;
  bool saved_ = false;          // a forward's state waits for its backward
  bool grads_started_ = false;  // a unit wrote the expert gradients of this backward
  buffer<float> weight_grad_, dx_home_, shared_ds_, dnoise_, jitter_dx_;
  mirror<float> dlogits_;
  buffer<value_type> shared_dy_;
  matrix_view<const value_type> dy_;
  matrix_view<value_type> dx_;
  gradients grads_;
  backward_options back_opt_;
  // reduce_gradients: each local slot's index among the replicated experts (-1: one copy),
  // and the staging buffers.
  std::vector<int> replica_of_slot_;
  int replicas_ = 0;
  mirror<float> stage_;
  std::vector<float> reduce_send_, reduce_recv_;
  std::uint64_t pass_ = 0;
  mutable bool pending_ = false;  // stats() has marks and losses to resolve
};

}  // namespace epmoe
