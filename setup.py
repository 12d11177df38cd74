"""Builds gmlx's one-row sgemm interposer (native/gemm_interposer.c) at install.

Metadata lives in setup.cfg. The interposer is a plain shared library loaded with
ctypes (not a Python extension), written to gmlx/platform/_gemm_interposer.so. It is
Linux-only and optional: without a C compiler the install still succeeds and
gmlx.platform.blas reports the interposer as not built.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

INTERPOSER = "gmlx.platform._gemm_interposer"


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
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any build failure leaves it optional
            print(f"warning: not building the few-row sgemm interposer ({exc}); gmlx works without it", file=sys.stderr)


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

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildInterposer})
