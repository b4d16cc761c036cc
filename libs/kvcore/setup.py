"""Builds kvcore's native extensions (C++/OpenMP) once, at install time.

The hot cache's extension is built against the installed torch (its ATen headers: a resolve creates
its output tensors in C++), so torch must be installed first and the build must see it
(``pip install --no-build-isolation``, as ``scripts/bootstrap`` and ``scripts/images`` run it); the
gather extension needs pybind11 only."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

_FLAGS = ["-O3", "-fopenmp", "-fno-strict-aliasing"]
_LINK = ["-fopenmp"]

setup(
    ext_modules=[
        CppExtension(
            "kvcore._native_hotcache",
            ["src/kvcore/native/hotcache.cpp"],
            extra_compile_args=[*_FLAGS, "-std=c++17", "-g0"],  # no debug info: torch's headers make it 12 MB
            extra_link_args=_LINK,
        ),
        Pybind11Extension(
            "kvcore._native_gather",
            ["src/kvcore/native/gather.cpp"],
            cxx_std=17,
            extra_compile_args=_FLAGS,
            extra_link_args=_LINK,
        ),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
