// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// epmoe._epmoe: the layer as torch sees it. Tensors become views (no copy); the ranks are a
// torch.distributed process group (comm over its all-to-all) or threads of this process.
// The Python side (epmoe/torch.py) owns the parameters and autograd; this file checks what
// it is handed and runs collective calls with the GIL released.

#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "args.hpp"
#include "c10d_endpoint.hpp"
#include "epmoe/comm/threads.hpp"
#include "epmoe/space/host_packed.hpp"
#include "layers.hpp"

namespace py = pybind11;

namespace epmoe::py {
namespace {

// --- the layer ------------------------------------------------------------------------------

/// The layer of one process: one rank on a process group, or `ranks` ranks on threads.
class layer {
 public:
  /// group: a process group, or None for `ranks` thread ranks; store and abort_key: where a
  /// rank that fails mid-pass leaves its reason for the group's peers (c10d_endpoint).
  layer(const ::py::dict& bundle_spec, const ::py::dict& config, std::vector<int> phy_to_log,
        const ::py::dict& router, const ::py::list& weights, const ::py::object& group, int ranks,
        const ::py::object& store, const std::string& abort_key)
      : menu_(menu()), bundle_(&find_bundle(menu_, bundle_spec)) {
    args_.cfg = config_of(config);
    args_.phy_to_log = std::move(phy_to_log);
    args_.router = router_of(router);
    if (!group.is_none()) {
      auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
      args_.cfg.ranks = pg->getSize();
      c10::intrusive_ptr<c10d::Store> st;
      if (!store.is_none()) st = store.cast<c10::intrusive_ptr<c10d::Store>>();
      auto ep = std::make_unique<c10d_endpoint>(std::move(pg), std::move(st), abort_key);
      c10d_ = ep.get();
      endpoints_.push_back(std::move(ep));
    } else {
      if (ranks < 1) value_error("ranks = " + std::to_string(ranks) + ": must be >= 1");
      args_.cfg.ranks = ranks;
      world_ = std::make_unique<comm::threads_world>(ranks);
    }
    const int R = local_ranks();
    if (static_cast<int>(weights.size()) != R)
      value_error("weights: " + std::to_string(weights.size()) + " entries: must be one per " +
                  "local rank (" + std::to_string(R) + ")");
    std::vector<rank_weights> w;
    for (int r = 0; r < R; ++r)
      w.push_back(weights_of(weights[r].cast<::py::dict>(), "weights[" + std::to_string(r) + "]"));
    layers_.resize(static_cast<std::size_t>(R));
    ::py::gil_scoped_release free;
    if (world_) {
      endpoints_.resize(static_cast<std::size_t>(R));
      world_->run([&](comm::threads c) {
        const int r = c.rank();
        endpoints_[r] = std::make_unique<comm::endpoint_of<comm::threads>>(std::move(c));
        layers_[r] = bundle_->make(args_, comm::any(*endpoints_[r]), w[r]);
      });
    } else {
      layers_[0] = bundle_->make(args_, comm::any(*endpoints_[0]), w[0]);
    }
  }

  // An exchange given up on a timeout or an abort may still run in torch's worker and write
  // into the layer's buffers when a late peer arrives (c10d cannot cancel it): then the
  // layer, the endpoint and their buffers are left allocated.
  ~layer() {
    if (!c10d_ || !c10d_->still_running()) return;
    for (auto& l : layers_) (void)l.release();
    for (auto& e : endpoints_) (void)e.release();
  }
  layer(const layer&) = delete;
  layer& operator=(const layer&) = delete;

  int local_ranks() const { return world_ ? world_->size() : 1; }
  int rank() const { return world_ ? 0 : endpoints_[0]->rank(); }
  int ranks() const { return args_.cfg.ranks; }
  bool trains() const { return bundle_->trains; }
  std::string key() const { return bundle_->key(); }

  /// y = MoE(x): this process's tokens; with thread ranks, contiguous shards, one per rank.
  /// A tensor that cannot be viewed still enters the collective call (with an empty view the
  /// layer rejects), so the peers learn of it and nobody waits; then it raises here.
  /// ids and weights: a given routing ([T, K] int32 and float32) or undefined tensors (the
  /// router's own); keep: whether a training layer keeps what backward reads (no_grad: not).
  /// token_ids: the tokens' vocabulary ids [T] int64 (table routers), or undefined.
  void forward(const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& ids_in,
               const std::optional<at::Tensor>& weights_in, bool keep,
               const std::optional<at::Tensor>& token_ids_in) {
    const at::Tensor ids = ids_in.value_or(at::Tensor()),
                     weights = weights_in.value_or(at::Tensor()),
                     tokens = token_ids_in.value_or(at::Tensor());
    const bool given = ids.defined() || weights.defined();
    std::string bad = first_bad({{x, "x"}, {y, "y"}});
    if (bad.empty() && given) bad = bad_routing(ids, weights, x.size(0));
    if (bad.empty() && tokens.defined() &&
        (tokens.scalar_type() != at::kLong || tokens.dim() != 1 || !tokens.is_contiguous() ||
         !tokens.device().is_cpu() || tokens.size(0) != x.size(0)))
      bad = "token_ids: must be a contiguous CPU int64 tensor [T] (one id per row of x)";
    run_shards(x.defined() && bad.empty() ? x.size(0) : 0, bad, [&](int r, index_t a, index_t n) {
      const routing_view routing{rows<const std::int32_t>(ids, a, n, !bad.empty()),
                                 rows<const float>(weights, a, n, !bad.empty())};
      const std::span<const std::int64_t> tok =
          tokens.defined() && bad.empty()
              ? std::span<const std::int64_t>(tokens.data_ptr<std::int64_t>() + a,
                                              static_cast<std::size_t>(n))
              : std::span<const std::int64_t>{};
      layers_[r]->forward(rows<const float>(x, a, n, !bad.empty()),
                          rows<float>(y, a, n, !bad.empty()), given ? &routing : nullptr, keep,
                          tok);
    });
  }

  /// Split phase (docs/decode.md): forward's first half (its checks, the dispatch posted);
  /// finish() waits, runs the experts and the combine, and writes y. x and y stay alive until.
  /// A bad tensor raises TypeError here, as in forward, once every rank has learnt it: at
  /// start, or at finish where the exchange posts the verdicts with the rows (low latency).
  void start(const at::Tensor& x, const at::Tensor& y) {
    const std::string bad = first_bad({{x, "x"}, {y, "y"}});
    late_bad_.clear();
    bool posted = false;  // the layer's start returned: the verdict is read in finish
    try {
      run_shards(x.defined() && bad.empty() ? x.size(0) : 0, bad, [&](int r, index_t a, index_t n) {
        layers_[r]->start(rows<const float>(x, a, n, !bad.empty()),
                          rows<float>(y, a, n, !bad.empty()), {});
        if (r == 0) posted = true;
      });
    } catch (const ::py::type_error&) {
      if (!posted) throw;
      late_bad_ = bad;  // in flight: its finish raises it, as the peers' finish raise theirs
    }
  }
  void finish() {
    const std::string bad = std::exchange(late_bad_, std::string());
    try {
      each_rank([&](int r) { layers_[r]->finish(); });
    } catch (const std::exception&) {
      if (bad.empty()) throw;
    }
    if (!bad.empty()) type_error(bad);
  }

  /// routing_grad: where a given routing's weights' gradient [T, K] goes, or undefined.
  void backward(const at::Tensor& dy, const at::Tensor& dx, const ::py::list& grads, double aux,
                double seq_aux, double z, bool accumulate,
                const std::optional<at::Tensor>& routing_grad_in) {
    const at::Tensor routing_grad = routing_grad_in.value_or(at::Tensor());
    std::vector<rank_grads> g;
    for (int r = 0; r < local_ranks(); ++r)
      g.push_back(grads_of(grads[r].cast<::py::dict>(), "grads[" + std::to_string(r) + "]"));
    const loss_scales scales{aux, seq_aux, z};
    std::string bad = first_bad({{dy, "dy"}, {dx, "dx"}});
    if (bad.empty() && routing_grad.defined())
      if (const std::string why = unviewable(routing_grad, 2); !why.empty())
        bad = "routing_grad " + why;
    run_shards(dy.defined() && bad.empty() ? dy.size(0) : 0, bad, [&](int r, index_t a, index_t n) {
      const bool rg = routing_grad.defined() && bad.empty();
      layers_[r]->backward(rows<const float>(dy, a, n, !bad.empty()),
                           rows<float>(dx, a, n, !bad.empty()), g[r], scales, accumulate,
                           rows<float>(routing_grad, a, n, !rg));
    });
  }

  void rebind(const ::py::list& weights) {
    for (int r = 0; r < local_ranks(); ++r)
      layers_[r]->rebind(
          weights_of(weights[r].cast<::py::dict>(), "weights[" + std::to_string(r) + "]"));
  }

  /// Local: every local rank packs its expert weights (their values now), or unpacks them.
  void pack(bool on, const std::string& format) {
    ::py::gil_scoped_release free;
    for (auto& l : layers_) l->pack(on, format);
  }

  /// Local: local rank `rank`'s packed copy of matrix `slot` of expert tensor `tensor` (the
  /// bundle's expert_tensors order, then the shared ones) replaced by weights quantised
  /// already (epmoe/quantised.py): q int8 [N, K], scales and offsets (int4_asym; else None)
  /// float32 [N, G], in `format`, the format packed; order: an act-order checkpoint's input
  /// order, int64 [K] (q's column j is input order[j]), or None.
  void pack_given(int rank, int tensor, index_t slot, const std::string& format,
                  const at::Tensor& q, const at::Tensor& scales,
                  const std::optional<at::Tensor>& offsets,
                  const std::optional<at::Tensor>& order) {
    if (rank < 0 || rank >= local_ranks())
      value_error("pack_given: rank " + std::to_string(rank) + " is not a local rank");
    const auto dense = [](const at::Tensor& t, at::ScalarType type, const char* name) {
      if (t.scalar_type() != type || !t.device().is_cpu() || !t.is_contiguous() || t.dim() != 2)
        type_error(std::string("pack_given: ") + name + " must be a contiguous 2-D CPU " +
                   c10::toString(type) + " tensor");
    };
    dense(q, at::kChar, "q");
    dense(scales, at::kFloat, "scales");
    const index_t N = q.size(0), K = q.size(1), G = scales.size(1);
    if (scales.size(0) != N) value_error("pack_given: scales must have q's rows");
    if (offsets) {
      dense(*offsets, at::kFloat, "offsets");
      if (offsets->size(0) != N || offsets->size(1) != G)
        value_error("pack_given: offsets must have the shape of scales");
    }
    const weights_format f = format_named(format);
    if (f.grouped() && G != (K + f.group - 1) / f.group)
      value_error("pack_given: scales have " + std::to_string(G) + " groups: " + format +
                  " over K = " + std::to_string(K) + " has " +
                  std::to_string((K + f.group - 1) / f.group));
    std::span<const index_t> in_order;
    if (order) {
      if (order->scalar_type() != at::kLong || !order->device().is_cpu() ||
          !order->is_contiguous() || order->dim() != 1)
        type_error("pack_given: order must be a contiguous 1-D CPU int64 tensor");
      static_assert(sizeof(index_t) == sizeof(std::int64_t));
      in_order = {reinterpret_cast<const index_t*>(order->data_ptr<std::int64_t>()),
                  static_cast<std::size_t>(order->numel())};
    }
    ::py::gil_scoped_release free;
    layers_[rank]->pack_given(tensor, slot, format, {q.data_ptr<std::int8_t>(), N, K},
                              scales.data_ptr<float>(),
                              offsets ? offsets->data_ptr<float>() : nullptr, in_order);
  }

  /// Local rank `rank`'s packed copy of matrix `slot` of expert tensor `tensor` as the values
  /// it holds, float32 [N, K] (tests: what a loader gave).
  at::Tensor packed_values(int rank, int tensor, index_t slot) {
    if (rank < 0 || rank >= local_ranks())
      value_error("packed_values: rank " + std::to_string(rank) + " is not a local rank");
    index_t rows = 0, cols = 0;
    const std::vector<float> v = layers_[rank]->packed_values(tensor, slot, rows, cols);
    at::Tensor out = at::empty({rows, cols}, at::kFloat);
    std::copy(v.begin(), v.end(), out.data_ptr<float>());
    return out;
  }

  /// Local: every local rank packs its experts from a checkpoint's tensors (per rank, a list
  /// in the expert tensors' order, routed then shared: fp8 / mxfp4 (codes, scales, cols),
  /// group-wise (q, scales, offsets, order), or None). codes_only: the codes are then the only
  /// copy of the tensors given them (any_layer::load_quantised).
  void load_quantised(const std::string& format, const ::py::list& per_rank, bool codes_only) {
    if (static_cast<int>(per_rank.size()) != local_ranks())
      value_error("load_quantised: one list per local rank (" + std::to_string(local_ranks()) +
                  ")");
    std::vector<std::vector<quantised_tensor>> q(per_rank.size());
    for (std::size_t r = 0; r < q.size(); ++r) {
      int i = 0;
      for (const ::py::handle h : per_rank[r].cast<::py::list>())
        q[r].push_back(quantised_of(
            h, format, "tensors[" + std::to_string(r) + "][" + std::to_string(i++) + "]"));
    }
    ::py::gil_scoped_release free;
    for (std::size_t r = 0; r < q.size(); ++r) layers_[r]->load_quantised(format, q[r], codes_only);
  }

  /// Per local rank: whether its expert views hold values (False: codes only).
  std::vector<bool> holds_values() const {
    std::vector<bool> out;
    for (const auto& l : layers_) out.push_back(l->holds_values());
    return out;
  }

  /// Each local rank's (rows per logical expert, rows computed per rank) of the last pass,
  /// summed over all ranks (collective; every rank gets the same).
  std::pair<std::vector<index_t>, std::vector<index_t>> global_load() {
    moe_load out;
    each_rank([&](int r) {
      moe_load g = layers_[r]->global_load();
      if (r == 0) out = std::move(g);
    });
    return {out.per_expert, out.per_rank};
  }
  /// Collective: the router's bias update from the last pass's global load.
  void update_router() {
    each_rank([&](int r) { layers_[r]->update_router(); });
  }
  std::vector<float> router_bias() { return layers_[0]->router_bias(); }

  /// The process group endpoint's exchanges and the copies it staged them through (None
  /// with thread ranks).
  ::py::object exchange_copies() const {
    if (!c10d_) return ::py::none();
    const c10d_endpoint::copy_counts& c = c10d_->copies();
    ::py::dict d;
    d["exchanges"] = c.exchanges, d["send_copies"] = c.sends, d["receive_copies"] = c.receives;
    return d;
  }

  ::py::list stats() const {
    ::py::list out;
    for (const auto& l : layers_) out.append(stats_dict(l->stats()));
    return out;
  }
  /// Each local rank's router losses (aux, seq_aux, z) of the last pass.
  std::vector<std::vector<double>> losses() const {
    std::vector<std::vector<double>> out;
    for (const auto& l : layers_) {
      const router_losses& s = l->stats().losses;
      out.push_back({s.aux, s.seq_aux, s.z, s.valid ? 1.0 : 0.0});
    }
    return out;
  }

 private:
  static std::string first_bad(std::initializer_list<std::pair<at::Tensor, const char*>> ts) {
    for (const auto& [t, name] : ts)
      if (const std::string why = unviewable(t, 2); !why.empty())
        return std::string(name) + " " + why;
    return "";
  }
  // Why a given routing cannot be viewed, or "".
  static std::string bad_routing(const at::Tensor& ids, const at::Tensor& w, index_t T) {
    if (!ids.defined() || !w.defined()) return "routing: give both ids and weights";
    if (ids.scalar_type() != at::kInt || !ids.is_contiguous() || ids.dim() != 2 ||
        !ids.device().is_cpu())
      return "routing ids: must be a contiguous int32 [T, K] CPU tensor";
    if (const std::string why = unviewable(w, 2); !why.empty()) return "routing weights " + why;
    if (ids.size(0) != T || w.sizes() != ids.sizes())
      return "routing: ids and weights must both be [T, K] with T = x's rows (" +
             std::to_string(T) + ")";
    return "";
  }
  // Rows [a, a + n) of a [T, H] tensor; an empty view of the wrong width when it is bad.
  template <class T>
  static matrix_view<T> rows(const at::Tensor& t, index_t a, index_t n, bool bad) {
    if (bad || !t.defined()) return {nullptr, 0, 0};
    const index_t H = t.size(1);
    using E = std::remove_const_t<T>;
    return {const_cast<E*>(static_cast<const E*>(t.data_ptr())) + a * H, n, H};
  }
  // f(rank) on every local rank with the GIL released (a collective call).
  template <class F>
  void each_rank(F&& f) {
    run_shards(0, "", [&](int r, index_t, index_t) { f(r); });
  }
  // Of the thread ranks' errors, the one that says why (a rank's own config_error) over the
  // peers' "rank N rejected its inputs" (input_error) and aborted exchanges.
  static void rethrow_reason(const std::vector<std::exception_ptr>& errors) {
    for (const std::exception_ptr& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const input_error&) {
      } catch (const config_error&) {
        throw;
      } catch (...) {
      }
    }
  }
  // f(rank, first row, rows) on every local rank with the GIL released; a bad tensor raises
  // TypeError here after the layer told the peers.
  template <class F>
  void run_shards(index_t T, const std::string& bad, F&& f) {
    {
      ::py::gil_scoped_release free;
      try {
        if (world_ && world_->size() > 1) {
          const int R = world_->size();
          std::vector<std::exception_ptr> errors(static_cast<std::size_t>(R));
          try {
            world_->run([&](comm::threads c) {
              const int r = c.rank();
              const index_t a = T * r / R, b = T * (r + 1) / R;
              try {
                f(r, a, b - a);
              } catch (...) {
                errors[r] = std::current_exception();
                throw;  // the world releases the other ranks
              }
            });
          } catch (...) {
            rethrow_reason(errors);
            throw;
          }
        } else {
          // One rank (a process group's, or a single thread rank) runs on this thread, not on
          // one spawned per call (tens of µs of a decode step).
          f(0, 0, T);
        }
      } catch (const std::exception&) {
        if (world_) world_->reset();  // every rank has left: the next pass may run
        if (bad.empty()) throw;
      }
    }
    if (!bad.empty()) type_error(bad);
  }

  std::vector<bundle> menu_;
  const bundle* bundle_;
  layer_args args_;
  std::unique_ptr<comm::threads_world> world_;
  std::vector<std::unique_ptr<comm::endpoint>> endpoints_;
  c10d_endpoint* c10d_ = nullptr;  // endpoints_[0] on a process group
  std::string late_bad_;           // a bad tensor of the split pass in flight, raised by its finish
  std::vector<std::unique_ptr<any_layer>> layers_;
};

// --- the float64 reference (tests) ----------------------------------------------------------

std::vector<float> floats_of(const ::py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return {};
  const at::Tensor t = d[key].cast<at::Tensor>().contiguous().to(at::kFloat);
  return {t.data_ptr<float>(), t.data_ptr<float>() + t.numel()};
}
at::Tensor doubles(const std::vector<double>& v) {
  return torch::tensor(at::ArrayRef<double>(v), at::TensorOptions().dtype(at::kDouble));
}

/// reference.hpp's forward (and backward) of a menu entry on full logical weights: x holds
/// every rank's tokens, rank after rank (tokens_per_rank).
::py::dict run_reference(const ::py::dict& bundle_spec, const ::py::dict& config,
                         std::vector<int> phy_to_log, const ::py::dict& router, int ranks,
                         const ::py::dict& weights, const at::Tensor& x,
                         std::vector<index_t> tokens_per_rank, const std::optional<at::Tensor>& dy,
                         double aux, double seq_aux, double z) {
  const std::vector<bundle> m = menu();
  const bundle& b = find_bundle(m, bundle_spec);
  layer_args a;
  a.cfg = config_of(config);
  a.cfg.ranks = ranks;
  a.phy_to_log = std::move(phy_to_log);
  a.router = router_of(router);
  reference::full_weights w;
  w.cfg = a.cfg;
  w.gate = floats_of(weights, "gate");
  w.w1 = floats_of(weights, "w1"), w.w3 = floats_of(weights, "w3"), w.w2 = floats_of(weights, "w2");
  w.b1 = floats_of(weights, "b1"), w.b2 = floats_of(weights, "b2");
  w.b3 = floats_of(weights, "b3"), w.gate_bias = floats_of(weights, "gate_bias");
  w.shared_w1 = floats_of(weights, "shared_w1"), w.shared_w3 = floats_of(weights, "shared_w3");
  w.shared_w2 = floats_of(weights, "shared_w2");
  w.shared_b1 = floats_of(weights, "shared_b1"), w.shared_b2 = floats_of(weights, "shared_b2");
  w.shared_gate = floats_of(weights, "shared_gate");
  w.output_bias = floats_of(weights, "output_bias");
  const matrix_view<const float> xv = matrix_of<const float>(x, "x");
  const matrix_view<const float> dyv =
      dy ? matrix_of<const float>(*dy, "dy") : matrix_view<const float>{};
  reference_result r;
  {
    ::py::gil_scoped_release free;
    r = b.reference(a, w, xv, tokens_per_rank, dyv, {aux, seq_aux, z});
  }
  ::py::dict out;
  out["y"] = torch::tensor(at::ArrayRef<float>(r.y)).view({x.size(0), x.size(1)});
  ::py::list losses;
  for (const router_losses& l : r.losses) losses.append(::py::make_tuple(l.aux, l.seq_aux, l.z));
  out["losses"] = losses;
  if (r.grads) {
    const reference::gradients& g = *r.grads;
    ::py::dict d;
    d["gate"] = doubles(g.dgate), d["w1"] = doubles(g.dw1), d["w3"] = doubles(g.dw3);
    d["w2"] = doubles(g.dw2), d["b1"] = doubles(g.db1), d["b2"] = doubles(g.db2);
    d["shared_w1"] = doubles(g.dshared_w1), d["shared_w3"] = doubles(g.dshared_w3);
    d["shared_w2"] = doubles(g.dshared_w2), d["shared_b1"] = doubles(g.dshared_b1);
    d["shared_b2"] = doubles(g.dshared_b2), d["shared_gate"] = doubles(g.dshared_gate);
    d["output_bias"] = doubles(g.doutput_bias), d["x"] = doubles(g.dx);
    d["b3"] = doubles(g.db3), d["gate_bias"] = doubles(g.dgate_bias);
    out["grads"] = d;
  }
  return out;
}

}  // namespace
}  // namespace epmoe::py

PYBIND11_MODULE(_epmoe, m) {
  namespace ep = epmoe::py;
  m.doc() = "epmoe's layer for PyTorch (use epmoe.torch.MoE)";
  m.def("menu", [] {
    ::py::list out;
    for (const ep::bundle& b : ep::menu()) {
      ::py::dict d;
      d["router"] = b.router, d["top_k"] = b.top_k, d["expert"] = b.expert;
      d["capacity"] = b.capacity, d["schedule"] = b.schedule, d["exchange"] = b.exchange;
      d["expert_tensors"] = b.expert_tensors, d["trains"] = b.trains;
      out.append(d);
    }
    return out;
  });
  m.def(
      "cpu_kernel",
      [] { return std::string(epmoe::space::name_of(epmoe::space::best_cpu_path())); },
      "The packed kernel this CPU runs: AVX512-BF16 (bf16 copies multiply bf16 inputs), "
      "AVX-512, AVX2+FMA or portable");
  // The formats' values as the packed copies hold them (tests: against torch's conversions).
  m.def(
      "packed_values",
      [](const std::string& format, const at::Tensor& w) {
        const epmoe::weights_format as = ep::format_named(format);
        const at::Tensor c = w.contiguous();
        if (const std::string why = ep::unviewable(c, 2); !why.empty())
          ep::type_error("packed_values: w " + why);
        const epmoe::space::packed_nt p({c.data_ptr<float>(), c.size(0), c.size(1)}, as);
        at::Tensor out = at::empty_like(c);
        p.unpack(out.data_ptr<float>());
        return out;
      },
      "w [N, K] float32 packed in format (fp8, mxfp4, int8, bf16, fp32, a group-wise one: "
      "int4_g128, ...), unpacked: its quantised values",
      ::py::arg("format"), ::py::arg("w"));
  m.def(
      "dequantised",
      [](const std::string& format, const at::Tensor& codes, const at::Tensor& scales,
         epmoe::index_t cols) {
        const ep::quantised_tensor q = ep::quantised_of(
            ::py::make_tuple(codes.unsqueeze(0), scales.unsqueeze(0), cols), format, "dequantised");
        epmoe::space::packed_nt p;
        if (format == "fp8")
          p.repack_fp8({q.codes, q.rows, cols}, static_cast<const float*>(q.scales));
        else
          p.repack_mxfp4(cols, {q.codes, q.rows, (cols + 31) / 32 * 16},
                         {static_cast<const std::uint8_t*>(q.scales), q.rows, (cols + 31) / 32});
        at::Tensor out = at::empty({q.rows, cols}, at::kFloat);
        p.unpack(out.data_ptr<float>());
        return out;
      },
      "A checkpoint's fp8 (codes [N, K] uint8, scale_inv [ceil(N/128), ceil(K/128)]) or mxfp4 "
      "(blocks [N, ceil(K/32) * 16] uint8, scales [N, ceil(K/32)] uint8) tensor loaded as the "
      "packed copies load it, unpacked to float32 [N, K]",
      ::py::arg("format"), ::py::arg("codes"), ::py::arg("scales"), ::py::arg("cols"));
  m.def("reference", &ep::run_reference, "The float64 reference of a menu entry (tests)",
        ::py::arg("bundle"), ::py::arg("config"), ::py::arg("phy_to_log"), ::py::arg("router"),
        ::py::arg("ranks"), ::py::arg("weights"), ::py::arg("x"), ::py::arg("tokens_per_rank"),
        ::py::arg("dy") = ::py::none(), ::py::arg("aux") = 0.0, ::py::arg("seq_aux") = 0.0,
        ::py::arg("z") = 0.0);
  // Communication failures as Python exceptions (RuntimeErrors, as torch's own).
  const ::py::object comm_failed =
      ::py::register_local_exception<epmoe::comm_error>(m, "CommError", PyExc_RuntimeError);
  ::py::register_local_exception<epmoe::comm_timeout>(m, "CommTimeout", comm_failed);
  ::py::register_local_exception<epmoe::comm_aborted>(m, "CommAborted", comm_failed);
  ::py::class_<ep::layer>(m, "Layer")
      .def(::py::init<const ::py::dict&, const ::py::dict&, std::vector<int>, const ::py::dict&,
                      const ::py::list&, const ::py::object&, int, const ::py::object&,
                      const std::string&>(),
           ::py::arg("bundle"), ::py::arg("config"), ::py::arg("phy_to_log"), ::py::arg("router"),
           ::py::arg("weights"), ::py::arg("group"), ::py::arg("ranks"),
           ::py::arg("store") = ::py::none(), ::py::arg("abort_key") = "")
      .def("forward", &ep::layer::forward, ::py::arg("x"), ::py::arg("y"),
           ::py::arg("ids") = ::py::none(), ::py::arg("weights") = ::py::none(),
           ::py::arg("keep") = true, ::py::arg("token_ids") = ::py::none())
      .def("backward", &ep::layer::backward, ::py::arg("dy"), ::py::arg("dx"), ::py::arg("grads"),
           ::py::arg("aux"), ::py::arg("seq_aux"), ::py::arg("z"), ::py::arg("accumulate"),
           ::py::arg("routing_grad") = ::py::none())
      .def("start", &ep::layer::start, ::py::arg("x"), ::py::arg("y"))
      .def("finish", &ep::layer::finish)
      .def("rebind", &ep::layer::rebind)
      .def("pack", &ep::layer::pack, ::py::arg("on"), ::py::arg("format") = "fp32")
      .def("pack_given", &ep::layer::pack_given, ::py::arg("rank"), ::py::arg("tensor"),
           ::py::arg("slot"), ::py::arg("format"), ::py::arg("q"), ::py::arg("scales"),
           ::py::arg("offsets") = ::py::none(), ::py::arg("order") = ::py::none())
      .def("packed_values", &ep::layer::packed_values, ::py::arg("rank"), ::py::arg("tensor"),
           ::py::arg("slot"))
      .def("load_quantised", &ep::layer::load_quantised, ::py::arg("format"), ::py::arg("tensors"),
           ::py::arg("codes_only") = false)
      .def("stats", &ep::layer::stats)
      .def("exchange_copies", &ep::layer::exchange_copies)
      .def("global_load", &ep::layer::global_load)
      .def("update_router", &ep::layer::update_router)
      .def("router_bias", &ep::layer::router_bias)
      .def("losses", &ep::layer::losses)
      .def_property_readonly("holds_values", &ep::layer::holds_values)
      .def_property_readonly("local_ranks", &ep::layer::local_ranks)
      .def_property_readonly("rank", &ep::layer::rank)
      .def_property_readonly("ranks", &ep::layer::ranks)
      .def_property_readonly("trains", &ep::layer::trains)
      .def_property_readonly("key", &ep::layer::key);
}
