// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// MPI itself for comm::mpi: element datatypes, error checks, the block unit that keeps counts
// in MPI's int, and mpi_session (a program's MPI start-up). Include only when linking
// epmoe::mpi (it brings <mpi.h> and the MPI library). The deprecated MPI C++ bindings are
// unused: skipping them saves compile time and warnings.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::comm {

namespace detail {

template <class T>
inline constexpr bool no_mpi_datatype = false;

/// The MPI datatype of one element of T.
template <class T>
MPI_Datatype mpi_datatype() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<U, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<U, std::int8_t>)
    return MPI_INT8_T;
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return MPI_UINT8_T;
  else if constexpr (std::is_same_v<U, std::int16_t>)
    return MPI_INT16_T;
  else if constexpr (std::is_same_v<U, std::uint16_t>)
    return MPI_UINT16_T;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return MPI_INT32_T;
  else if constexpr (std::is_same_v<U, std::uint32_t>)
    return MPI_UINT32_T;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return MPI_INT64_T;
  else if constexpr (std::is_same_v<U, std::uint64_t>)
    return MPI_UINT64_T;
  else if constexpr (std::is_same_v<U, std::byte>)
    return MPI_BYTE;
  else
    static_assert(no_mpi_datatype<T>,
                  "comm::mpi has no MPI datatype for this element type T (see the 'with T = ...' "
                  "line above); use float, double, std::byte or a fixed-width integer");
}

/// Throws comm_error naming the call, the code and MPI's text for it, unless code is success.
inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  throw comm_error(std::string("epmoe: comm::mpi: ") + call + " failed with code " +
                   std::to_string(code) + ": " + std::string(text, static_cast<std::size_t>(len)));
}

/// The unit (in elements) in which MPI is handed every value (counts and displacements) so
/// that each fits in MPI's int: 1 when all already fit under `limit`; otherwise the largest
/// divisor of their gcd that fits, used as a contiguous derived datatype. Throws comm_error
/// when no such unit exists; never truncates. `limit` is INT_MAX except in tests.
inline index_t mpi_block(std::initializer_list<std::span<const index_t>> arrays,
                         index_t limit = INT_MAX) {
  index_t largest = 0, g = 0;
  for (const auto& a : arrays)
    for (index_t v : a) {
      largest = std::max(largest, v < 0 ? -v : v);
      g = std::gcd(g, v);
    }
  if (largest <= limit) return 1;
  // Smallest m with m | g and g / m <= limit; past max_m the values in blocks overflow. The
  // search is bounded (a few ms): a gcd with no small cofactor is not worth more.
  const index_t first = (g + limit - 1) / limit;
  const index_t max_m = std::min(limit / (largest / g), first + (index_t{1} << 20));
  for (index_t m = first; m <= max_m; ++m)
    if (g % m == 0) return g / m;
  const std::string gcd = std::to_string(g);
  throw comm_error("epmoe: comm::mpi: a count or displacement of " + std::to_string(largest) +
                   " elements exceeds MPI's int range and the values share no common block (gcd " +
                   gcd + ") that brings them in range; split the exchange into smaller ones");
}

/// values[i] / block into out[i] (the caller got block from mpi_block).
inline void mpi_to_int(std::span<const index_t> values, index_t block, int* out) {
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = static_cast<int>(values[i] / block);
}

/// T itself, or a committed contiguous type of `block` T's; frees what it made.
template <class T>
class mpi_block_type {
 public:
  explicit mpi_block_type(index_t block) : type_(mpi_datatype<T>()) {
    if (block == 1) return;
    mpi_check(MPI_Type_contiguous(static_cast<int>(block), type_, &type_), "MPI_Type_contiguous");
    if (const int code = MPI_Type_commit(&type_); code != MPI_SUCCESS) {
      MPI_Type_free(&type_);  // the destructor will not run
      mpi_check(code, "MPI_Type_commit");
    }
    owned_ = true;
  }
  // A pending operation keeps a freed type alive (MPI standard), so this may run right
  // after posting a non-blocking exchange.
  ~mpi_block_type() {
    if (owned_) MPI_Type_free(&type_);
  }
  mpi_block_type(const mpi_block_type&) = delete;
  mpi_block_type& operator=(const mpi_block_type&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_;
  bool owned_ = false;
};

/// EPMOE_RANKS_PER_NODE as this process reads it: 0 when unset, else its value, or -1 when
/// that is not a positive integer dividing `size` (then `value` and `rule` say why).
inline int env_ranks_per_node(int size, std::string& value, std::string& rule) {
  const char* text = std::getenv("EPMOE_RANKS_PER_NODE");
  if (!text) return 0;
  value = text;
  rule = "must be a positive integer that divides the communicator's size (" +
         std::to_string(size) + " ranks): rank r then sits on node r / EPMOE_RANKS_PER_NODE";
  // Digits only, at most 9 of them: no sign, no spaces, no suffix, no int overflow.
  const bool digits = !value.empty() && value.size() <= 9 &&
                      value.find_first_not_of("0123456789") == std::string::npos;
  const int g = digits ? std::stoi(value) : 0;
  return g > 0 && size % g == 0 ? g : -1;
}

struct mpi_test_access;  // lets tests lower the int limit to exercise the derived-type path

}  // namespace detail

/// RAII MPI start-up for programs and tests: MPI_Init_thread unless MPI is already
/// initialised, and MPI_Finalize at the end only if this object initialised it. The
/// library itself never initialises MPI; a program that does so itself needs no session.
class mpi_session {
 public:
  /// `required`: the thread level (MPI_THREAD_FUNNELED: only the main thread calls MPI).
  mpi_session(int& argc, char**& argv, int required = MPI_THREAD_FUNNELED) {
    init(&argc, &argv, required);
  }
  explicit mpi_session(int required = MPI_THREAD_FUNNELED) { init(nullptr, nullptr, required); }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  ~mpi_session() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

  /// The thread level MPI provides.
  int thread_level() const { return provided_; }

 private:
  void init(int* argc, char*** argv, int required) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (initialized) {
      detail::mpi_check(MPI_Query_thread(&provided_), "MPI_Query_thread");
    } else {
      detail::mpi_check(MPI_Init_thread(argc, argv, required, &provided_), "MPI_Init_thread");
      owns_ = true;
    }
    if (provided_ < required) {
      if (owns_) MPI_Finalize();  // the destructor will not run
      throw comm_error("epmoe: mpi_session: MPI provides thread level " +
                       std::to_string(provided_) + ", below the " + std::to_string(required) +
                       " required");
    }
  }

  int provided_ = MPI_THREAD_SINGLE;
  bool owns_ = false;
};

}  // namespace epmoe::comm
