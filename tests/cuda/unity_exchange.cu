// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The exchange's checks on cuda<float>.
// One unit for several test files: each parses the layer's headers and the CUDA front end once
// (about 15 s of a file's 20 s; the test files keep their names in a namespace each).
// The order the unit was built and run in:
// clang-format off
#include "test_bounded.cu"
#include "test_dedup.cu"
#include "test_pipelined.cu"
#include "test_placement.cu"
#include "test_passes.cu"
#include "test_models.cu"
#include "test_decode.cu"
// clang-format on
