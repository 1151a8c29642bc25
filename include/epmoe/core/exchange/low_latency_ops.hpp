// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The low-latency exchange's per-slot device functors and the types of its comm's memory
// (windows, slots), apart from the exchange (low_latency.hpp) that uses them.
#include <cstddef>
#include <cstring>
#include <utility>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

namespace exchange_ops {
/// Copies the counts message to peer r into the head of slot r (the head is whole rows of
/// the slot buffer's element type; memcpy keeps the index_t bits as they are).
template <class T>
struct slot_head {
  const index_t* msg;
  index_t per_peer;
  T* slots;
  index_t slot_elems;
  EPMOE_HD void operator()(index_t r) const {
    memcpy(slots + r * slot_elems, msg + r * per_peer,
           static_cast<std::size_t>(per_peer) * sizeof(index_t));
  }
};
/// Block b's first row in the slots (chunk 0: b = r * L + j): peer r's slot, past its head,
/// at the block's offset among the rows to r. Computed where the plan is: on a device the
/// host's copy of the send offsets lands only at the next synchronisation.
struct slot_rows_of {
  const index_t* send_offsets;
  index_t local_experts, slot_rows, head_rows;
  index_t* at;
  EPMOE_HD void operator()(index_t b) const {
    const index_t r = b / local_experts;
    at[b] = r * slot_rows + head_rows + send_offsets[b] - send_offsets[r * local_experts];
  }
};
}  // namespace exchange_ops

namespace detail {
template <class Comm, bool Puts>
struct window_of {
  using type = char;  // none
};
template <class Comm>
struct window_of<Comm, true> {
  using type = typename Comm::window;
};
template <class Comm, bool Slots>
struct slots_of {
  using type = char;  // none
};
template <class Comm>
struct slots_of<Comm, true> {
  using type = decltype(std::declval<Comm&>().open_slots(std::size_t{}));
};
}  // namespace detail

}  // namespace epmoe
