// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

namespace epmoe::schedule {

/// One stage after another, no overlap: the baseline every other schedule is compared to.
/// With config chunks > 1 the chunks run one after another, each exchange waited at once.
struct sequential {
  static constexpr int default_chunks = 1;
  static constexpr int units_in_flight = 1;  // each exchange waited before the next starts

  template <class Stages>
  static void run(Stages& s) {
    s.route();
    s.plan();
    s.permute();
    s.shared();
    s.counts();
    for (int c = 0; c < s.chunks(); ++c) {
      s.dispatch_start(c);
      s.dispatch_wait(c);
      s.experts(c);
      s.combine_start(c);
      s.combine_wait(c);
    }
    s.reduce();
  }
};

}  // namespace epmoe::schedule
