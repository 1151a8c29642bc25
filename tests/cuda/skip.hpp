// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// When a CUDA test may skip: only where the machine has no NVIDIA GPU. A CUDA error on a
// machine that has one (a broken driver, a wrong arch, no device visible to the process) is a
// failure, not a skip, or CI would report a broken GPU build as "skipped". Host code only.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace epmoe::test {

/// CTest's skip code (SKIP_RETURN_CODE) for the CUDA tests.
inline constexpr int skip_code = 77;

/// True when the machine has an NVIDIA GPU whatever the CUDA runtime says: the driver's
/// device node exists, or `nvidia-smi -L` lists one.
inline bool gpu_present() {
  std::error_code ec;
  if (std::filesystem::exists("/dev/nvidia0", ec)) return true;
  FILE* p = popen("nvidia-smi -L 2>/dev/null", "r");
  if (!p) return false;
  char line[512];
  bool listed = false;
  while (std::fgets(line, sizeof line, p)) listed |= std::strncmp(line, "GPU ", 4) == 0;
  pclose(p);
  return listed;
}

/// The exit code of a test that found no usable GPU (`why`: the CUDA error or "0 devices"):
/// skip where the machine has none, fail where it has one.
inline int no_usable_gpu(const char* test, const char* why) {
  if (gpu_present()) {
    std::fprintf(stderr, "%s: FAILED: the machine has a GPU but CUDA cannot use it (%s)\n", test,
                 why);
    return 1;
  }
  std::fprintf(stderr, "%s: no GPU on this machine (%s): skipped\n", test, why);
  return skip_code;
}

}  // namespace epmoe::test
