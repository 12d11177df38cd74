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
// The int8 tiles of many rows on AMX (int8_tiles.cpp): compilers from GCC 11 and Clang 12 know
// its instructions; older ones build without that path.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define GMLX_HAS_AMX_BUILD 1
#define GMLX_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif
#endif
