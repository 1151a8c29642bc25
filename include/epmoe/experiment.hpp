// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// epmoe::experiment: several policy bundles through the same tokens, weights and ranks, one
// table. Each bundle is a compile-time type; the experiment swaps in the ranks' comm, runs
// a warm-up pass and `passes` timed ones, and sets each bundle's counts, error against the
// float64 reference and the simulator's prediction for a cluster beside its measured times:
//
//   using strategies = experiment::list<
//       experiment::bundle<"mixtral top-2", mixtral>,
//       experiment::bundle<"balanced +4", replicated, {.from_load = true, .extra_slots = 4}>>;
//   const auto in = experiment::inputs::skewed(cfg, /*seed*/ 1, /*hot expert*/ 0, 2.0);
//   const auto table = experiment::run(strategies{}, experiment::thread_ranks{4}, in, {});
//   experiment::print(std::cout, table);

#include "epmoe/experiment/bundle.hpp"
#include "epmoe/experiment/inputs.hpp"
#include "epmoe/experiment/ranks.hpp"
#include "epmoe/experiment/run.hpp"
#include "epmoe/experiment/table.hpp"
