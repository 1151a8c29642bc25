// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Steps 7 and 8 of the tour: one token through two experts on two ranks, and the straggler.
// Included at the end of tour.hpp (its options, policies and helpers), not on its own.
#include <cmath>
#include <string>
#include <vector>

namespace epmoe::tour {

// --- 7. one token, two experts on two ranks ------------------------------------------------

/// What to record on one rank: the input and output of one row of one local expert, the row
/// given as (source rank, position in that source's block), found through the layer's plan.
struct trace_point {
  int slot = -1;  // local expert slot; -1: nothing to record
  int source = 0;
  index_t position = 0;
  const dispatch_plan* plan = nullptr;
  std::vector<float> in, out;
};

/// SwiGLU that also records one row's input and output: the tour's window into the rows
/// the layer dispatches and returns (they live in its private workspace).
struct traced_swiglu : expert::swiglu {
  using base = expert::swiglu;
  template <class T>
  struct weights_of : base::weights_of<T> {
    trace_point* trace = nullptr;
  };
  template <class T>
  static auto tensors(weights_of<T>& w) {
    return base::tensors(static_cast<base::weights_of<T>&>(w));
  }
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, index_t first, index_t n) {
    return {base::slice(w, first, n), nullptr};  // a shared expert: not traced
  }

  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, grouped_rows<T> x, T* scratch) {
    trace_point* tp = w.trace;
    bool hit = tp && tp->slot < x.groups;
    index_t row = 0;
    if (hit) {  // the block (chunk 0, source, slot) sits at regroup_offsets, expert-major
      const dispatch_plan& p = *tp->plan;
      row = p.regroup_offsets[p.block(0, tp->source, tp->slot)] + tp->position - x.offsets[0];
      // else nothing is recorded and the step reports it
      hit =
          row >= x.offsets[tp->slot] - x.offsets[0] && row < x.offsets[tp->slot + 1] - x.offsets[0];
      if (hit) tp->in.assign(x.data + row * x.stride, x.data + row * x.stride + x.cols);
    }
    base::forward(space, static_cast<const base::weights_of<T>&>(w), x, scratch);
    if (hit) tp->out.assign(x.data + row * x.stride, x.data + row * x.stride + x.cols);
  }
};

/// Step 7's errors, with the shared NaN-aware measure: a NaN, an Inf or a row the layer left
/// unwritten (the output is NaN-filled before the pass) is an infinite error.
inline void compare_rows(trace_result& r) {
  r.combined_vs_layer = reference::max_relative_error(r.layer_row, r.combined);
  r.combined_vs_reference = reference::max_relative_error(r.combined, r.reference_row);
}

template <class World>
trace_result trace_one_token(const World& world, const options& o) {
  using P = policies<typename World::comm_type, capacity::dropless, schedule::sequential,
                     placement::block, top_k, traced_swiglu>;
  const layer_config cfg = o.config();
  const auto full = reference::full_weights::random(cfg, o.seed);
  const placement::block where(cfg);
  trace_result r;
  // Pass 1 on the home rank: find a token whose experts are on two ranks, neither home if
  // one exists (both rows then cross the network).
  const auto choose = world.run([&](typename P::comm c) {
    const auto mine = reference::slice(full, where, c.rank());
    moe_layer<P> layer(cfg, std::move(c), {full.gate_view(), {mine.experts(), nullptr}});
    const auto x = tokens_of(o, layer.rank());
    std::vector<float> y;
    forward(layer, x, y);
    numbers n;
    if (layer.rank() != r.home_rank) return n;
    const routing_view rt = layer.last_routing();
    const dispatch_plan& plan = layer.last_plan();
    int best = -1, best_score = 0;
    for (index_t t = 0; t < o.tokens && best_score < 2; ++t) {
      const int a = where.rank_of(rt.ids(t, 0)), b = where.rank_of(rt.ids(t, 1));
      const int score = a == b ? 0 : 1 + (a != r.home_rank && b != r.home_rank);
      if (score > best_score) best = static_cast<int>(t), best_score = score;
    }
    n.put(best);
    for (int k = 0; k < top_k && best >= 0; ++k) {
      const int e = rt.ids(best, k), s = plan.slot[best * top_k + k];
      const int b = plan.block(0, where.rank_of(e), where.local_index(e));
      n.put(e);
      n.put(rt.weights(best, k));
      n.put(s);
      n.put(s - plan.send_offsets[b]);  // position in the block: the receiver's order too
    }
    return n;
  });
  reader pick{choose[r.home_rank]};
  r.token = static_cast<int>(pick.get());
  if (r.token < 0) {
    r.conclusion = conclusion(r);
    return r;
  }
  std::vector<index_t> position;
  for (int k = 0; k < top_k; ++k) {
    const int e = static_cast<int>(pick.get());
    r.experts.push_back(e);
    r.ranks.push_back(where.rank_of(e));
    r.slots.push_back(where.local_index(e));
    r.weights.push_back(pick.get());
    r.send_rows.push_back(pick.get());
    position.push_back(static_cast<index_t>(pick.get()));
  }
  // Pass 2: the expert ranks record the token's row going in and coming out.
  const auto traced = world.run([&](typename P::comm c) {
    const int me = c.rank();
    trace_point tp;
    for (int k = 0; k < top_k; ++k)
      if (r.ranks[k] == me) tp = {r.slots[k], r.home_rank, position[k], nullptr, {}, {}};
    const auto mine = reference::slice(full, where, me);
    moe_layer<P> layer(cfg, std::move(c), {full.gate_view(), {mine.experts(), &tp}});
    tp.plan = &layer.last_plan();  // filled by the pass before the experts run
    const auto x = tokens_of(o, me);
    std::vector<float> y;
    forward(layer, x, y);
    numbers n;
    n.put_all(tp.in);
    n.put_all(tp.out);
    if (me == r.home_rank)
      n.put_all(
          std::vector<float>(y.begin() + r.token * o.hidden, y.begin() + (r.token + 1) * o.hidden));
    return n;
  });
  const auto x = tokens_of(o, r.home_rank);
  r.combined.assign(static_cast<std::size_t>(o.hidden), 0.0);
  std::vector<float> acc(static_cast<std::size_t>(o.hidden), 0.f);
  for (int k = 0; k < top_k; ++k) {
    reader in{traced[r.ranks[k]]};
    if (in.v.size() < 2 * static_cast<std::size_t>(o.hidden))
      throw std::runtime_error(
          format("tour step 7: rank %d recorded no row for expert %d (has "
                 "the layer's dispatch_plan layout changed?)",
                 r.ranks[k], r.experts[k]));
    const auto got = in.get(static_cast<std::size_t>(o.hidden));
    const auto out = in.get<float>(static_cast<std::size_t>(o.hidden));
    const std::span<const float> xt(x.data() + r.token * o.hidden,
                                    static_cast<std::size_t>(o.hidden));
    r.input_diff.push_back(reference::max_relative_error(std::span<const double>(got), xt));
    for (int h = 0; h < o.hidden; ++h)
      acc[h] += static_cast<float>(r.weights[k]) * out[h];  // as the layer's reduce: in float
    r.outputs.emplace_back(out.begin(), out.end());
  }
  r.combined.assign(acc.begin(), acc.end());
  {
    reader in{traced[r.home_rank]};
    in.at = traced[r.home_rank].size() - static_cast<std::size_t>(o.hidden);
    r.layer_row = in.get(static_cast<std::size_t>(o.hidden));
  }
  // The reference forward pass on this token alone: dropless, a token's output depends on
  // nothing but its own row.
  std::vector<float> ref(static_cast<std::size_t>(o.hidden),
                         std::numeric_limits<float>::quiet_NaN());
  reference::forward(full, typename P::router{}, capacity::dropless{},
                     {x.data() + r.token * o.hidden, 1, o.hidden}, std::vector<index_t>{1},
                     {ref.data(), 1, o.hidden});
  r.reference_row.assign(ref.begin(), ref.end());
  compare_rows(r);
  r.found = r.ranks[0] != r.ranks[1];
  r.conclusion = conclusion(r);
  return r;
}

// --- 8. the straggler ----------------------------------------------------------------------

template <class World>
straggler_result the_straggler(const World& world, const options& o, int passes = 5) {
  using Comm = typename World::comm_type;
  using Block = policies<Comm, capacity::dropless, experts_in_turn>;
  using Table = policies<Comm, capacity::dropless, experts_in_turn, placement::table>;
  const layer_config cfg = o.config();
  const auto full = reference::full_weights::random(cfg, o.seed);
  const int R = o.ranks, extra = R;  // one extra slot per rank for replicas
  straggler_result r;
  r.hot_expert = o.hot_expert;
  r.hot_rank = placement::block(cfg).rank_of(o.hot_expert);
  r.extra_slots = extra;
  const load_probe probe;
  const auto all = world.run([&](Comm c) {
    const int me = c.rank();
    const auto x = skewed(tokens_of(o, me), full, o);
    std::vector<float> y;
    numbers n;
    rank_layer<Block> before(cfg, another(c), full);
    forward(before.layer, x, y);  // warm-up, and the load to balance
    const auto load = before.layer.gather_load();
    // Balance on the measured load (the same on every rank), then a layer on the new table.
    const std::vector<double> per_expert(load.per_expert.begin(), load.per_expert.end());
    const auto plan = placement::balance(per_expert, {.ranks = R, .extra_slots = extra});
    rank_layer<Table> after(cfg, std::move(c), full, plan.refined);
    forward(after.layer, x, y);  // warm-up
    // The two placements' passes alternate, so that both see the same load of the machine;
    // each rank's expert time is the median of its passes.
    std::vector<double> before_s, after_s;
    for (int p = 0; p < passes; ++p) {
      forward(before.layer, x, y);
      before_s.push_back(before.layer.stats().time.experts);
      forward(after.layer, x, y);
      after_s.push_back(after.layer.stats().time.experts);
    }
    const auto load2 = after.layer.gather_load();
    n.put(median(before_s));
    n.put_all(load.per_rank);
    n.put(load.ranks.excess);
    n.put(median(after_s));
    n.put_all(load2.per_rank);
    n.put(load2.ranks.excess);
    n.put(plan.refined_max_over_mean);
    n.put(plan.refined.copies(o.hot_expert));
    n.put_all(plan.refined.phy_to_log());
    n.put(std::max(spread(before_s), spread(after_s)));
    return n;
  });
  const int S = (experts + extra) / R;
  double worst_spread = 0;
  for (const auto& v : all) {
    reader in{v};
    r.expert_ms_before.push_back(1e3 * in.get());
    r.rows_before = in.get(static_cast<std::size_t>(R));
    r.excess_before = in.get();
    r.expert_ms_after.push_back(1e3 * in.get());
    r.rows_after = in.get(static_cast<std::size_t>(R));
    r.excess_after = in.get();
    r.predicted_max_over_mean = in.get();
    r.hot_copies = static_cast<int>(in.get());
    const auto phy = in.get<int>(static_cast<std::size_t>(R * S));
    r.experts_of_rank_after.clear();
    for (int s = 0; s < R; ++s)
      r.experts_of_rank_after.emplace_back(phy.begin() + s * S, phy.begin() + (s + 1) * S);
    worst_spread = std::max(worst_spread, in.get());
  }
  r.load = probe.finish(worst_spread);
  for (double t : r.expert_ms_before) r.wait_ms_before.push_back(max_of(r.expert_ms_before) - t);
  for (double t : r.expert_ms_after) r.wait_ms_after.push_back(max_of(r.expert_ms_after) - t);
  r.straggler_before = argmax(r.rows_before);
  r.straggler_after = argmax(r.rows_after);
  r.conclusion = conclusion(r);
  return r;
}

}  // namespace epmoe::tour
