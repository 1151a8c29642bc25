// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Process-wide settings a measuring program's main() may choose (never the library: it has
// no global state).
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace epmoe::programs {

/// Maps every buffer of 128 KiB or more fresh from the OS (glibc; a no-op elsewhere). glibc
/// otherwise raises its mapping threshold once such a buffer is freed and serves the next
/// round's probe and layer buffers from reused heap memory, where the regroup probe's row
/// copies measured 4x slower on the development VM than in fresh mappings: one round's rates
/// would not predict the next round's passes.
inline void map_large_buffers_fresh() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
#endif
}

}  // namespace epmoe::programs
