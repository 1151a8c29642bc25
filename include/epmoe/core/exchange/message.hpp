// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/view.hpp"

// The first message of every collective call of a layer: a header (this rank's verdict on its
// inputs, and which call, pass and chunks it makes), then a pass's counts. Every call sends
// the same size, so ranks that make different calls still meet in one exchange and learn it
// from the headers, before a row moves.
namespace epmoe {

/// The collective calls of a layer: every rank makes the same ones in the same order.
enum class call_kind : std::int64_t {
  none = 0,
  forward,
  backward,
  reduce_gradients,
  gather_load,
  update_router,
  apply_placement
};
inline const char* call_name(call_kind k) {
  switch (k) {
    case call_kind::forward:
      return "forward";
    case call_kind::backward:
      return "backward";
    case call_kind::reduce_gradients:
      return "reduce_gradients";
    case call_kind::gather_load:
      return "gather_load";
    case call_kind::update_router:
      return "update_router";
    case call_kind::apply_placement:
      return "apply_placement";
    default:
      return "no call";
  }
}

/// What a call tells every peer first: whether this rank accepted its inputs, and which call,
/// for which pass (a backward: its forward's) and with how many chunks.
struct call_header {
  static constexpr int size = 4;
  std::int64_t valid = 1;
  call_kind kind = call_kind::none;
  std::int64_t pass = 0;
  std::int64_t chunks = 0;
};

/// Where each part of the message to one peer sits (elements of index_t): the header; per
/// chunk c, L padded counts, L real counts and the unique rows (dedup), and hierarchical
/// (G > 0) the node rows to the peer's node and the unique rows to each of its G ranks; then
/// per chunk the rounds the sender's rows need (a row bound). C is the layout's most chunks.
struct message_layout {
  int R = 1, L = 1, C = 1, G = 0;
  EPMOE_HD index_t width() const { return 2 * L + 1 + (G > 0 ? 1 + G : 0); }
  EPMOE_HD index_t per_peer() const { return call_header::size + C * width() + C; }
  EPMOE_HD index_t chunk_at(int c) const { return call_header::size + c * width(); }
  EPMOE_HD index_t rounds_at(int c) const { return call_header::size + C * width() + c; }
};

namespace exchange_ops {

/// Writes the header of the message to peer r.
EPMOE_HD void write_header(index_t* o, const call_header& h) {
  o[0] = h.valid;
  o[1] = static_cast<index_t>(h.kind);
  o[2] = h.pass;
  o[3] = h.chunks;
}

/// The message to peer r: the header, then `chunks` (the pass's) chunks of counts and rounds.
struct count_message {
  const index_t* send_counts;
  const index_t* send_valid;
  const index_t* send_offsets;
  const index_t* unique_counts;  // nullptr without dedup
  message_layout m;
  int chunks;
  index_t quota;  // 0: unbounded
  call_header h;
  index_t* out;                          // [R][per_peer]
  const index_t* node_counts = nullptr;  // hierarchical: [C*N]
  EPMOE_HD void operator()(index_t r) const {
    const int L = m.L, G = m.G, R = m.R;
    index_t* o = out + r * m.per_peer();
    write_header(o, h);
    for (int c = 0; c < chunks; ++c) {
      index_t* w = o + m.chunk_at(c);
      for (int j = 0; j < L; ++j) {
        const index_t b = (c * R + r) * L + j;
        w[j] = send_counts[b];
        w[L + j] = send_valid[b];
      }
      w[2 * L] = unique_counts ? unique_counts[c * R + r] : 0;
      if (G > 0) {
        const int n = static_cast<int>(r) / G;
        w[2 * L + 1] = node_counts[c * (R / G) + n];
        for (int g = 0; g < G; ++g) w[2 * L + 2 + g] = unique_counts[c * R + n * G + g];
      }
      index_t rounds = 1;
      for (int d = 0; quota > 0 && d < R; ++d) {
        const index_t n = send_offsets[(c * R + d + 1) * L] - send_offsets[(c * R + d) * L];
        rounds = rounds > (n + quota - 1) / quota ? rounds : (n + quota - 1) / quota;
      }
      o[m.rounds_at(c)] = rounds;
    }
  }
};

/// A message of the header alone (a call that moves no rows: reduce_gradients, ...).
struct header_message {
  message_layout m;
  call_header h;
  index_t* out;
  EPMOE_HD void operator()(index_t r) const { write_header(out + r * m.per_peer(), h); }
};

}  // namespace exchange_ops

namespace detail {
inline std::string call_text(const index_t* h) {
  std::string s = call_name(static_cast<call_kind>(h[1]));
  s += " of pass ";
  s += std::to_string(h[2]);
  if (h[3] > 0) s += " with " + std::to_string(h[3]) + " chunks";
  return s;
}
}  // namespace detail

/// The verdict of the headers every rank received (`in`: R messages): when ranks make
/// different calls, every rank throws the same config_error naming them, e.g. "epmoe: call =
/// rank 0: forward of pass 3 with 2 chunks, rank 1: backward of pass 2 with 2 chunks: ...";
/// else the first rank that rejected its inputs, or -1.
inline int read_verdict(const index_t* in, const message_layout& m) {
  const index_t P = m.per_peer();
  for (int s = 1; s < m.R; ++s) {
    const index_t* a = in;
    const index_t* b = in + s * P;
    if (a[1] != b[1] || a[2] != b[2] || a[3] != b[3])
      throw config_error("call",
                         "rank 0: " + detail::call_text(a) + ", rank " + std::to_string(s) + ": " +
                             detail::call_text(b),
                         "every rank must make the same collective call, for the same pass and "
                         "with the same chunks; no rank wrote anything");
  }
  for (int s = 0; s < m.R; ++s)
    if (in[s * P] == 0) return s;
  return -1;
}

}  // namespace epmoe
