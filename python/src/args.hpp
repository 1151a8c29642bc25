// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Python's values as the layer's arguments, and back: tensors to views (checked, no copy),
// dicts to configs and router arguments, the menu entry a dict names, pass_stats to a dict.
// Included by module.cpp only (an anonymous namespace: one translation unit).
#pragma once

#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "layers.hpp"

namespace py = pybind11;

namespace epmoe::py {
namespace {

// --- tensors to views -----------------------------------------------------------------------

[[noreturn]] void type_error(const std::string& msg) { throw ::py::type_error("epmoe: " + msg); }
[[noreturn]] void value_error(const std::string& msg) { throw ::py::value_error("epmoe: " + msg); }

/// Why t cannot be viewed as a float32 CPU matrix, or "" when it can.
std::string unviewable(const at::Tensor& t, int dims) {
  if (!t.defined()) return "is undefined";
  if (t.scalar_type() != at::kFloat)
    return std::string("has dtype ") + c10::toString(t.scalar_type()) + ": must be torch.float32";
  if (!t.device().is_cpu()) return "is on " + t.device().str() + ": must be on the CPU";
  if (!t.is_contiguous()) return "is not contiguous: pass .contiguous()";
  if (t.dim() != dims)
    return "has " + std::to_string(t.dim()) + " dimensions: must have " + std::to_string(dims);
  return "";
}

template <class T>
matrix_view<T> matrix_of(const at::Tensor& t, const std::string& name) {
  if (const std::string why = unviewable(t, 2); !why.empty()) type_error(name + " " + why);
  return {const_cast<float*>(t.data_ptr<float>()), t.size(0), t.size(1)};
}
template <class T>
matrix_view<T> optional_matrix(const ::py::dict& d, const char* key, const std::string& who) {
  if (!d.contains(key) || d[key].is_none()) return {};
  at::Tensor t = d[key].cast<at::Tensor>();
  if (t.dim() == 1) t = t.view({1, t.size(0)});  // output bias [H]
  return matrix_of<T>(t, who + "." + key);
}
template <class T>
std::vector<stacked_view<T>> stacked_list(const ::py::dict& d, const char* key,
                                          const std::string& who) {
  std::vector<stacked_view<T>> out;
  if (!d.contains(key) || d[key].is_none()) return out;
  int i = 0;
  for (const ::py::handle h : d[key]) {
    const std::string name = who + "." + key + "[" + std::to_string(i++) + "]";
    if (h.is_none()) {  // (rebind of a layer of codes only: the view it has)
      out.emplace_back();
      continue;
    }
    const at::Tensor t = h.cast<at::Tensor>();
    // A strided stack of row-major matrices is a view too (w1 and w3: the halves of a fused
    // gate_up_proj [E, 2F, H]).
    std::string why = unviewable(t, 3);
    if (why.find("contiguous") != std::string::npos && (t.stride(2) == 1 || t.size(2) == 1) &&
        t.stride(1) >= t.size(2) && t.stride(0) >= 0)
      why.clear();
    if (!why.empty()) type_error(name + " " + why);
    out.emplace_back(const_cast<float*>(t.data_ptr<float>()), t.size(0), t.size(1), t.size(2),
                     t.size(1) == 1 ? t.size(2) : t.stride(1), t.stride(0));
  }
  return out;
}

template <class T>
rank_tensors<T> tensors_of(const ::py::dict& d, const std::string& who) {
  rank_tensors<T> w;
  w.gate = optional_matrix<T>(d, "gate", who);
  w.experts = stacked_list<T>(d, "experts", who);
  w.shared = stacked_list<T>(d, "shared", who);
  w.noise_gate = optional_matrix<T>(d, "noise_gate", who);
  w.shared_gate = optional_matrix<T>(d, "shared_gate", who);
  w.output_bias = optional_matrix<T>(d, "output_bias", who);
  w.gate_bias = optional_matrix<T>(d, "gate_bias", who);
  return w;
}
rank_weights weights_of(const ::py::dict& d, const std::string& who) {
  return tensors_of<const float>(d, who);
}
rank_grads grads_of(const ::py::dict& d, const std::string& who) {
  return tensors_of<float>(d, who);
}

/// A group-wise stack (q int8 [n, N, K], scales fp32 [n, N, G], offsets as scales or None,
/// order int64 [n, K] or None) as a view; `name` for errors.
quantised_tensor grouped_of(const ::py::handle& h, const std::string& format,
                            const std::string& name) {
  const auto [q, scales, offsets, order] = h.cast<
      std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>>();
  const auto bad = [&](const std::string& what, const at::Tensor& t, at::ScalarType type, int dim) {
    if (t.scalar_type() != type || !t.device().is_cpu() || !t.is_contiguous() || t.dim() != dim)
      type_error(name + "." + what + " is " + c10::toString(t.scalar_type()) + " " +
                 std::to_string(t.dim()) + "-d: must be a contiguous CPU " + c10::toString(type) +
                 " tensor of " + std::to_string(dim) + " dimensions");
  };
  const weights_format f = format_named(format);
  if (!f.grouped())
    value_error("load_quantised: format = '" + format +
                "': must be fp8, mxfp4 or a group-wise "
                "format (int4, int4_asym_g128, int8_g32, ...)");
  bad("q", q, at::kChar, 3);
  bad("scales", scales, at::kFloat, 3);
  const index_t n = q.size(0), rows = q.size(1), cols = q.size(2);
  const std::vector<index_t> groups{n, rows, (cols + f.group - 1) / f.group};
  if (scales.sizes().vec() != groups)
    value_error(name + ": scales " + c10::str(scales.sizes()) + " do not fit q " +
                c10::str(q.sizes()) + ": " + format + " wants [n, rows, ceil(K / " +
                std::to_string(f.group) + ")]");
  if (offsets) {
    bad("offsets", *offsets, at::kFloat, 3);
    if (offsets->sizes().vec() != groups)
      value_error(name + ": offsets must have the shape of scales");
  }
  if (order) {
    bad("order", *order, at::kLong, 2);
    if (order->size(0) != n || order->size(1) != cols)
      value_error(name + ": order must be [n, K] = [" + std::to_string(n) + ", " +
                  std::to_string(cols) + "]");
  }
  return {reinterpret_cast<const std::uint8_t*>(q.data_ptr<std::int8_t>()),
          scales.data_ptr<float>(),
          n,
          rows,
          cols,
          offsets ? offsets->data_ptr<float>() : nullptr,
          order ? order->data_ptr<std::int64_t>() : nullptr};
}

/// A checkpoint's quantised tensor (codes, scales, cols) as a view; `name` for errors.
quantised_tensor quantised_of(const ::py::handle& h, const std::string& format,
                              const std::string& name) {
  if (h.is_none()) return {};
  if (format != "fp8" && format != "mxfp4") return grouped_of(h, format, name);
  const auto [codes, scales, cols] = h.cast<std::tuple<at::Tensor, at::Tensor, index_t>>();
  const auto bad = [&](const std::string& what, const at::Tensor& t, at::ScalarType type) {
    if (t.scalar_type() != type || !t.device().is_cpu() || !t.is_contiguous() || t.dim() != 3)
      type_error(name + "." + what + " is " + c10::toString(t.scalar_type()) + " " +
                 std::to_string(t.dim()) + "-d: must be a contiguous CPU " + c10::toString(type) +
                 " tensor [count, ...]");
  };
  bad("codes", codes, at::kByte);
  const bool fp8 = format == "fp8";
  bad("scales", scales, fp8 ? at::kFloat : at::kByte);
  const index_t n = codes.size(0), rows = codes.size(1);
  const index_t want_codes = fp8 ? cols : (cols + 31) / 32 * 16;
  const std::vector<index_t> want_scales =
      fp8 ? std::vector<index_t>{n, (rows + 127) / 128, (cols + 127) / 128}
          : std::vector<index_t>{n, rows, (cols + 31) / 32};
  if (codes.size(2) != want_codes || scales.sizes().vec() != want_scales)
    value_error(name + ": codes " + c10::str(codes.sizes()) + " and scales " +
                c10::str(scales.sizes()) + " do not fit " + std::to_string(cols) + " inputs: " +
                (fp8 ? "fp8 wants codes [n, rows, K] and scales [n, ceil(rows / "
                       "128), ceil(K / 128)]"
                     : "mxfp4 wants codes [n, rows, ceil(K / 32) * 16] and scales "
                       "[n, rows, ceil(K / 32)]"));
  return {codes.data_ptr<std::uint8_t>(), scales.data_ptr(), n, rows, cols};
}

::py::dict stats_dict(const pass_stats& s) {
  ::py::dict d;
  d["tokens"] = s.tokens;
  d["assignments"] = s.assignments;
  d["zero_expert_assignments"] = s.zero_expert_assignments;
  d["dropped"] = s.dropped;
  d["capacity"] = s.capacity ? ::py::cast(*s.capacity) : ::py::none();
  d["padding_rows"] = s.padding_rows;
  d["routed_per_expert"] = s.routed_per_expert;
  d["rows_per_local_expert"] = s.rows_per_local_expert;
  d["padded_rows_per_local_expert"] = s.padded_rows_per_local_expert;
  d["rows_sent"] = s.rows_sent;
  d["rows_received"] = s.rows_received;
  d["dispatch_bytes_sent"] = s.dispatch_bytes_sent;
  d["dispatch_bytes_received"] = s.dispatch_bytes_received;
  d["combine_bytes_sent"] = s.combine_bytes_sent;
  d["combine_bytes_received"] = s.combine_bytes_received;
  d["expert_flops"] = s.expert_flops;
  d["shared_flops"] = s.shared_flops;
  d["expert_imbalance"] = s.expert_imbalance.max_over_mean;
  d["rank_imbalance"] = s.rank_imbalance.max_over_mean;
  d["chunks"] = s.chunks;
  d["rounds"] = s.rounds;
  d["alltoalls"] = s.alltoalls;
  d["ranks_per_node"] = s.ranks_per_node;
  for (const auto& [name, l] :
       {std::pair{"intra_node", &s.intra_node}, std::pair{"inter_node", &s.inter_node}}) {
    ::py::dict t;  // rows and bytes over one link class (both levels when hierarchical)
    t["rows_sent"] = l->rows_sent, t["rows_received"] = l->rows_received;
    t["bytes_sent"] = l->bytes_sent, t["bytes_received"] = l->bytes_received;
    d[name] = t;
  }
  d["comm_seconds"] = s.comm_seconds;
  d["exposed_comm_seconds"] = s.exposed_comm_seconds;
  d["overlap"] = s.overlap;
  d["backward"] = s.backward;
  d["saved_bytes"] = s.saved_bytes;  // what the last forward kept for backward (0: nothing)
  ::py::dict t;
  const stage_times& st = s.time;
  t["route"] = st.route, t["plan"] = st.plan, t["permute"] = st.permute;
  t["dispatch"] = st.dispatch, t["experts"] = st.experts, t["combine"] = st.combine;
  t["shared"] = st.shared, t["reduce"] = st.reduce, t["total"] = st.total;
  d["time"] = t;
  return d;
}

// --- configs, router arguments, menu entries ------------------------------------------------

layer_config config_of(const ::py::dict& c) {
  layer_config cfg;
  cfg.hidden = c["hidden"].cast<int>();
  cfg.ffn = c["ffn"].cast<int>();
  cfg.experts = c["experts"].cast<int>();
  if (c.contains("zero_experts")) cfg.zero_experts = c["zero_experts"].cast<int>();
  cfg.top_k = c["top_k"].cast<int>();
  cfg.max_tokens = c["max_tokens"].cast<int>();
  cfg.capacity_factor = c["capacity_factor"].cast<double>();
  cfg.shared_experts = c["shared_experts"].cast<int>();
  cfg.shared_ffn = c["shared_ffn"].cast<int>();
  cfg.shared_gate = c["shared_gate"].cast<bool>();
  cfg.output_bias = c["output_bias"].cast<bool>();
  cfg.aux_loss_coef = c["aux_loss_coef"].cast<double>();
  cfg.seq_len = c["seq_len"].cast<int>();
  cfg.chunks = c["chunks"].cast<int>();
  cfg.max_recv_rows = c["max_recv_rows"].cast<int>();
  if (c.contains("ranks_per_node")) cfg.ranks_per_node = c["ranks_per_node"].cast<int>();
  cfg.training = c["training"].cast<bool>();
  cfg.recompute = c["recompute"].cast<bool>();
  if (c.contains("exchange_timeout")) cfg.exchange_timeout = c["exchange_timeout"].cast<double>();
  if (c.contains("dispatch_rows")) {
    const auto rows = c["dispatch_rows"].cast<std::string>();
    detail::require(rows == "activations" || rows == "int8", "dispatch_rows", rows,
                    "must be activations or int8");
    cfg.dispatch_rows = rows == "int8" ? row_format::int8 : row_format::activations;
  }
  return cfg;
}

router_args router_of(const ::py::dict& r) {
  router_args a;
  a.groups = r["groups"].cast<int>();
  a.top_groups = r["top_groups"].cast<int>();
  a.norm_p = r["norm_p"].cast<float>();
  a.scaling = r["scaling"].cast<float>();
  a.group_by_max = r["group_by_max"].cast<bool>();
  a.normalize = r["normalize"].cast<bool>();
  a.group_mask_zero = r["group_mask_zero"].cast<bool>();
  a.gamma = r["gamma"].cast<float>();
  if (!r["bias"].is_none()) a.bias = r["bias"].cast<std::vector<float>>();
  a.jitter_eps = r["jitter_eps"].cast<float>();
  if (r.contains("eps")) a.eps = r["eps"].cast<float>();
  if (r.contains("norm_min")) a.norm_min = r["norm_min"].cast<float>();
  if (r.contains("table") && !r["table"].is_none()) {
    a.table = r["table"].cast<std::vector<std::int32_t>>();
    a.vocab = r["vocab"].cast<std::int64_t>();
  }
  return a;
}

/// The menu entry named by (router, top_k, expert, capacity, schedule, exchange), or a
/// ValueError listing the entries there are.
const bundle& find_bundle(const std::vector<bundle>& m, const ::py::dict& b) {
  const auto router = b["router"].cast<std::string>(), expert = b["expert"].cast<std::string>();
  const auto capacity = b["capacity"].cast<std::string>();
  const auto schedule = b["schedule"].cast<std::string>();
  const auto exchange = b.contains("exchange") ? b["exchange"].cast<std::string>() : "flat";
  const int k = b["top_k"].cast<int>();
  for (const bundle& e : m)
    if (e.router == router && e.top_k == k && e.expert == expert && e.capacity == capacity &&
        e.schedule == schedule && e.exchange == exchange)
      return e;
  std::string list;
  for (const bundle& e : m) list += "\n  " + e.key();
  value_error("no precompiled bundle router=" + router + " top_k=" + std::to_string(k) +
              " expert=" + expert + " capacity=" + capacity + " schedule=" + schedule +
              " exchange=" + exchange + "; the menu has:" + list);
}

}  // namespace
}  // namespace epmoe::py
