// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/core/agreement.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/placement/table.hpp"

namespace epmoe::placement {

/// Moves expert weights for a switch from table `now` to table `next` (same experts, ranks
/// and slots per rank; the same `next` on every rank, checked first). Every slot whose expert
/// changes receives that expert's weights from its first holder under `now`, through one
/// all-to-all-v; only changed slots move. `tensors` are this rank's stacked weights (each
/// [slots per rank, rows, cols]), read from and written into: the send side is packed
/// before anything is overwritten and the receive side lands in staging, so a failure leaves
/// the old weights. Collective. Returns the bytes this rank's slots received.
template <class Comm, class T, std::size_t N>
index_t relocate(Comm& comm, const table& now, const table& next,
                 const std::array<stacked_view<T>, N>& tensors) {
  const int R = now.ranks(), S = now.slots_per_rank(), me = comm.rank();
  detail::require(
      next.experts() == now.experts() && next.ranks() == R && next.slots_per_rank() == S,
      "placement", next.slots(), "the new table must keep experts, ranks and slots per rank");
  std::uint64_t h = 0;  // unsigned: the hash wraps (signed overflow would be UB)
  for (int p : next.phy_to_log()) h = h * 1000003u + static_cast<std::uint64_t>(p + 1);
  const agreement_field same[] = {{"placement (the new table)", static_cast<std::int64_t>(h)}};
  agree_on(comm, std::span<const agreement_field>(same));

  index_t slot_elements = 0;
  for (const auto& v : tensors) slot_elements += v.rows * v.cols;
  // Every move (dest slot <- a current holder of its new expert), known to every rank and in
  // slot order, so each sender and receiver pack and unpack the same sequence.
  struct move {
    int dst, src;
  };
  std::vector<move> moves;
  for (int p = 0; p < next.slots(); ++p) {
    const int e = next.phy_to_log()[p];
    if (now.phy_to_log()[p] != e) moves.push_back({p, now.log_to_phy()[e * now.max_copies()]});
  }
  std::vector<index_t> sn(R, 0), sd(R, 0), rn(R, 0), rd(R, 0);
  for (const move& m : moves) {
    if (m.src / S == me) sn[m.dst / S] += slot_elements;
    if (m.dst / S == me) rn[m.src / S] += slot_elements;
  }
  for (int r = 1; r < R; ++r) {
    sd[r] = sd[r - 1] + sn[r - 1];
    rd[r] = rd[r - 1] + rn[r - 1];
  }
  std::vector<T> send(static_cast<std::size_t>(sd[R - 1] + sn[R - 1]));
  std::vector<T> recv(static_cast<std::size_t>(rd[R - 1] + rn[R - 1]));
  std::vector<index_t> at = sd;
  for (const move& m : moves)
    if (m.src / S == me)
      for (const auto& v : tensors)
        for (index_t i = 0; i < v.rows; ++i) {
          std::copy_n(v[m.src % S].row(i), v.cols, send.data() + at[m.dst / S]);
          at[m.dst / S] += v.cols;
        }
  comm.alltoallv(send.data(), sn.data(), sd.data(), recv.data(), rn.data(), rd.data());
  at = rd;
  index_t received = 0;
  for (const move& m : moves)
    if (m.dst / S == me) {
      for (const auto& v : tensors)
        for (index_t i = 0; i < v.rows; ++i) {
          std::copy_n(recv.data() + at[m.src / S], v.cols, v[m.dst % S].row(i));
          at[m.src / S] += v.cols;
        }
      received += slot_elements * static_cast<index_t>(sizeof(T));
    }
  return received;
}

}  // namespace epmoe::placement
