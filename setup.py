"""Builds gmlx's native parts at install: the few-row sgemm interposer
(native/gemm_interposer.c) and the CPU decode kernels (native/mlx_cpu_kernels, an MLX
extension built with CMake against the mlx wheel's headers and nanobind).

Metadata lives in setup.cfg. The interposer is a plain shared library loaded with
ctypes (not a Python extension), written to gmlx/platform/_gemm_interposer.so. It is
Linux-only and optional: without a C compiler the install still succeeds and
gmlx.platform.blas reports the interposer as not built. The kernels are optional too:
when CMake, nanobind or mlx is missing or the build fails, gmlx runs on pure MLX.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

INTERPOSER = "gmlx.platform._gemm_interposer"
CPU_KERNELS = "gmlx.platform._cpu_kernels"


class CMakeExtension(Extension):
    """An extension CMake builds from a source folder (no sources for setuptools)."""

    def __init__(self, name: str, source_dir: str):
        super().__init__(name, sources=[], optional=True)
        self.source_dir = str(Path(source_dir).resolve())


def build_with_cmake(ext: CMakeExtension, output_path: str, build_temp: str) -> None:
    build_dir = Path(build_temp) / ext.name
    build_dir.mkdir(parents=True, exist_ok=True)
    configure = [
        "cmake", ext.source_dir, f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
        f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={Path(output_path).resolve().parent}",
    ]
    subprocess.run(configure, cwd=build_dir, check=True)
    subprocess.run(["cmake", "--build", ".", "-j", str(os.cpu_count() or 1)], cwd=build_dir, check=True)


class BuildInterposer(build_ext):
    def get_ext_filename(self, fullname):
        # A plain .so, without the CPython ABI tag; distutils asks with the full
        # dotted name or with its last part only.
        if fullname in (INTERPOSER, INTERPOSER.rsplit(".", 1)[1]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext):
        return ext.export_symbols  # no PyInit_* function to export

    def build_extension(self, ext):
        try:
            if isinstance(ext, CMakeExtension):
                build_with_cmake(ext, self.get_ext_fullpath(ext.name), self.build_temp)
            else:
                super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any build failure leaves it optional
            print(f"warning: not building {ext.name} ({exc}); gmlx works without it", file=sys.stderr)


ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            INTERPOSER,
            sources=["native/gemm_interposer.c"],
            # A compiler-fused multiply-add would break bit-identity with sgemm.
            extra_compile_args=["-O2", "-ffp-contract=off", "-std=gnu11"],
            libraries=["dl", "m", "pthread"],
            optional=True,
        )
    )
    ext_modules.append(CMakeExtension(CPU_KERNELS, "native/mlx_cpu_kernels"))

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildInterposer})
