// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// A host space that fails on purpose inside the routed experts' GEMMs of a pass (issue 23):
// it throws, stalls, or ends the process as a crash would, once, on the rank given it.
#pragma once

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include <epmoe/space/host.hpp>

namespace epmoe::test {

struct faulty_host : space::host {
  // throws, stalls, exits: in the routed experts' GEMMs (mid-pass); gate_throws: in the gate's
  // GEMM (the route stage, before the pass's first exchange).
  enum class fault { none, throws, stalls, exits, gate_throws };
  fault what = fault::none;
  double stall_seconds = 0;

  faulty_host() = default;
  faulty_host(fault f, double seconds = 0) : what(f), stall_seconds(seconds) {}

  void grouped_gemm_nt(grouped_rows<const float> a, stacked_view<const float> b,
                       grouped_rows<float> c) const {
    if (what != fault::none && what != fault::gate_throws && !struck_ && a.rows() > 0) {
      struck_ = true;
      if (what == fault::throws) throw std::runtime_error("injected: an expert GEMM failed");
      if (what == fault::exits) std::_Exit(9);  // no unwinding, no MPI_Finalize: a crash
      std::this_thread::sleep_for(std::chrono::duration<double>(stall_seconds));
    }
    host::grouped_gemm_nt(a, b, c);
  }
  void gemm_nt(matrix_view<const float> a, matrix_view<const float> b, matrix_view<float> c) const {
    if (what == fault::gate_throws && !struck_) {
      struck_ = true;
      throw std::runtime_error("injected: the gate's GEMM failed");
    }
    host::gemm_nt(a, b, c);
  }

 private:
  mutable bool struck_ = false;
};

}  // namespace epmoe::test
