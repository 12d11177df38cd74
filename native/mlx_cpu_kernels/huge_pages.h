// Linux's transparent huge pages for the kernels' own buffers, as gmlx/platform/memory.py asks
// them for the weights: a pass over a buffer on 4 KB pages pays a TLB miss every 4 KB.
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace gmlx_kernels {

constexpr int64_t kHugePageBytes = 2 << 20;

// Asks for 2 MB pages under the whole huge pages of [data, data + num_bytes): advice, so memory not
// yet touched faults in huge (4 KB pages where Linux refuses). Whole ones only: advising a packed
// matrix's partial last one left the 1B file's process with 990 MB of huge pages against 1190, the
// later collapse (memory.py) moving less. Nothing off Linux.
inline void advise_huge_pages(void* data, int64_t num_bytes) {
#if defined(__linux__)
  const auto address = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (address + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const uintptr_t end = (address + num_bytes) / kHugePageBytes * kHugePageBytes;
  if (first < end) madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE);
#else
  (void)data, (void)num_bytes;
#endif
}

}  // namespace gmlx_kernels
