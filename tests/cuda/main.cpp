// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Catch2's main for the CUDA tests. Listing the tests (CTest's discovery at build time) works
// anywhere, so CI sees each test by name. Running them: without a GPU on the machine every
// test exits 77, which CTest reports as skipped (SKIP_RETURN_CODE); on a machine with a GPU a
// CUDA error fails (with no driver cudaGetDeviceCount returns an error, not zero devices, so
// the error alone cannot tell "no GPU" from "a broken one").
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "skip.hpp"

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strncmp(argv[i], "--list", 6) == 0;
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (!listing && (e != cudaSuccess || devices == 0))
    return epmoe::test::no_usable_gpu("epmoe CUDA tests",
                                      e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  return Catch::Session().run(argc, argv);
}
