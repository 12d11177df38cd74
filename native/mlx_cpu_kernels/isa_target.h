// The x86 function attributes the kernels compile their AVX2 and AVX-512 variants with: one
// spelling for every kernel file, so all variants target the same instruction sets.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#define GMLX_X86 1
#define GMLX_AVX2 __attribute__((target("avx2,fma")))
#define GMLX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
// The int8-activation kernels' dot products (vpdpbusd); chosen only where the CPU has VNNI.
#define GMLX_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#endif
