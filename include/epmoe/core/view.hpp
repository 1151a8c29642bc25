// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"

namespace epmoe {

using index_t = std::int64_t;

/// Non-owning row-major matrix: `rows` rows of `cols` elements, row i at data + i*stride.
template <class T>
struct matrix_view {
  T* data = nullptr;
  index_t rows = 0;
  index_t cols = 0;
  index_t stride = 0;  // elements between the starts of two rows (>= cols)

  constexpr matrix_view() = default;
  constexpr matrix_view(T* d, index_t r, index_t c) : data(d), rows(r), cols(c), stride(c) {}
  constexpr matrix_view(T* d, index_t r, index_t c, index_t s)
      : data(d), rows(r), cols(c), stride(s) {}
  // A view of T converts to a view of const T, like a pointer does.
  template <class U>
  requires(!std::is_same_v<U, T> &&
           std::is_convertible_v<U*, T*>) constexpr matrix_view(const matrix_view<U>& o)
      : data(o.data), rows(o.rows), cols(o.cols), stride(o.stride) {}

  EPMOE_HD T* row(index_t i) const { return data + i * stride; }
  EPMOE_HD T& operator()(index_t i, index_t j) const { return data[i * stride + j]; }
  /// Rows [begin, begin + count).
  EPMOE_HD matrix_view rows_slice(index_t begin, index_t count) const {
    return {data + begin * stride, count, cols, stride};
  }
};

/// Non-owning stack of equally shaped matrices (e.g. the weights of the local experts):
/// matrix i is at data + i*batch_stride, each [rows, cols] with row stride `stride`.
template <class T>
struct stacked_view {
  T* data = nullptr;
  index_t count = 0;
  index_t rows = 0;
  index_t cols = 0;
  index_t stride = 0;
  index_t batch_stride = 0;

  constexpr stacked_view() = default;
  constexpr stacked_view(T* d, index_t n, index_t r, index_t c)
      : data(d), count(n), rows(r), cols(c), stride(c), batch_stride(r * c) {}
  constexpr stacked_view(T* d, index_t n, index_t r, index_t c, index_t s, index_t bs)
      : data(d), count(n), rows(r), cols(c), stride(s), batch_stride(bs) {}
  template <class U>
  requires(!std::is_same_v<U, T> &&
           std::is_convertible_v<U*, T*>) constexpr stacked_view(const stacked_view<U>& o)
      : data(o.data),
        count(o.count),
        rows(o.rows),
        cols(o.cols),
        stride(o.stride),
        batch_stride(o.batch_stride) {}

  EPMOE_HD matrix_view<T> operator[](index_t i) const {
    return {data + i * batch_stride, rows, cols, stride};
  }
  /// Matrices [first, first + n).
  EPMOE_HD stacked_view slice(index_t first, index_t n) const {
    return {data + first * batch_stride, n, rows, cols, stride, batch_stride};
  }
};

/// Rows in consecutive groups (the rows of each local expert, expert-major): group g is rows
/// [offsets[g], offsets[g+1]) - offsets[0] from `data` (offsets may start past 0: a unit's
/// slice of an expert buffer). `offsets` is host memory (the host sizes each group's GEMM);
/// `device_offsets` the same in the space's memory (equal on the host), for kernels that find
/// their group themselves.
template <class T>
struct grouped_rows {
  T* data = nullptr;
  index_t cols = 0;
  index_t stride = 0;
  int groups = 0;
  const index_t* offsets = nullptr;         // [groups + 1], host
  const index_t* device_offsets = nullptr;  // [groups + 1], the space's memory
  index_t align = 1;  // rows of matrices over() makes start at multiples of align elements

  index_t rows() const { return groups > 0 ? offsets[groups] - offsets[0] : 0; }
  /// Group g as a matrix.
  matrix_view<T> group(int g) const {
    return {data + (offsets[g] - offsets[0]) * stride, offsets[g + 1] - offsets[g], cols, stride};
  }
  /// The same groups over another matrix of the same rows with c columns (e.g. an expert's
  /// hidden layer), its row stride c rounded up to the alignment.
  template <class U>
  grouped_rows<U> over(U* d, index_t c) const {
    return {d, c, (c + align - 1) / align * align, groups, offsets, device_offsets, align};
  }
  /// Elements a matrix of these rows with c columns takes (what over() lays out).
  index_t elements(index_t c) const { return rows() * ((c + align - 1) / align * align); }
  template <class U = T>
  requires(!std::is_const_v<U>) operator grouped_rows<const U>() const {
    return {data, cols, stride, groups, offsets, device_offsets, align};
  }
};

namespace space {
/// Every space's allocation, of its own buffer<T> and mirror<T> types (a space derives from
/// allocates<itself>): sized once, never during a pass.
template <class Space>
struct allocates {
  template <class T>
  auto allocate(index_t n) const {
    return typename Space::template buffer<T>(n);
  }
  template <class T>
  auto allocate_mirror(index_t n) const {
    return typename Space::template mirror<T>(n);
  }
};
}  // namespace space

namespace detail {
inline std::string shape_text(index_t r, index_t c) {
  // Appended piecewise: g++ 12 -O3 warns (-Wrestrict, falsely) on "[" + std::to_string(r).
  std::string s = "[";
  s += std::to_string(r);
  s += ',';
  s += std::to_string(c);
  s += ']';
  return s;
}

/// Checks a view's shape against [rows, cols] and that its stride and pointer are usable.
template <class T>
void require_shape(const matrix_view<T>& v, index_t rows, index_t cols, const char* field) {
  if (v.rows != rows || v.cols != cols)
    throw config_error(field, shape_text(v.rows, v.cols),
                       "shape must be " + shape_text(rows, cols) + " (row-major)");
  if (v.stride < v.cols)
    throw config_error(field, "stride " + std::to_string(v.stride),
                       "row stride must be >= cols (" + std::to_string(cols) + ")");
  if (v.data == nullptr && rows > 0 && cols > 0)
    throw config_error(field, "null", "data must point to rows*stride elements");
}

template <class T>
void require_shape(const stacked_view<T>& v, index_t count, index_t rows, index_t cols,
                   const char* field) {
  if (v.count != count || v.rows != rows || v.cols != cols)
    throw config_error(field, std::to_string(v.count) + " x " + shape_text(v.rows, v.cols),
                       "shape must be " + std::to_string(count) + " x " + shape_text(rows, cols) +
                           " (local experts x [rows, cols])");
  if (v.stride < v.cols || (count > 1 && v.batch_stride < v.rows * v.stride))
    throw config_error(field, "stride " + std::to_string(v.stride),
                       "row stride must be >= cols and batch stride >= rows*stride");
  if (v.data == nullptr && count > 0 && rows > 0 && cols > 0)
    throw config_error(field, "null", "data must point to the stacked matrices");
}
}  // namespace detail

}  // namespace epmoe
