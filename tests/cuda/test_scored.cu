// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The host's checks in tests/layer/test_layer_scored.cpp (the scored routers of transformers
// 5.23's families), on the GPU (its host-only parts are left out).
#define EPMOE_TEST_SPACES epmoe::space::cuda<float>
#define EPMOE_TEST_SPACES_ONLY_GENERIC
// The space's data movement first, then the host test file.
// clang-format off
#include "space_io.cuh"
#include "../layer/test_layer_scored.cpp"
// clang-format on
