// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The host's checks in tests/layer/test_layer_backward{,_contracts}.cpp, on the GPU (their
// host-only parts are left out): the layer's backward on space::cuda<float> against
// reference::backward.
#define EPMOE_TEST_SPACES epmoe::space::cuda<float>
#define EPMOE_TEST_SPACES_ONLY_GENERIC
// The space's data movement first, then the host test file.
// clang-format off
#include "space_io.cuh"
#include "../layer/test_layer_backward.cpp"
#include "../layer/test_layer_backward_contracts.cpp"
// clang-format on
