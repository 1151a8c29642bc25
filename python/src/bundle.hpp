// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// One menu entry: moe_layer over a policy bundle, behind any_layer. Included by the
// bundles_*.cpp files only (each instantiates a share of the menu).

#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "epmoe/epmoe.hpp"
#include "epmoe/reference/forward.hpp"
#include "epmoe/reference/scaled_input.hpp"
#include "layers.hpp"

namespace epmoe::py {

/// The exchange of a bundle: flat, per-rank dedup, or hierarchical (docs/architecture.md).
enum class exchange_kind { flat, dedup, hierarchical, low_latency };
inline const char* name_of(exchange_kind x) {
  return x == exchange_kind::flat           ? "flat"
         : x == exchange_kind::dedup        ? "dedup"
         : x == exchange_kind::hierarchical ? "hierarchical"
                                            : "low_latency";
}

template <class Router, class Expert, class Capacity, class Schedule,
          exchange_kind X = exchange_kind::flat, class Weighting = weighting::output>
struct policies : default_policies {
  using router = Router;
  using expert = Expert;
  using capacity = Capacity;
  using schedule = Schedule;
  using weighting = Weighting;
  using placement = epmoe::placement::table;
  using comm = epmoe::comm::any;
  static constexpr layer_options options{.dedup = X == exchange_kind::dedup,
                                         .hierarchical = X == exchange_kind::hierarchical,
                                         .low_latency = X == exchange_kind::low_latency};
};

/// The router with the fields it has set from the menu's run-time arguments.
template <class Router>
Router make_router(const router_args& a) {
  Router r{};
  if constexpr (requires { r.groups; }) r.groups = a.groups, r.top_groups = a.top_groups;
  if constexpr (requires { r.norm_p; }) r.norm_p = a.norm_p;
  if constexpr (requires { r.scaling; }) r.scaling = a.scaling;
  if constexpr (requires { r.group_by; })
    r.group_by = a.group_by_max ? router::group_score::max : router::group_score::top2_sum;
  if constexpr (requires { r.normalize; }) r.normalize = a.normalize;
  if constexpr (requires { r.group_mask; })
    r.group_mask =
        a.group_mask_zero ? router::group_mask_mode::zero : router::group_mask_mode::minus_inf;
  if constexpr (requires { r.gamma; }) r.gamma = a.gamma;
  if constexpr (requires { r.bias; }) r.bias = a.bias.empty() ? nullptr : a.bias.data();
  if constexpr (requires { r.jitter_eps; }) r.jitter_eps = a.jitter_eps;
  if constexpr (requires { r.eps; }) r.eps = a.eps, r.norm_min = a.norm_min;
  if constexpr (requires { r.vocab; })  // the layer copies the table (router::table)
    r.ids = a.table.empty() ? nullptr : a.table.data(), r.vocab = a.vocab;
  return r;
}

/// Whether moe_layer::backward compiles for the pair (docs/training.md).
template <class Router, class Expert>
inline constexpr bool trains = requires {
  Expert::backward_scratch_per_row(index_t{});
}
&&(!Router::uses_gate || router_with_backward<Router>);

template <class Router, class Expert, class Capacity, class Schedule, exchange_kind X,
          class Weighting>
class layer_of final : public any_layer {
  using P = policies<Router, Expert, Capacity, Schedule, X, Weighting>;
  using layer = moe_layer<P>;

 public:
  layer_of(const layer_args& a, comm::any comm, const rank_weights& w)
      : args_(a),
        bound_(w),
        layer_(a.cfg, std::move(comm), weights_of(w), make_router<Router>(args_.router), Capacity{},
               placement::table(a.cfg.experts, a.cfg.ranks, a.phy_to_log)) {}

  void forward(matrix_view<const float> x, matrix_view<float> y, const routing_view* routing,
               bool keep, std::span<const std::int64_t> token_ids) override {
    if (routing)
      layer_.forward(x, *routing, y, {.keep_for_backward = keep});
    else
      layer_.forward(x, y, token_ids, {.keep_for_backward = keep});
  }

  void start(matrix_view<const float> x, matrix_view<float> y,
             std::span<const std::int64_t> token_ids) override {
    held_ = layer_.start(x, y, token_ids);
  }
  void finish() override { layer_.finish(held_); }

  void backward(matrix_view<const float> dy, matrix_view<float> dx, const rank_grads& g,
                const loss_scales& losses, bool accumulate,
                matrix_view<float> routing_grad) override {
    if constexpr (trains<Router, Expert>) {
      const auto grads = views<typename layer::gradients, typename layer::expert_grads>(g, "grads");
      layer_.backward(dy, dx, grads,
                      {.losses = losses, .accumulate = accumulate, .routing_grad = routing_grad});
    } else {
      throw config_error("router", "this bundle",
                         "has no backward (its router or expert does not "
                         "train yet; docs/training.md)");
    }
  }

  const pass_stats& stats() const override { return layer_.stats(); }
  /// An expert tensor given as None keeps the view bound (codes only: its unbacked one).
  void rebind(const rank_weights& given) override {
    rank_weights w = given;
    for (auto [to, from] :
         {std::pair(&w.experts, &bound_.experts), std::pair(&w.shared, &bound_.shared)})
      for (std::size_t k = 0; k < to->size() && k < from->size(); ++k)
        if (!(*to)[k].data) (*to)[k] = (*from)[k];
    layer_.set_weights(weights_of(w));
    bound_ = w;
    if (layer_.weights_hold_values()) coded_.clear();
  }
  void pack(bool on, const std::string& format) override {
    if (!on) return layer_.unpack_weights();
    layer_.pack_weights(format_named(format));
  }
  void pack_given(int tensor, index_t slot, const std::string& format,
                  matrix_view<const std::int8_t> q, const float* scales, const float* offsets,
                  std::span<const index_t> order) override {
    layer_.refill_packed(tensor, slot, [&](space::packed_nt& m) {
      const weights_format as = format_named(format);
      detail::require(m.precision() == as, "format", format,
                      "must be the format the layer packs (pack_weights)");
      m.repack_grouped(as, q, scales, offsets);
      m.set_input_order(order);
    });
  }
  std::vector<float> packed_values(int tensor, index_t slot, index_t& rows,
                                   index_t& cols) override {
    const space::packed_nt& m = layer_.packed_matrix(tensor, slot);
    rows = m.rows(), cols = m.cols();
    std::vector<float> out(static_cast<std::size_t>(rows * cols));
    m.unpack(out.data());
    return out;
  }
  void load_quantised(const std::string& format, const std::vector<quantised_tensor>& q,
                      bool codes_only) override {
    const weights_format as = format_named(format);
    detail::require(as.grouped() || format == "fp8" || format == "mxfp4", "load_quantised", format,
                    "must be fp8, mxfp4 or a group-wise format");
    codes_only = codes_only || !layer_.weights_hold_values();  // (into a layer of codes only)
    for (std::size_t t = 0; t < coded_.size(); ++t)            // (checked before anything changes)
      detail::require(!coded_[t] || (t < q.size() && q[t].codes), "load_quantised",
                      "tensor " + std::to_string(t),
                      "holds codes only (an earlier load): give its codes again");
    std::vector<stacked_view<const float>> all = bound_.experts;  // tensors() order
    if (args_.cfg.shared_experts > 0)
      all.insert(all.end(), bound_.shared.begin(), bound_.shared.end());
    const auto load = [&](std::size_t t, index_t j, space::packed_nt& m) {
      if (t >= q.size() || !q[t].codes) {
        if (!codes_only) return false;
        m.repack(all.at(t)[j], as);  // (a bias: its values, which it keeps)
        return true;
      }
      const quantised_tensor& s = q[t];
      detail::require(j < s.count, "load_quantised.count", s.count,
                      "must hold every slot of the tensor");
      const index_t R = s.rows, K = s.cols;
      if (as.grouped()) {
        const index_t G = (K + as.group - 1) / as.group;
        m.repack_grouped(as, {reinterpret_cast<const std::int8_t*>(s.codes) + j * R * K, R, K},
                         static_cast<const float*>(s.scales) + j * R * G,
                         s.offsets ? s.offsets + j * R * G : nullptr);
        static_assert(sizeof(index_t) == sizeof(std::int64_t));
        m.set_input_order(s.order ? std::span(reinterpret_cast<const index_t*>(s.order) + j * K,
                                              static_cast<std::size_t>(K))
                                  : std::span<const index_t>{});
      } else if (format == "fp8") {
        const index_t blocks = (R + 127) / 128 * ((K + 127) / 128);
        m.repack_fp8({s.codes + j * R * K, R, K}, static_cast<const float*>(s.scales) + j * blocks);
      } else {
        const index_t nb = (K + 31) / 32;
        m.repack_mxfp4(K, {s.codes + j * R * nb * 16, R, nb * 16},
                       {static_cast<const std::uint8_t*>(s.scales) + j * R * nb, R, nb});
      }
      return true;
    };
    if (!codes_only) return layer_.pack_weights(as, load);
    if (layer_.weights_hold_values()) {  // the tensors given codes: views of no memory
      rank_weights w = bound_;
      space::unbacked_tensors none;
      std::vector<char> coded(all.size(), 0);
      for (std::size_t t = 0; t < q.size() && t < all.size(); ++t)
        if (q[t].codes) {
          auto& v = t < w.experts.size() ? w.experts[t] : w.shared.at(t - w.experts.size());
          v = none.add(v.count, v.rows, v.cols);
          coded[t] = 1;
        }
      layer_.unpack_weights();
      layer_.set_weights(weights_of(w));  // (unpacked: nothing read)
      unbacked_ = std::move(none);
      bound_ = w;
      coded_ = std::move(coded);
    }
    layer_.pack_codes(as, load);
  }
  bool holds_values() const override { return layer_.weights_hold_values(); }
  moe_load global_load() override {
    auto g = layer_.gather_load();
    return {std::move(g.per_expert), std::move(g.per_rank)};
  }
  void update_router() override {
    if constexpr (router_with_bias<Router>)
      layer_.update_router();
    else
      throw config_error("router", "this bundle's", "has no bias to update (sigmoid_bias has)");
  }
  std::vector<float> router_bias() override {
    if constexpr (router_with_bias<Router>) {
      const std::span<float> b = layer_.router_bias();
      return {b.begin(), b.end()};
    } else {
      return {};
    }
  }
  int rank() const override { return layer_.rank(); }
  int local_slots() const override { return layer_.placement().slots_per_rank(); }

 private:
  // A bundle of the expert's views (weights or gradients) from the list, in tensors() order.
  template <class Bundle, class View>
  static Bundle expert_bundle(const std::vector<View>& list, const char* field) {
    Bundle b{};
    if (list.empty()) return b;  // unused (no shared experts)
    auto ts = Expert::tensors(b);
    detail::require(
        list.size() == ts.size(), field, list.size(),
        ("must hold " + std::to_string(ts.size()) + " tensors for this expert").c_str());
    for (std::size_t i = 0; i < ts.size(); ++i) *ts[i] = list[i];
    return b;
  }
  // The layer's weights or gradients (the same field names) from one rank's tensors.
  template <class Out, class ExpertBundle, class T>
  static Out views(const rank_tensors<T>& w, const std::string& name) {
    Out v{};
    v.gate = w.gate;
    v.experts = expert_bundle<ExpertBundle>(w.experts, (name + ".experts").c_str());
    v.shared = expert_bundle<ExpertBundle>(w.shared, (name + ".shared").c_str());
    v.noise_gate = w.noise_gate;
    v.shared_gate = w.shared_gate;
    v.output_bias = w.output_bias;
    v.gate_bias = w.gate_bias;
    return v;
  }
  static typename layer::weights weights_of(const rank_weights& w) {
    return views<typename layer::weights, typename layer::expert_weights>(w, "weights");
  }

  layer_args args_;                   // the router's bias points into it
  rank_weights bound_;                // the caller's views (load_quantised's biases)
  space::unbacked_tensors unbacked_;  // codes only: the views of the experts (before layer_)
  std::vector<char> coded_;           // codes only: which expert tensors' views are unbacked
  layer layer_;
  split_handle held_{};  // the split pass between start and finish
};

/// The menu entry of one bundle.
template <class Router, class Expert, class Capacity, class Schedule,
          exchange_kind X = exchange_kind::flat, class Weighting = weighting::output>
bundle entry(std::string router, std::string expert, std::string capacity, std::string schedule,
             std::vector<std::string> tensors) {
  using L = layer_of<Router, Expert, Capacity, Schedule, X, Weighting>;
  bundle b;
  b.exchange = name_of(X);
  b.router = std::move(router);
  b.top_k = Router::top_k;
  b.expert = std::move(expert);
  b.capacity = std::move(capacity);
  b.schedule = std::move(schedule);
  b.expert_tensors = std::move(tensors);
  b.trains = trains<Router, Expert> && X != exchange_kind::low_latency;  // inference only
  b.make = [](const layer_args& a, comm::any c,
              const rank_weights& w) -> std::unique_ptr<any_layer> {
    return std::make_unique<L>(a, std::move(c), w);
  };
  b.reference = [](const layer_args& a, const reference::full_weights& w,
                   matrix_view<const float> x, std::span<const index_t> tokens_per_rank,
                   matrix_view<const float> dy, const loss_scales& scales) {
    reference_result out;
    out.y.resize(static_cast<std::size_t>(x.rows * x.cols));
    if constexpr (std::same_as<Weighting, weighting::input>) {  // Llama 4's block
      const reference::llama4_result r = reference::llama4_block(w, Router::top_k, x, dy);
      std::copy(r.y.begin(), r.y.end(), out.y.begin());
      if (dy.data) out.grads = r.g;
      return out;
    }
    const Router router = make_router<Router>(a.router);
    const placement::table where(a.cfg.experts, a.cfg.ranks, a.phy_to_log);
    reference::forward<Expert>(w, router, Capacity{}, where, x, tokens_per_rank,
                               matrix_view<float>{out.y.data(), x.rows, x.cols});
    if constexpr (reference::router_with_losses<Router>)
      out.losses = reference::losses(w, router, x, tokens_per_rank);
    if constexpr (trains<Router, Expert> && reference::router_with_gradient<Router>) {
      if (dy.data) {
        out.grads =
            reference::backward<Expert>(w, router, Capacity{}, where, x, tokens_per_rank, dy);
        if constexpr (reference::router_with_losses<Router>) {
          const reference::gradients l =
              reference::loss_backward(w, router, x, tokens_per_rank, scales);
          reference::gradients& g = *out.grads;
          for (std::size_t i = 0; i < g.dgate.size(); ++i) g.dgate[i] += l.dgate[i];
          for (std::size_t i = 0; i < g.dgate_bias.size(); ++i) g.dgate_bias[i] += l.dgate_bias[i];
          for (std::size_t i = 0; i < g.dx.size(); ++i) g.dx[i] += l.dx[i];
        }
      }
    }
    return out;
  };
  return b;
}

}  // namespace epmoe::py
