// The x86 function attributes the kernels compile their AVX2 and AVX-512 variants with: one
// spelling for every kernel file, so all variants target the same instruction sets.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#define GMLX_X86 1
#define GMLX_AVX2 __attribute__((target("avx2,fma")))
#define GMLX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
// The int8-activation kernels: dot products with vpdpbusd (chosen only where the CPU has VNNI),
// half-precision scales converted with F16C (every AVX2 CPU has it; checked at dispatch).
#define GMLX_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define GMLX_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#endif
