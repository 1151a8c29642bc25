// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
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
#include "epmoe/core/options.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/core/weighting.hpp"
#include "epmoe/core/workspace.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/parts/home.hpp"
#include "epmoe/parts/lifecycle.hpp"
#include "epmoe/parts/pass.hpp"
#include "epmoe/parts/placement.hpp"
#include "epmoe/parts/router.hpp"
#include "epmoe/parts/sizes.hpp"
#include "epmoe/parts/split.hpp"
#include "epmoe/parts/stages.hpp"
#include "epmoe/parts/training.hpp"
#include "epmoe/parts/weights.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/placement/relocate.hpp"
#include "epmoe/placement/table.hpp"
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
  static constexpr layer_options options{};
};

/// One rank's share of an expert-parallel MoE layer, on any space (host threads, CUDA).
/// Each forward routes the rank's T tokens, sends every (token, expert) row to the rank
/// holding that expert (all-to-all #1), runs the local experts on what arrives, returns the
/// outputs (all-to-all #2) and sums each token's K outputs, weighted, at home. Every rank makes
/// the same calls in the same order (T may differ, even be 0); a pass allocates nothing. The
/// layer composes parts (docs/architecture.md, parts/*.hpp).
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
  /// Where the routing weight applies: the expert's output (weighting::output, the default) or
  /// its input (weighting::input, Llama 4); core/weighting.hpp.
  using weighting_type = decltype(detail::weighting_of<Policies>());
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
  static_assert(!(dedup && weighting_type::weighted_send == weighting::direction::forward),
                "epmoe: weighting::input scales each assignment's row by its own weight, and "
                "per-rank dedup sends one row per (token, rank), which cannot carry two scales: "
                "use the flat exchange (options.dedup = false, hierarchical = false)");
  static_assert(!(options.low_latency && (dedup || capacity_type::pads)),
                "epmoe: options.low_latency moves flat rows in slots sized from max_tokens: it "
                "does not combine with dedup, hierarchical or padded capacity");
  /// Whether the comm can start an exchange and wait for it later; without it every exchange
  /// blocks and a pipelined schedule has nothing to overlap.
  static constexpr bool async_comm = transport<comm_type, space_type>::async;
  /// Exchange units a schedule keeps in flight: with config max_recv_rows the receive buffer
  /// holds this many rounds at once (sequential: one; pipelined: dispatch of i+1, experts of
  /// i, combine of i-1). A schedule may declare `static constexpr int units_in_flight`.
  static constexpr int units_in_flight = units_in_flight_of<schedule_type>();

  using expert_weights = typename expert_type::template weights_of<value_type>;
  /// The weights one rank holds (non-owning views in the space's memory; they must outlive
  /// the layer): gate [E, H], experts (this rank's slots, local-slot order), shared [N],
  /// noise_gate [E, H], shared_gate [N, H], output_bias [1, H].
  using weights = layer_weights<value_type, expert_weights>;
  using expert_grads = decltype(detail::expert_grads_of<expert_type>());
  /// Gradients of one rank's parameters (float, in the space's memory), shaped as `weights`.
  using gradients = layer_gradients<expert_grads>;
  using backward_options = epmoe::backward_options;

  /// Validates everything (throws config_error naming the field), agrees with the other
  /// ranks (collective), and sizes the workspace. The placement defaults to
  /// placement_type(cfg); `w.experts` holds this rank's slots in local-slot order.
  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router = {},
            capacity_type capacity = {})
      : moe_layer(cfg, std::move(comm), w, router, capacity, placement_type(cfg)) {}

  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router,
            capacity_type capacity, placement_type placement, space_type space = {})
      : moe_layer(cfg, std::move(comm), w, router, capacity, std::move(placement), std::move(space),
                  false) {}
  moe_layer(const moe_layer&) = delete;
  moe_layer& operator=(const moe_layer&) = delete;

  /// Chunks of the next passes (1 .. the config's chunks, or the schedule's default): the
  /// run-time override of a pipelined schedule's overlap degree. Every rank must set the same
  /// (a difference is named by the next call, on every rank).
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
  /// Invalid inputs (or any failure before the pass's first exchange) throw on this rank and
  /// input_error on every peer, before any row moves and with y untouched. Returns the pass,
  /// whose handle a training layer's backward consumes (unless `opt` says it keeps nothing).
  pass_handle forward(matrix_view<const value_type> x, matrix_view<value_type> y,
                      std::span<const std::int64_t> token_ids = {},
                      const forward_options& opt = {}) {
    split_.idle("forward");
    return parts::forward_stages<moe_layer>::run(*this, x, y, token_ids, nullptr, opt, [&] {
      parts::check_pass_inputs(x, y, cfg_);
      parts::check_token_ids<router_type>(token_ids, x.rows);
      router_.check_token_ids(space_, token_ids);
      router_.check(space_, store_.views().noise_gate);
    });
  }

  /// The same with the routing given instead of computed: ids [T, K] in [0, E) (or
  /// no_expert = -1 for an empty slot), distinct within a token, weights [T, K] finite and >= 0,
  /// K = the router's top_k (E for expert choice), host memory. The router and its gate are
  /// not used; losses are zero. A bad entry throws input_error naming it
  /// ("routing.ids[5][1] = 99: must be in [0, 64)") on this rank and input_error on every peer,
  /// before any row moves; y is untouched. Its backward can return the weights' gradient
  /// (backward_options::routing_grad).
  pass_handle forward(matrix_view<const value_type> x, routing_view routing,
                      matrix_view<value_type> y, const forward_options& opt = {}) {
    split_.idle("forward");
    return parts::forward_stages<moe_layer>::run(*this, x, y, {}, &routing, opt, [&] {
      parts::check_pass_inputs(x, y, cfg_);
      parts::check_given_routing(routing, x.rows, cfg_.scored_experts(), layout_.width);
    });
  }

  /// Split phase (docs/decode.md): the forward above in two calls, for two-batch overlap.
  /// start posts the dispatch of y = MoE(x) and returns (x and y must stay valid until
  /// finish); the caller computes meanwhile; finish(h) runs the experts and the combine and
  /// writes y (or experts(h) first). Collective like forward, with the same input checks (a
  /// rejected input: every rank throws at start, nothing is written); forward only (the pass keeps
  /// nothing for a backward). One split pass per layer; epmoe::split_layer keeps several in flight.
  split_handle start(matrix_view<const value_type> x, matrix_view<value_type> y,
                     std::span<const std::int64_t> token_ids = {}) {
    return parts::split_stages<moe_layer>::start_pass(*this, x, y, token_ids, [&] {
      parts::check_pass_inputs(x, y, cfg_);
      parts::check_token_ids<router_type>(token_ids, x.rows);
      router_.check_token_ids(space_, token_ids);
      router_.check(space_, store_.views().noise_gate);
    });
  }
  /// Optional, between start and finish: runs the experts and posts the combine (finish then
  /// waits for it); the caller computes meanwhile (two-batch overlap: the other batch's experts).
  void experts(split_handle h) { parts::split_stages<moe_layer>::experts_pass(*this, h); }
  void finish(split_handle h) { parts::split_stages<moe_layer>::finish_pass(*this, h); }

  // --- training (docs/training.md) ------------------------------------------------------

  /// The backward of the last forward (config `training`), collective like forward: from
  /// dy = dL/dy [T, H] (T of that pass) writes dx = dL/dx [T, H] and every gradient of `grads`.
  /// Routing and capacity are held fixed: a dropped assignment gets no gradient. It reads the
  /// forward's x again (keep it unchanged) and consumes the forward's state: one backward per
  /// forward. Every rank first learns whether all accept their arguments and make the same
  /// call: otherwise every rank throws and nothing is written.
  void backward(matrix_view<const value_type> dy, matrix_view<value_type> dx,
                const gradients& grads, const backward_options& opt = {}) {
    backward(train_ ? train_->last() : pass_handle{}, dy, dx, grads, opt);
  }
  /// The same for the pass `pass` (what its forward returned): a stale one (the layer keeps its
  /// last forward only) or one consumed already is refused, by name.
  void backward(pass_handle pass, matrix_view<const value_type> dy, matrix_view<value_type> dx,
                const gradients& grads, const backward_options& opt = {}) {
    static_assert(checks::trains<space_type, expert_type, router_type>());
    life_.usable();
    split_.idle("backward");
    stats();  // the forward's numbers are read before the clock starts again
    std::exception_ptr bad;
    try {
      check_backward(pass, dy, dx, grads, opt);
    } catch (...) {
      bad = std::current_exception();
    }
    if (train_) {
      train_->consume(pass);  // whatever happens next
      train_->now = {dy, dx, grads, opt};
    }
    stats_.backward = true;
    stages::drive(*this, call_kind::backward, pass.id,
                  parts::backward_stages<moe_layer>{{*this}, bad, pass.id});
  }

  /// Collective, after backward: makes `grads` what an optimizer step needs on every rank.
  /// The replicated parameters' gradients (gate, shared experts, shared gate, output bias: each
  /// rank's holds its own tokens' share) become their sum over the ranks, and every copy of a
  /// replicated routed expert holds the sum over its copies. Each element is summed in rank
  /// order by one rank and sent to all, so every rank gets bit-identical values.
  void reduce_gradients(const gradients& grads) {
    stages::side_call(
        *this, call_kind::reduce_gradients,
        [&] {
          detail::require(cfg_.training, "config.training", cfg_.training,
                          "must be true for reduce_gradients (it sizes the staging buffers)");
          check_grads(grads);
        },
        [&] { train_->reduce(comm_, space_, cfg_, store_.views(), grads); });
  }

  /// Points the layer at other weights of the same shapes (a framework that replaced its
  /// parameter tensors, or moved them). Local, between passes: every rank rebinds its own;
  /// a bad view throws config_error naming it and the layer keeps the old ones. Not after a
  /// live re-placement (the layer then holds its own copy of the experts).
  void set_weights(const weights& w) {
    detail::require(!store_.owns_experts(), "set_weights", "after apply_placement",
                    "the layer owns its experts after a live re-placement; build a new layer");
    parts::check_layer<moe_layer>(cfg_, comm_, w, router_.policy(), where_.get());
    store_.rebind(space_, w, input_rows(), cfg_.shared_experts > 0);
  }

  /// Packs this rank's expert weights (routed and shared) into storage the layer owns, in
  /// the space's own layout (space::host: panels of 32 output columns that one pass reads
  /// once whatever the rows per expert); the passes then read the packed copies. Local. Call
  /// it again after changing the weights' values in place (an optimizer step).
  void pack_weights() { pack_weights(store_.precision()); }
  /// The same with packed copies in format `as` (weights_format::bf16: half the bytes per
  /// pass, the weights rounded to bf16; int8_channel: a quarter, forward only; the later
  /// repacks keep it).
  void pack_weights(packed_precision as) {
    static_assert(decltype(store_)::packs,
                  "epmoe: this space has no packed weight layout (space::host has one); drop "
                  "layer_options::pack_weights or pack_weights()");
    store_.pack(space_, as, input_rows(), cfg_.shared_experts > 0);
  }
  /// The same, loading weights quantised already (a checkpoint's FP8 and block scales, MXFP4
  /// blocks and scales): load(t, j, m) refills packed matrix m, slot j of expert tensor t
  /// (the expert's tensors() order; the shared experts' follow the routed ones), e.g. by
  /// m.repack_fp8(q, scale_inv), and returns true, or returns false to pack it from the views.
  /// The views should hold the loaded values dequantised (what an unpacked pass reads); a
  /// later repack (pack_weights(), set_weights, a live re-placement) quantises the views.
  template <class Load>
  void pack_weights(packed_precision as, Load&& load) {
    static_assert(decltype(store_)::packs,
                  "epmoe: this space has no packed weight layout (space::host has one)");
    store_.pack(space_, as, input_rows(), cfg_.shared_experts > 0, load);
  }
  /// Codes only (a quantised checkpoint served without its values): packs every expert matrix
  /// by load(t, j, m), as pack_weights' loader, which must fill each one. The views are then
  /// never read, so they may have no memory behind them (space::unbacked_tensors' views, bound
  /// at construction or by set_weights before any pass). Until set_weights binds views that
  /// hold values, the layer refuses what would read them: pack_weights() and unpack_weights(),
  /// backward, apply_placement, exclude_ranks. A load that throws leaves the layer refusing
  /// passes until a pack_codes succeeds. Local.
  template <class Load>
  void pack_codes(packed_precision as, Load&& load) {
    static_assert(decltype(store_)::packs,
                  "epmoe: this space has no packed weight layout (space::host has one)");
    store_.pack_codes(space_, as, input_rows(), cfg_.shared_experts > 0, load);
  }
  /// Whether the weights' views hold values (false after pack_codes).
  bool weights_hold_values() const { return store_.holds_values(); }
  /// The packed copy of matrix `slot` of expert tensor `tensor` (Expert::tensors order, the
  /// shared experts' after the routed ones), to refill with weights quantised already (a
  /// checkpoint's: space::packed_nt::repack_grouped, repack_int8) in the format packed.
  /// Valid until the next pack; config_error when the weights are not packed or there is no
  /// such matrix. Local.
  auto& packed_matrix(int tensor, index_t slot) {
    auto* m = store_.packed_matrix(static_cast<std::size_t>(tensor), slot);
    detail::require(m != nullptr, "packed_matrix",
                    std::to_string(tensor) + ", " + std::to_string(slot),
                    "names no packed matrix: pack_weights() first; tensor in Expert::tensors "
                    "order (then the shared experts'), slot < the tensor's count");
    return *m;
  }
  /// Refills the packed copy of matrix `slot` of expert tensor `tensor` by fill(m), e.g.
  /// m.repack_grouped(...) and m.set_input_order(...) for an act-order checkpoint, then sizes
  /// the room the passes need for it (so they do not allocate). Local.
  template <class Fill>
  void refill_packed(int tensor, index_t slot, Fill&& fill) {
    fill(packed_matrix(tensor, slot));
    store_.reserve_inputs(space_, input_rows());
  }
  /// Back to reading the weights themselves; frees the packed copies.
  void unpack_weights() { store_.unpack(); }
  bool weights_packed() const { return store_.packed(); }

  /// Losing ranks (issue 23): the layer of the survivors, collective over them. lost[r] != 0
  /// marks rank r lost. Each survivor keeps its slots; placement::surviving re-plans the
  /// placement over the survivors (renumbered in rank order; config_error naming the experts
  /// left without a copy, on every survivor), over comm.exclude(lost). The new layer reads
  /// nothing this one owns (the router bias and owned experts are copied); it packs as its
  /// options say. Do not run this layer's passes again.
  moe_layer exclude_ranks(std::span<const char> lost)
      const requires std::same_as<placement_type, epmoe::placement::table> &&
      requires(const comm_type& c, std::span<const char> m) {
    c.exclude(m);
  }
  {
    store_.require_values("exclude_ranks");  // (the new layer packs or copies the views)
    epmoe::placement::table where = epmoe::placement::surviving(where_.get(), lost);
    layer_config cfg = cfg_;
    cfg.ranks = where.ranks();
    cfg.ranks_per_node = 0;  // the survivors' nodes are uneven: one node (a flat exchange)
    return moe_layer(cfg, comm_.exclude(lost), store_.views(), router_.copy_for_another(),
                     capacity_, std::move(where), space_, store_.owns_experts());
  }

  const layer_config& config() const { return cfg_; }
  /// What the last pass did (waits for it on a device space): rows, drops, bytes, FLOPs,
  /// losses and stage times.
  const pass_stats& stats() const {
    if (pending_) stages::resolve(*this);
    return stats_;
  }
  const placement_type& placement() const { return where_.get(); }
  const comm_type& comm() const { return comm_; }
  const space_type& space() const { return space_; }
  int rank() const { return comm_.rank(); }
  /// The router, to inspect or change its settings (e.g. `training`) between passes; they
  /// are checked at the next forward. For sigmoid_bias, `router().bias` points at the
  /// layer's bias (router_bias()); pointing it at other values loads those at the next pass.
  router_type& router() { return router_.policy(); }
  const router_type& router() const { return router_.policy(); }
  /// Expert ids and weights of the last pass, [T, slots], host memory; empty slots hold
  /// no_expert (waits for the pass on a device space).
  routing_view last_routing() const { return router_.last_routing(space_, pass_.tokens()); }
  /// Rows of the receive buffer: with config max_recv_rows at most that, else R*T*min(K, L).
  index_t receive_buffer_rows() const { return ex_.receive_buffer_rows(); }
  /// Where each assignment of the last pass went (per-assignment arrays in the space's
  /// memory, per-block arrays on the host).
  const dispatch_plan& last_plan() const { return plan_.host(); }
  /// Which assignments of the last pass capacity dropped: mask(t, k) [T, slots] (empty slots
  /// are not drops; count() == stats().dropped), valid until the next pass.
  drop_mask dropped() const {
    const auto& m = plan_.routes();
    const index_t n = layout_.tokens * layout_.width;
    space_.to_host(m, 0, 2 * n);
    space_.synchronize();
    return {m.host(), m.host() + n, pass_.tokens(), layout_.width};
  }
  /// Passes run so far (the counter behind seeded training noise).
  std::uint64_t passes() const { return passes_; }
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
    return router_.bias(space_);
  }

  /// Collective live re-placement (placement::table): switches to `next` (same experts, ranks
  /// and slots per rank; the same table on every rank), moving the weights of every slot whose
  /// expert changes from a holder, through the comm, into the layer's own copy of its slots
  /// (staged: a pass sees the old table and weights or the new ones). Returns the bytes this
  /// rank's slots received.
  index_t apply_placement(
      const placement::table& next) requires std::same_as<placement_type, placement::table> {
    index_t received = 0;
    stages::side_call(
        *this, call_kind::apply_placement, [&] { store_.require_values("apply_placement"); },
        [&] {
          received = store_.relocate(
              space_,
              [&](const auto& staged) {
                return placement::relocate(comm_, where_.get(), next, staged);
              },
              input_rows(), cfg_.shared_experts > 0);
          where_.set(next, space_);
          if (train_) {
            train_->drop();  // another expert set: the last forward's state no longer applies
            train_->plan_replicas(space_, cfg_, where_.get(), rank(), store_.views());
          }
        });
    return received;
  }

  /// The last pass seen by all ranks (collective, one all-to-all): rows per logical expert
  /// summed over ranks, and real rows each rank's experts computed.
  using global_load = epmoe::global_load;
  global_load gather_load() {
    global_load g;
    stages::side_call(
        *this, call_kind::gather_load, [] {},
        [&] { g = gather_global_load(comm_, stats(), cfg_.ranks, cfg_.experts); });
    return g;
  }

  /// Collective: sums the last pass's per-expert load over all ranks and applies the
  /// router's bias update (DeepSeek-V3 aux-loss-free balancing). Returns the global load.
  std::span<const index_t> update_router() requires router_with_bias<router_type> {
    std::span<const index_t> load;
    stages::side_call(
        *this, call_kind::update_router, [] {},
        [&] { load = router_.update_bias(comm_, space_, plan_.host().routed); });
    return load;
  }

 private:
  template <class L>
  friend struct parts::stages_base;
  using stages = parts::stages_base<moe_layer>;
  template <class L>
  friend struct parts::forward_stages;
  template <class L>
  friend struct parts::backward_stages;
  template <class L>
  friend struct parts::split_stages;
  template <class T>
  using buffer = typename space_type::template buffer<T>;
  template <class T>
  using mirror = typename space_type::template mirror<T>;

  // The constructor behind the public ones; `own_experts`: the new layer copies the experts
  // its views point at into storage it owns (exclude_ranks of a layer that owns its own).
  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router,
            capacity_type capacity, placement_type placement, space_type space, bool own_experts)
      : cfg_(parts::agreed_config<moe_layer, Policies>(cfg, comm, w, router, placement)),
        comm_(std::move(comm)),
        space_(std::move(space)),
        capacity_(capacity),
        where_(std::move(placement), space_),
        chunks_max_(cfg_.chunks > 0 ? cfg_.chunks : parts::default_chunks<schedule_type>()),
        chunks_(chunks_max_),
        layout_(parts::layout_of<moe_layer>(cfg_, where_.get().slots_per_rank(), chunks_max_,
                                            capacity_, node_size_of(cfg_, comm_))),
        store_(w, options.pack_as),
        router_(cfg_, space_, layout_.width, router),
        stats_(cfg_.experts, where_.get().slots_per_rank(), cfg_.ranks),
        plan_(space_, layout_, dedup),
        ex_(comm_, space_, layout_),
        clock_(space_.make_clock(32 + 12 * layout_.max_units), 16 + 2 * layout_.blocks,
               3 * layout_.max_units, 2 * layout_.max_units + 1),
        home_(cfg_, space_, layout_) {
    if constexpr (requires { space_.set_fixed_order(true); })
      space_.set_fixed_order(options.deterministic);
    if (own_experts) store_.own_experts(space_);  // (exclude_ranks: copies of the old layer's)
    allocate();
    if constexpr (options.pack_weights) pack_weights(options.pack_as);
  }

  // Rows a packed GEMM converts at most (AVX512-BF16): a unit's, or the shared experts' T.
  index_t input_rows() const { return std::max<index_t>(layout_.expert_rows, cfg_.max_tokens); }

  void allocate() {
    stats_.timeline.reserve(static_cast<std::size_t>(3 * layout_.max_units));
    stats_.recv_buffer_rows = ex_.receive_buffer_rows();
    parts::reserve_gemms<moe_layer>(space_, cfg_, layout_, where_.get().slots_per_rank());
    if constexpr (requires { expert_type::backward_scratch_per_row(index_t{}); })
      if (cfg_.training) {
        train_.emplace(cfg_, space_, layout_, layout_.width, dedup,
                       parts::keep_per_row<expert_type, space_type>(cfg_, layout_));
        train_->plan_replicas(space_, cfg_, where_.get(), rank(), store_.views());
      }
    scratch_ =
        space_.template allocate<value_type>(parts::scratch_elements<moe_layer>(cfg_, layout_));
  }

  void check_backward(const pass_handle& h, matrix_view<const value_type> dy,
                      matrix_view<value_type> dx, const gradients& g,
                      const backward_options& opt) const {
    detail::require(cfg_.training, "config.training", cfg_.training,
                    "must be true for backward (forward then keeps what backward needs)");
    store_.require_values("backward");
    detail::require(!(store_.packed() && store_.precision().inference_only()), "pack_weights",
                    store_.precision().name(),
                    "computes the forward only (inference): unpack_weights() or pack as fp32 "
                    "or bf16 before a backward");
    detail::require(cfg_.dispatch_rows == row_format::activations, "dispatch_rows",
                    row_format_name(cfg_.dispatch_rows),
                    "carries the forward's rows in 8 bits (inference): a backward needs "
                    "dispatch_rows = activations");
    train_->check(h);
    const index_t T = pass_.tokens();
    detail::require_shape(dy, T, cfg_.hidden, "dy");
    detail::require_shape(dx, T, cfg_.hidden, "dx");
    check_grads(g);
    parts::check_losses<router_type>(opt.losses);
    if (opt.routing_grad.data) {
      detail::require(pass_.routing_given, "backward_options.routing_grad", "given",
                      "only for a pass whose routing was given (the router consumes it else)");
      detail::require_shape(opt.routing_grad, T, layout_.width, "backward_options.routing_grad");
    }
  }
  void check_grads(const gradients& g) const {
    parts::check_gradients<expert_type, router_type>(g, cfg_, where_.get().slots_per_rank(),
                                                     router_.noisy_training());
  }

  layer_config cfg_;
  comm_type comm_;
  space_type space_;
  capacity_type capacity_;
  parts::placed<space_type, placement_type> where_;
  int chunks_max_ = 1, chunks_ = 1;
  workspace_layout layout_;  // (before anything is sized: its checks come first)
  parts::weights_store<space_type, expert_type> store_;
  parts::router_stage<space_type, router_type> router_;
  mutable pass_stats stats_;
  mutable plan_storage<space_type> plan_;  // (mutable: stats() reads a static pass's counts)
  mutable exchange<comm_type, space_type, dedup, hierarchical, options.low_latency> ex_;
  mutable pass_clock<space_type> clock_;
  parts::home_terms<space_type, expert_type> home_;
  buffer<value_type> scratch_;  // the experts' (routed and shared) hidden layers
  std::optional<parts::training_state<space_type, expert_type, router_type>> train_;
  parts::lifecycle life_;
  mutable parts::forward_pass<value_type> pass_;  // the last forward (backward reads it)
  parts::split_state split_;                      // a split pass between start and finish
  std::uint64_t passes_ = 0;
  std::chrono::steady_clock::time_point built_ = std::chrono::steady_clock::now();
  mutable bool pending_ = false;  // stats() has marks and losses to resolve
};

}  // namespace epmoe
