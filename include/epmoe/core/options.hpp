// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Options of a policy bundle that are neither a policy nor a run-time value: declared in one
// struct, so a misspelt option fails to compile instead of being silently ignored:
//   struct my_policies : epmoe::default_policies {
//     static constexpr epmoe::layer_options options{.dedup = true};
//   };
namespace epmoe {

/// How a layer's packed expert weights are stored (layer_options::pack_weights), chosen once
/// per pack and read by the space's kernels (docs/quantisation.md):
/// - fp32: the weights as they are;
/// - bf16: half the bytes a pass reads; each weight rounded to nearest even once, at pack
///   time; activations, products and sums stay fp32;
/// - int8_channel: a quarter of the bytes; each output channel (row of an [out, in] weight)
///   as int8 in [-127, 127] times one fp32 scale (max |w| / 127), symmetric; forward only
///   (inference). Activations quantised per token to int8 on AVX512-VNNI (W8A8), else fp32.
/// - int4, int4_asym, int8_group: group-wise, `group` inputs (a multiple of 32; the last group
///   of a row may be partial) per fp32 scale: int4 q in [-8, 7], w = scale q; int4_asym
///   q in [0, 15] and an fp32 offset per group, w = scale q + offset (GPTQ/AWQ's zero points,
///   GGUF Q4_K); int8_group q in [-127, 127] (GGUF Q8_0 at group 32); forward only. W4A8 /
///   W8A8 on AVX512-VNNI, else fp32 (space/host_int4.hpp).
/// - fp8_block: about a quarter; FP8 e4m3fn times one fp32 scale per 128 x 128 block (as
///   DeepSeek-V3's checkpoints: w = fp8 * scale_inv); forward only; computed as bf16.
/// - mxfp4: about an eighth; E2M1 in blocks of 32 inputs with one E8M0 scale each (OCP MX,
///   GPT-OSS's checkpoints); forward only; computed as bf16.
/// A format is a kind plus its parameters (a group size, zero points: the later int4 kinds),
/// a plain value: the layer passes it to the store, which the space's kernels read.
struct weights_format {
  enum class kind : unsigned char {
    fp32,
    bf16,
    int8_channel,
    int4,
    int4_asym,
    int8_group,
    fp8_block,
    mxfp4
  };
  kind id = kind::fp32;
  int group = 0;  // input elements per scale; 0: one scale per output channel (or none)

  static const weights_format fp32, bf16, int8_channel;
  static const weights_format int4_g32, int4_g128, int4_asym_g32, int4_asym_g128, int8_g32;
  static const weights_format fp8_block, mxfp4;  // group: 128, 32

  friend constexpr bool operator==(const weights_format&, const weights_format&) = default;
  /// Whether the packed copies compute the forward only (no backward reads them).
  constexpr bool inference_only() const {
    return id == kind::int8_channel || grouped() || id == kind::fp8_block || id == kind::mxfp4;
  }
  /// Whether a scale (and offset) per group of inputs (space/host_int4.hpp's panels).
  constexpr bool grouped() const {
    return id == kind::int4 || id == kind::int4_asym || id == kind::int8_group;
  }
  constexpr const char* name() const {
    return id == kind::bf16           ? "bf16"
           : id == kind::int8_channel ? "int8_channel"
           : id == kind::int4         ? "int4"
           : id == kind::int4_asym    ? "int4_asym"
           : id == kind::int8_group   ? "int8_group"
           : id == kind::fp8_block    ? "fp8_block"
           : id == kind::mxfp4        ? "mxfp4"
                                      : "fp32";
  }
};
inline constexpr weights_format weights_format::fp32{weights_format::kind::fp32};
inline constexpr weights_format weights_format::bf16{weights_format::kind::bf16};
inline constexpr weights_format weights_format::int8_channel{weights_format::kind::int8_channel};
inline constexpr weights_format weights_format::int4_g32{weights_format::kind::int4, 32};
inline constexpr weights_format weights_format::int4_g128{weights_format::kind::int4, 128};
inline constexpr weights_format weights_format::int4_asym_g32{weights_format::kind::int4_asym, 32};
inline constexpr weights_format weights_format::int4_asym_g128{weights_format::kind::int4_asym,
                                                               128};
inline constexpr weights_format weights_format::int8_g32{weights_format::kind::int8_group, 32};
inline constexpr weights_format weights_format::fp8_block{weights_format::kind::fp8_block, 128};
inline constexpr weights_format weights_format::mxfp4{weights_format::kind::mxfp4, 32};

/// The name of weights_format from before formats beyond floats (fp32, bf16).
using packed_precision = weights_format;

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
  /// The packed copies' format (pack_weights() may choose another at run time).
  weights_format pack_as = weights_format::fp32;
  /// The low-latency exchange (docs/decode.md): fixed slots of max_tokens x min(K, L) rows per
  /// (source, destination) pair, so the dispatch is one all-to-all of rows with their counts
  /// (no counts round) and the combine one back; bytes fixed by the slots. Flat rows, one
  /// chunk, no receive bound, inference only (config training = false).
  bool low_latency = false;
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
