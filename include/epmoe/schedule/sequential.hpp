// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

namespace epmoe::schedule {

/// One stage after another, no overlap: the baseline every other schedule is compared to.
struct sequential {
  template <class Stages>
  static void run(Stages& s) {
    s.route();
    s.plan();
    s.permute();
    s.shared();  // home-rank work; a pipelined schedule overlaps it with dispatch
    s.dispatch();
    s.experts();
    s.combine();
    s.reduce();
  }
};

}  // namespace epmoe::schedule
