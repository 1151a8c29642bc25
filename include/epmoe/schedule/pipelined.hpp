// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

namespace epmoe::schedule {

/// Tutel/FasterMoE-style overlap: the pass is cut into C chunks of tokens (C = Chunks, or
/// config chunks / layer.set_chunks at run time); while chunk i's experts compute, chunk
/// i+1's dispatch and chunk i-1's combine are in flight, and the shared experts run while the
/// first dispatch is. Written against the comm's start/wait (ialltoallv), not one backend:
/// threads, MPI (MPI_Ialltoallv, progressed between expert GEMMs) and, later, CUDA streams.
template <int Chunks = 4>
struct pipelined {
  static_assert(Chunks >= 1, "schedule::pipelined<C>: C must be >= 1");
  static constexpr int default_chunks = Chunks;

  template <class Stages>
  static void run(Stages& s) {
    s.route();
    s.plan();
    s.permute();
    s.counts();
    const int C = s.chunks();
    s.dispatch_start(0);
    s.shared();  // home-rank work while the first dispatch is in flight
    for (int c = 0; c < C; ++c) {
      s.dispatch_wait(c);
      if (c + 1 < C) s.dispatch_start(c + 1);
      s.experts(c);
      s.combine_start(c);
      if (c > 0) s.combine_wait(c - 1);
    }
    s.combine_wait(C - 1);
    s.reduce();
  }
};

}  // namespace epmoe::schedule
