// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Umbrella header: every host part of epmoe — the layer and every policy (router, placement
// and balancer, capacity, comm, expert, schedule, space), the router entry point, stats and
// run reports. Not here: comm/mpi.hpp (needs MPI: link epmoe::mpi), the simulator (sim/), the
// test references (reference/), and the CUDA parts (.cuh, CUDA builds only).

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/capacity/factor.hpp"
#include "epmoe/comm/local.hpp"
#include "epmoe/comm/threads.hpp"
#include "epmoe/comm/throttled.hpp"
#include "epmoe/core/agreement.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/report.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/topk.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/moe_layer.hpp"
#include "epmoe/placement/balancer.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/placement/relocate.hpp"
#include "epmoe/placement/round_robin.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/router/expert_choice.hpp"
#include "epmoe/router/hash.hpp"
#include "epmoe/router/jitter.hpp"
#include "epmoe/router/noisy_topk.hpp"
#include "epmoe/router/route.hpp"
#include "epmoe/router/sigmoid_bias.hpp"
#include "epmoe/router/sinkhorn.hpp"
#include "epmoe/router/sparsemixer.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/schedule/pipelined.hpp"
#include "epmoe/schedule/sequential.hpp"
#include "epmoe/space/host.hpp"
#include "epmoe/space/host_gemm.hpp"
