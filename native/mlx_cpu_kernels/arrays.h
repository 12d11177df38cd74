// An mlx array as the kernel ops take it (one dtype) and read it (a row-major buffer).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"

namespace gmlx_kernels {

// a itself when it has the dtype, else a cast node on stream s.
inline mlx::core::array as_dtype(const mlx::core::array& a, mlx::core::Dtype dtype, mlx::core::Stream s) {
  return a.dtype() == dtype ? a : mlx::core::astype(a, dtype, s);
}

// The stride between rows' entries of an offset that is a scalar or one per row (0: one for all).
inline int64_t per_row_stride(const mlx::core::array& offset) {
  return offset.ndim() == 1 && offset.size() > 1 ? offset.strides(0) : 0;
}

// Its own data when already row-major (the common case), else a row-major copy in `copy`.
template <typename T>
const T* row_major_data(const mlx::core::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) return a.data<T>();
  copy.resize(a.size());
  const T* src = a.data<T>();
  for (size_t i = 0; i < a.size(); ++i) copy[i] = src[mlx::core::elem_to_loc(i, a.shape(), a.strides())];
  return copy.data();
}

}  // namespace gmlx_kernels
