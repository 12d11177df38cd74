// An mlx array's elements as a row-major buffer, for kernels that read plain pointers.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/backend/common/utils.h"

namespace gmlx_kernels {

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
