// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Options of a policy bundle that are neither a policy nor a run-time value: declared in one
// struct, so a misspelt option fails to compile instead of being silently ignored:
//   struct my_policies : epmoe::default_policies {
//     static constexpr epmoe::layer_options options{.dedup = true};
//   };
namespace epmoe {

/// The element type of a layer's packed expert weights (layer_options::pack_weights): fp32,
/// or bf16 (half the bytes a pass reads; each weight rounded to nearest even once, at pack
/// time; activations, products and sums stay fp32).
enum class packed_precision { fp32, bf16 };

struct layer_options {
  /// Per-rank dedup: a token sends one row to each rank that holds any of its experts, and
  /// that rank returns one weighted sum (as DeepEP and Tutel do).
  bool dedup = false;
  /// Hierarchical dispatch and combine (implies dedup): a token sends one row to each node
  /// holding any of its experts, to the rank there with its home's local index, which fans it
  /// out to that node's ranks; the combine sums inside the node before the row goes home
  /// (as DeepEP's internode kernels). Nodes: layer_config::ranks_per_node or the comm's.
  bool hierarchical = false;
  /// Bit-identical outputs and gradients from run to run (docs/training.md): every sum in a
  /// fixed order, none depending on buffer alignment or thread timing (the host's streaming
  /// GEMM gives up its alignment head; the other kernels already are). Across rank counts
  /// results agree within fp32 rounding (a rank count changes which rows share a GEMM).
  bool deterministic = false;
  /// Expert weights packed at construction into storage the layer owns, in the layout of
  /// the space's own GEMM (space::host: panels read once per pass at any row count; see
  /// moe_layer::pack_weights). Costs a second copy of this rank's expert weights; weights
  /// changed in place afterwards (an optimizer step) need pack_weights() again.
  bool pack_weights = false;
  /// The packed copies' element type (pack_weights() may choose another at run time).
  packed_precision pack_as = packed_precision::fp32;
};

namespace detail {
/// The bundle's options (layer_options{} when it declares none).
template <class Policies>
constexpr layer_options options_of() {
  if constexpr (requires { Policies::options; })
    return Policies::options;
  else
    return {};
}
}  // namespace detail

}  // namespace epmoe
