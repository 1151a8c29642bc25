// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>

#include "epmoe/core/error.hpp"

namespace epmoe {

/// How the dispatch carries its rows (layer_config::dispatch_rows; docs/wire.md):
/// at the activation type, or as int8 with one fp32 scale per row
/// (symmetric, scale = max |x| / 127), quantised once per token at the sender and dequantised
/// into the experts' input rows on receipt. The combine stays at the activation type.
enum class row_format : unsigned char { activations, int8 };
inline const char* row_format_name(row_format f) {
  return f == row_format::int8 ? "int8" : "activations";
}

/// Shape and run-time knobs of one MoE layer. Knobs that change code (top-k selection,
/// activation, padding) live in the policies; these are plain values.
struct layer_config {
  int hidden = 0;                 // H: model width of a token row
  int ffn = 0;                    // F: inner width of each expert FFN
  int experts = 0;                // E: logical routed experts (the placement spreads them)
  int zero_experts = 0;           // Z: zero-computation experts (LongCat-Flash): the router
                                  // scores E + Z (gate [E + Z, H]); a token's pick e >= E adds
                                  // weight · x at home and is never dispatched
  int top_k = 0;                  // K: experts per token (must equal the router's top_k)
  int ranks = 1;                  // R: expert-parallel ranks
  int max_tokens = 0;             // most tokens one rank passes to forward(); sizes the workspace
  double capacity_factor = 1.0;   // capacity::factor: rows per expert = ceil(cf * T * K / E)
  int shared_experts = 0;         // N always-on experts every token runs on its home rank
  int shared_ffn = 0;             // inner width of each shared expert (0: same as ffn)
  bool shared_gate = false;       // Qwen2-MoE: shared expert n's output times
                                  // sigmoid(x · weights.shared_gate[n]), per token
  bool output_bias = false;       // JetMoE: weights.output_bias [H] added to every output row
  double aux_loss_coef = 0.01;    // alpha of the load-balancing loss reported in stats
  int seq_len = 0;                // tokens per sequence for the sequence-level loss (0: whole pass)
  int chunks = 0;                 // pass split into chunks of tokens (0: the schedule's default)
  int max_recv_rows = 0;          // rows a rank may hold in its receive buffer (0: unbounded,
                                  // sized R*T*K); past it a pass exchanges in rounds
  bool training = false;          // forward keeps what backward() needs (docs/training.md):
                                  // the routing, the plan and the experts' input rows
  bool recompute = false;         // training: drop the experts' hidden layers and recompute
                                  // them in backward (less memory, two more GEMMs per expert)
  int ranks_per_node = 0;         // ranks of one node (fast links among them): the stats split
                                  // traffic by it and options.hierarchical exchanges in two
                                  // levels (0: the comm's ranks_per_node(), else one node)
  double exchange_timeout = 600;  // seconds an exchange waits for its peers before every
                                  // waiting rank throws comm_timeout (0: no deadline); ten
                                  // minutes: far past any pass, short of a job's time limit
  row_format dispatch_rows = row_format::activations;  // int8: the dispatch's rows in 8 bits
                                                       // and a scale (inference: no backward)

  int experts_per_rank() const { return experts / ranks; }
  /// Experts the router scores and picks from: the routed ones and the zero experts.
  int scored_experts() const { return experts + zero_experts; }
  /// The config as the router sees it: E + Z experts (its gate, logits, bias, losses).
  layer_config router_view() const {
    layer_config c = *this;
    c.experts = scored_experts();
    c.zero_experts = 0;
    return c;
  }
  int shared_width() const { return shared_ffn > 0 ? shared_ffn : ffn; }

  /// Throws config_error naming the first field that breaks its rule.
  void validate() const {
    using detail::require;
    require(hidden > 0, "hidden", hidden, "must be > 0");
    require(ffn > 0, "ffn", ffn, "must be > 0");
    require(experts > 0, "experts", experts, "must be > 0");
    require(top_k >= 1, "top_k", top_k, "must be >= 1");
    require(zero_experts >= 0, "zero_experts", zero_experts, "must be >= 0");
    require(top_k <= scored_experts(), "top_k", top_k,
            "must be <= experts + zero_experts (a token picks distinct experts)");
    require(ranks >= 1, "ranks", ranks, "must be >= 1");
    require(max_tokens >= 1, "max_tokens", max_tokens, "must be >= 1");
    require(std::isfinite(capacity_factor) && capacity_factor > 0, "capacity_factor",
            capacity_factor, "must be finite and > 0");
    require(shared_experts >= 0, "shared_experts", shared_experts, "must be >= 0");
    require(shared_ffn >= 0, "shared_ffn", shared_ffn, "must be >= 0 (0: same as ffn)");
    require(!shared_gate || shared_experts > 0, "shared_gate", shared_gate,
            "needs shared_experts > 0 (it scales the shared experts' output)");
    require(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0, "aux_loss_coef", aux_loss_coef,
            "must be finite and >= 0");
    require(seq_len >= 0, "seq_len", seq_len, "must be >= 0 (0: the whole pass)");
    require(chunks >= 0 && chunks <= 1024, "chunks", chunks,
            "must be in [0, 1024] (0: the schedule's default)");
    require(max_recv_rows >= 0, "max_recv_rows", max_recv_rows, "must be >= 0 (0: unbounded)");
    require(max_recv_rows == 0 || max_recv_rows >= ranks, "max_recv_rows", max_recv_rows,
            "must be 0 (unbounded) or >= ranks: every (source, destination) pair moves at "
            "least one row per round");
    require(ranks_per_node >= 0 && ranks_per_node <= ranks, "ranks_per_node", ranks_per_node,
            "must be in [0, ranks] (0: the comm's, else one node)");
    require(ranks_per_node == 0 || ranks % ranks_per_node == 0, "ranks_per_node", ranks_per_node,
            "must divide ranks (every node holds as many ranks)");
    require(std::isfinite(exchange_timeout) && exchange_timeout >= 0 && exchange_timeout <= 1e9,
            "exchange_timeout", exchange_timeout,
            "must be finite and >= 0 seconds (0: no deadline), at most 1e9");
    require(dispatch_rows == row_format::activations || dispatch_rows == row_format::int8,
            "dispatch_rows", static_cast<int>(dispatch_rows), "must be activations or int8");
    // Row offsets are 32-bit on the device side: keep every buffer's row count in range.
    require(static_cast<std::int64_t>(max_tokens) * top_k * ranks < (std::int64_t{1} << 31),
            "max_tokens", max_tokens, "max_tokens * top_k * ranks must be < 2^31");
  }
};

}  // namespace epmoe
