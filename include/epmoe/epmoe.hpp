// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Umbrella header: the host parts of epmoe. CUDA parts live under epmoe/cuda/ (.cuh) and
// are included only by CUDA builds.

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/capacity/factor.hpp"
#include "epmoe/comm/local.hpp"
#include "epmoe/comm/threads.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/moe_layer.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/schedule/sequential.hpp"
#include "epmoe/space/host.hpp"
