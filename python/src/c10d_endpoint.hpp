// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The layer's endpoint over a torch.distributed process group (epmoe.torch.MoE's group=;
// docs/pytorch.md, "Ranks").

#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "epmoe/comm/any.hpp"
#include "epmoe/core/error.hpp"

namespace epmoe::py {

/// A torch.distributed process group as the layer's endpoint: each exchange is one
/// all-to-all of bytes on the group (gloo on CPU) over views of the layer's buffers. A copy
/// happens only when an exchange's non-empty blocks do not lie back to back in rank order
/// (the row rounds of a bounded receive buffer): then they are staged through buffers owned
/// here (grown once). Several may be in flight (a pipelined schedule).
///
/// Deadline and abort, as far as c10d allows: a wait gives up after the layer's
/// exchange_timeout (comm_timeout); abort() leaves this rank's reason in the store (when one
/// is given) under `abort_key`, where the peers' waits look for it and throw comm_aborted.
/// c10d cannot cancel a started collective: one given up stays in torch's worker, and may
/// still write the layer's buffers when a late peer arrives (still_running()), and this
/// endpoint refuses every later exchange (the group's calls no longer pair up).
/// One all-to-all of bytes: newer torch renamed ProcessGroup::alltoall_base
/// all_to_all_single (and deprecates the old name); the one this torch has.
template <class Group>
c10::intrusive_ptr<c10d::Work> all_to_all_bytes(Group& pg, at::Tensor& out, at::Tensor& in,
                                                std::vector<std::int64_t>& recv_split,
                                                std::vector<std::int64_t>& send_split) {
  if constexpr (requires { pg.all_to_all_single(out, in, recv_split, send_split); })
    return pg.all_to_all_single(out, in, recv_split, send_split);
  else
    return pg.alltoall_base(out, in, recv_split, send_split);
}

class c10d_endpoint final : public comm::endpoint {
 public:
  c10d_endpoint(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                c10::intrusive_ptr<c10d::Store> store = {}, std::string abort_key = {})
      : pg_(std::move(pg)),
        store_(std::move(store)),
        key_(std::move(abort_key)),
        rank_(pg_->getRank()),
        size_(pg_->getSize()),
        slots_(8) {
    if (key_.empty()) store_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void set_timeout(double seconds) override { timeout_ = seconds; }

  void alltoallv(const std::byte* send, const index_t* sc, const index_t* sd, std::byte* recv,
                 const index_t* rc, const index_t* rd) override {
    wait(start(send, sc, sd, recv, rc, rd));
  }

  int start(const std::byte* send, const index_t* sc, const index_t* sd, std::byte* recv,
            const index_t* rc, const index_t* rd) override {
    refuse_if_broken();
    std::size_t k = 0;
    while (k < slots_.size() && slots_[k].work) ++k;
    if (k == slots_.size())
      throw comm_error("epmoe: torch.distributed endpoint: more than " +
                       std::to_string(slots_.size()) + " exchanges in flight");
    slot& s = slots_[k];
    const auto R = static_cast<std::size_t>(size_);
    s.send_split.assign(sc, sc + R);
    s.recv_split.assign(rc, rc + R);
    const index_t sn = total(sc), rn = total(rc);
    const std::byte* in = send + std::max<index_t>(first(sc, sd), 0);
    ++copies_.exchanges;
    if (!back_to_back(sc, sd)) {  // pack the blocks in rank order
      ++copies_.sends;
      s.send_stage.resize(static_cast<std::size_t>(sn));
      index_t at = 0;
      for (std::size_t r = 0; r < R; ++r)
        std::copy_n(send + sd[r], sc[r], s.send_stage.data() + at), at += sc[r];
      in = s.send_stage.data();
    }
    s.unpack = !back_to_back(rc, rd);
    std::byte* out = recv + std::max<index_t>(first(rc, rd), 0);
    if (s.unpack) {
      ++copies_.receives;
      s.recv_stage.resize(static_cast<std::size_t>(rn));
      out = s.recv_stage.data();
      s.recv = recv, s.rc = rc, s.rd = rd;
    }
    const auto bytes = at::TensorOptions().dtype(at::kByte);
    at::Tensor tin = at::from_blob(const_cast<std::byte*>(in), {sn}, bytes);
    at::Tensor tout = at::from_blob(out, {rn}, bytes);
    try {
      s.work = all_to_all_bytes(*pg_, tout, tin, s.recv_split, s.send_split);
    } catch (const std::exception& e) {
      throw comm_error(std::string("epmoe: torch.distributed all-to-all failed: ") + e.what());
    }
    return static_cast<int>(k);
  }

  void wait(int ticket) override {
    slot& s = slots_[static_cast<std::size_t>(ticket)];
    c10::intrusive_ptr<c10d::Work> work = std::move(s.work);
    s.work.reset();
    if (!broken_.empty()) {  // aborted: a request's destructor must not block
      give_up(std::move(work));
      refuse_if_broken();
    }
    try {
      finish(work);
    } catch (const comm_error&) {
      throw;
    } catch (const std::exception& e) {
      throw comm_error(std::string("epmoe: torch.distributed all-to-all failed: ") + e.what());
    }
    if (s.unpack) {
      index_t at = 0;
      for (int r = 0; r < size_; ++r)
        std::copy_n(s.recv_stage.data() + at, s.rc[r], s.recv + s.rd[r]), at += s.rc[r];
    }
  }

  bool test(int ticket) override {
    const auto& work = slots_[static_cast<std::size_t>(ticket)].work;
    return !work || work->isCompleted();  // none: given up by abort(); wait() says so
  }

  /// This rank failed mid-pass: give up the exchanges in flight and leave the reason for the
  /// peers (the first one stays).
  void abort(const std::string& why) override {
    if (broken_.empty()) broken_ = why;
    for (slot& s : slots_) {
      give_up(std::move(s.work));
      s.work.reset();
    }
    if (!store_) return;
    const std::string text = std::to_string(rank_) + "\n" + why;
    try {
      store_->compareSet(key_, {}, std::vector<std::uint8_t>(text.begin(), text.end()));
    } catch (const std::exception&) {  // the peers then wait out their deadline
    }
  }

  /// Whether an exchange given up may still run in torch's worker (and write the buffers it
  /// was handed).
  bool still_running() const {
    for (const auto& w : given_up_)
      if (!w->isCompleted()) return true;
    return false;
  }

  /// Exchanges started, and those staged through a copy (send side, receive side).
  struct copy_counts {
    std::int64_t exchanges = 0, sends = 0, receives = 0;
  };
  const copy_counts& copies() const { return copies_; }

 private:
  struct slot {
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<std::int64_t> send_split, recv_split;
    std::vector<std::byte> send_stage, recv_stage;
    bool unpack = false;
    std::byte* recv = nullptr;
    const index_t *rc = nullptr, *rd = nullptr;
  };
  using clock = std::chrono::steady_clock;

  // Waits for work: at once without a deadline or a store; else in slices, looking for a
  // peer's abort between them, until the deadline.
  void finish(const c10::intrusive_ptr<c10d::Work>& work) {
    if (timeout_ <= 0 && !store_) {
      work->wait();
      return;
    }
    const clock::time_point begin = clock::now();
    const auto limit = std::chrono::duration<double>(timeout_);
    std::chrono::milliseconds slice(20);  // most exchanges end in the first
    for (;;) {
      auto step = slice;
      if (timeout_ > 0)
        step = std::min(
            step, std::chrono::ceil<std::chrono::milliseconds>(limit - (clock::now() - begin)));
      if (waited(work, std::max(step, std::chrono::milliseconds(1)))) return;
      slice = std::chrono::milliseconds(100);
      if (std::string why; peer_aborted(why)) {
        broken_ = why;
        give_up(work);
        throw comm_aborted(why, origin_);
      }
      if (timeout_ > 0 && clock::now() - begin >= limit) {
        std::string why =
            "epmoe: torch.distributed all-to-all: no answer from the group's "
            "peers within " +
            seconds(timeout_) +
            " s (exchange_timeout): a peer stalled, crashed or never made this "
            "call";
        broken_ = why;
        give_up(work);
        throw comm_timeout(why);
      }
    }
  }
  // Whether work completed within `step` (rethrows its own error). Work::wait(timeout) throws
  // on a timeout too: only a completed work's throw is its error.
  static bool waited(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds step) {
    try {
      work->wait(step);
      return true;
    } catch (...) {
      if (!work->isCompleted()) return false;
    }
    work->wait();
    return true;
  }
  // A peer's abort() reason, when the store holds one.
  bool peer_aborted(std::string& why) {
    if (!store_) return false;
    try {
      if (!store_->check({key_})) return false;
      const std::vector<std::uint8_t> v = store_->get(key_);
      const std::string text(v.begin(), v.end());
      const std::size_t nl = text.find('\n');
      origin_ = nl == std::string::npos ? -1 : std::atoi(text.substr(0, nl).c_str());
      why = "epmoe: torch.distributed peer rank " + std::to_string(origin_) +
            " failed: " + (nl == std::string::npos ? text : text.substr(nl + 1));
      return true;
    } catch (const std::exception&) {  // no store: the deadline alone bounds the wait
      return false;
    }
  }
  void give_up(c10::intrusive_ptr<c10d::Work> work) {
    if (work && !work->isCompleted()) given_up_.push_back(std::move(work));
  }
  void refuse_if_broken() const {
    if (!broken_.empty())
      throw comm_aborted("epmoe: torch.distributed endpoint: an exchange was given up (" + broken_ +
                             "); the group's calls no longer pair up: build a new module",
                         origin_);
  }
  static std::string seconds(double s) {
    std::string t = std::to_string(s);
    t.erase(t.find_last_not_of('0') + 1);
    if (t.back() == '.') t.pop_back();
    return t;
  }
  index_t total(const index_t* n) const {
    index_t t = 0;
    for (int r = 0; r < size_; ++r) t += n[r];
    return t;
  }
  // The first byte of the first non-empty block (alltoall_base's buffer when they lie back to
  // back), or -1 when every block is empty.
  index_t first(const index_t* n, const index_t* d) const {
    for (int r = 0; r < size_; ++r)
      if (n[r] > 0) return d[r];
    return -1;
  }
  // Whether the non-empty blocks lie back to back in rank order: the layer's own rows skip
  // the exchange (count 0) where they lie, and must not force a copy.
  bool back_to_back(const index_t* n, const index_t* d) const {
    index_t end = -1;
    for (int r = 0; r < size_; ++r) {
      if (n[r] == 0) continue;
      if (end >= 0 && d[r] != end) return false;
      end = d[r] + n[r];
    }
    return true;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Store> store_;  // where abort() leaves its reason (or none)
  std::string key_;
  int rank_, size_;
  double timeout_ = 0;  // seconds a wait may take (0: no deadline)
  std::string broken_;  // why an exchange was given up
  int origin_ = -1;     // the rank whose abort ended it, when known
  std::vector<slot> slots_;
  std::vector<c10::intrusive_ptr<c10d::Work>> given_up_;
  copy_counts copies_;
};

}  // namespace epmoe::py
