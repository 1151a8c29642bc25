// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The layer behind epmoe.torch.MoE, without torch: one moe_layer per precompiled policy
// bundle, over comm::any, behind one virtual interface. The torch side (module.cpp) turns
// tensors into the views here; the bundle files (bundles_*.cpp) instantiate the layers, each
// in its own translation unit so that two cores build them side by side.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "epmoe/comm/any.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/options.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/reference/backward.hpp"

namespace epmoe::py {

/// The run-time fields of every router in the menu; a bundle takes the ones its router has.
struct router_args {
  int groups = 1;
  int top_groups = 1;
  float norm_p = 1.f;
  float scaling = 1.f;
  bool group_by_max = false;        // topk_softmax: a group scored by its best expert
  bool normalize = true;            // sigmoid_bias
  bool group_mask_zero = false;     // sigmoid_bias: Hugging Face's 0.0 for dropped groups
  float gamma = 0.f;                // sigmoid_bias: bias update speed (0: the bias stays)
  std::vector<float> bias;          // sigmoid_bias: [E] or empty
  float jitter_eps = 0.01f;         // sparsemixer
  float eps = 0.f;                  // scored routers: added to the chosen scores' sum
  float norm_min = 0.f;             // scored routers: the sum clamped below at this
  std::vector<std::int32_t> table;  // table routers: [vocab, K] expert ids per token id
  std::int64_t vocab = 0;           // table routers: rows of `table`
};

/// The weights_format of a pack_weights name: fp32, bf16, int8 (int8_channel), and the
/// group-wise int4[_asym][_g<group>] and int8_g<group> (int4: group 32). config_error else.
inline weights_format format_named(const std::string& s) {
  using k = weights_format::kind;
  if (s == "fp32" || s == "bf16" || s == "int8" || s == "fp8" || s == "mxfp4")
    return s == "int8"    ? weights_format::int8_channel
           : s == "bf16"  ? weights_format::bf16
           : s == "fp8"   ? weights_format::fp8_block
           : s == "mxfp4" ? weights_format::mxfp4
                          : weights_format::fp32;
  const auto group = [&](std::size_t at) {  // "" or "_g<digits>" from `at`
    if (at == s.size()) return 32;
    const bool digits = s.compare(at, 2, "_g") == 0 && at + 2 < s.size() && at + 6 >= s.size() &&
                        std::all_of(s.begin() + static_cast<std::ptrdiff_t>(at) + 2, s.end(),
                                    [](char c) { return c >= '0' && c <= '9'; });
    return digits ? std::stoi(s.substr(at + 2)) : -1;
  };
  weights_format f{k::fp32, -1};
  if (s.rfind("int4_asym", 0) == 0)
    f = {k::int4_asym, group(9)};
  else if (s.rfind("int4", 0) == 0)
    f = {k::int4, group(4)};
  else if (s.rfind("int8_g", 0) == 0)
    f = {k::int8_group, group(4)};
  detail::require(f.group > 0, "pack_weights", s,
                  "must be fp32, bf16, int8, int4[_asym][_g<group>], int8_g<group>, fp8 or mxfp4");
  return f;
}

/// Everything a bundle needs to build its layer on one rank.
struct layer_args {
  layer_config cfg;
  std::vector<int> phy_to_log;  // placement::table: logical expert of each physical slot
  router_args router;
};

/// One rank's weights (T = const float: views into the framework's tensors) or gradients
/// (T = float), shaped as moe_layer's weights. Expert tensors in the expert policy's
/// tensors() order (swiglu: w1, w3, w2; mlp: w1, w2 and, with biases, b1, b2; gpt_oss: w1,
/// w3, w2, b1, b3, b2).
template <class T>
struct rank_tensors {
  matrix_view<T> gate{};
  std::vector<stacked_view<T>> experts;
  std::vector<stacked_view<T>> shared;
  matrix_view<T> noise_gate{};
  matrix_view<T> shared_gate{};
  matrix_view<T> output_bias{};
  matrix_view<T> gate_bias{};  // [E]: router::logit_bias (GPT-OSS)
};
using rank_weights = rank_tensors<const float>;
using rank_grads = rank_tensors<float>;

/// A stacked tensor of expert weights quantised already, as a checkpoint stores it
/// (load_quantised): codes [count, rows, bytes per row] (fp8: one e4m3fn byte a weight;
/// mxfp4: GPT-OSS's blocks, ceil(cols / 32) * 16 bytes, two E2M1 codes a byte) and scales
/// [count, ...] (fp8: fp32 [ceil(rows / 128), ceil(cols / 128)]; mxfp4: E8M0 bytes [rows,
/// ceil(cols / 32)]), both contiguous; cols: the weights' inputs K.
/// Group-wise formats: q int8 [count, rows, cols], scales (and offsets: int4_asym) fp32
/// [count, rows, groups], an act order int64 [count, cols] or none.
struct quantised_tensor {
  const std::uint8_t* codes = nullptr;  // nullptr: packed from the weights' values instead
  const void* scales = nullptr;
  index_t count = 0, rows = 0, cols = 0;
  const float* offsets = nullptr;       // group-wise: int4_asym's
  const std::int64_t* order = nullptr;  // group-wise: an act order per matrix, or none
};

/// What gather_load returns, without the layer's type.
struct moe_load {
  std::vector<index_t> per_expert;  // [E]
  std::vector<index_t> per_rank;    // [R]
};

/// A layer of some bundle on one rank. Collective calls as moe_layer's.
class any_layer {
 public:
  virtual ~any_layer() = default;
  /// routing: a given routing (ids [T, K], weights [T, K]) or nullptr for the router's own;
  /// keep: a training layer keeps what backward reads (false: no_grad, nothing kept).
  /// token_ids: the tokens' vocabulary ids [T] (table routers need them), or empty.
  virtual void forward(matrix_view<const float> x, matrix_view<float> y,
                       const routing_view* routing, bool keep,
                       std::span<const std::int64_t> token_ids) = 0;
  /// Split phase (moe_layer::start/finish, docs/decode.md): the dispatch of y = MoE(x) is
  /// posted, finish() runs the experts and the combine into y. One split pass per layer.
  virtual void start(matrix_view<const float> x, matrix_view<float> y,
                     std::span<const std::int64_t> token_ids) = 0;
  virtual void finish() = 0;
  /// Empty expert gradients: frozen experts (no dW). routing_grad: a given routing's
  /// weights' gradient [T, K], or empty.
  virtual void backward(matrix_view<const float> dy, matrix_view<float> dx, const rank_grads& g,
                        const loss_scales& losses, bool accumulate,
                        matrix_view<float> routing_grad) = 0;
  virtual const pass_stats& stats() const = 0;
  /// Points the layer at new tensors of the same shapes (a framework replaced a parameter).
  virtual void rebind(const rank_weights& w) = 0;
  /// Packs the expert weights into the layer's own copies (again: their values now), or
  /// frees those and reads the tensors (moe_layer::pack_weights / unpack_weights), in
  /// `format`: "fp32", "bf16" (copies rounded to bf16: half the bytes a pass reads), "int8"
  /// (weights_format::int8_channel: a quarter, forward only), a group-wise format
  /// (format_named: "int4", "int4_asym_g128", "int8_g32", ...; forward only), "fp8"
  /// (fp8_block) or "mxfp4" (forward only).
  virtual void pack(bool on, const std::string& format) = 0;
  /// Replaces the packed copy of matrix `slot` of expert tensor `tensor` (rank_tensors'
  /// experts order, then the shared ones) with weights quantised already in group-wise
  /// `format`, the one packed (space::packed_nt::repack_grouped: q [N, K], scales and
  /// offsets [N, G]; an act-order checkpoint's input order [K], or empty:
  /// packed_nt::set_input_order).
  virtual void pack_given(int tensor, index_t slot, const std::string& format,
                          matrix_view<const std::int8_t> q, const float* scales,
                          const float* offsets, std::span<const index_t> order) = 0;
  /// The values that packed copy holds (its format's dequantise), [N, K] row-major, with N
  /// and K.
  virtual std::vector<float> packed_values(int tensor, index_t slot, index_t& rows,
                                           index_t& cols) = 0;
  /// Packs the expert weights in `format` ("fp8" or "mxfp4") from a checkpoint's tensors as
  /// they are (moe_layer::pack_weights with a loader): one per expert tensor, routed then
  /// shared, in the expert's tensors() order (a missing one packed from the weights).
  /// A group-wise format too. codes_only: the codes are the only copy (moe_layer::pack_codes):
  /// the tensors given codes are bound to views of no memory (space::unbacked_tensors); a
  /// missing one (a bias) keeps its values and is packed from them.
  virtual void load_quantised(const std::string& format,
                              const std::vector<quantised_tensor>& tensors, bool codes_only) = 0;
  /// Whether the layer's expert views hold values (false: codes only).
  virtual bool holds_values() const = 0;
  /// Collective: the last pass's rows per logical expert [E] and rows computed per rank [R],
  /// summed over the ranks (moe_layer::gather_load).
  virtual moe_load global_load() = 0;
  /// Collective: the bias update of a router with a bias (DeepSeek-V3's aux-loss-free
  /// balancing) from the last pass's global load; config_error for other routers.
  virtual void update_router() = 0;
  /// The router's selection bias [E] (empty for a router without one).
  virtual std::vector<float> router_bias() = 0;
  virtual int rank() const = 0;
  virtual int local_slots() const = 0;
};

/// The float64 reference's answer for a bundle (tests): y, each rank's losses and, for a
/// bundle that trains, the gradients (the losses' scaled gradient included).
struct reference_result {
  std::vector<float> y;
  std::vector<router_losses> losses;
  std::optional<reference::gradients> grads;
};
using reference_fn = std::function<reference_result(
    const layer_args&, const reference::full_weights&, matrix_view<const float> x,
    std::span<const index_t> tokens_per_rank, matrix_view<const float> dy, const loss_scales&)>;

/// One entry of the menu.
struct bundle {
  std::string router;  // softmax, softmax_raw, sigmoid_bias, sparsemixer, ...
  int top_k = 0;
  std::string expert;                       // swiglu, mlp_relu, mlp_relu_bias, mlp_gelu, ...
  std::string capacity;                     // dropless, factor, padded
  std::string schedule;                     // sequential, pipelined
  std::string exchange = "flat";            // flat, dedup, hierarchical
  std::vector<std::string> expert_tensors;  // names, in rank_weights order
  bool trains = true;                       // has a backward
  std::function<std::unique_ptr<any_layer>(const layer_args&, comm::any, const rank_weights&)> make;
  reference_fn reference;

  std::string key() const {
    return "router=" + router + " top_k=" + std::to_string(top_k) + " expert=" + expert +
           " capacity=" + capacity + " schedule=" + schedule + " exchange=" + exchange;
  }
};

// Each bundles_*.cpp adds its entries.
void add_softmax_bundles(std::vector<bundle>& menu);
void add_other_bundles(std::vector<bundle>& menu);
void add_gpt_oss_bundles(std::vector<bundle>& menu);
void add_exchange_bundles(std::vector<bundle>& menu);
void add_scored_bundles(std::vector<bundle>& menu);
void add_longcat_llama4_bundles(std::vector<bundle>& menu);

inline std::vector<bundle> menu() {
  std::vector<bundle> m;
  add_softmax_bundles(m);
#ifndef EPMOE_PYTHON_MENU_MIXTRAL  // the one entry add_softmax_bundles keeps then
  add_other_bundles(m);
  add_gpt_oss_bundles(m);
  add_exchange_bundles(m);
  add_scored_bundles(m);
  add_longcat_llama4_bundles(m);
#endif
  return m;
}

}  // namespace epmoe::py
