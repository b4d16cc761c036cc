"""Builds kvcore's native extensions (C++/OpenMP) once, at install time."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

_FLAGS = ["-O3", "-fopenmp", "-fno-strict-aliasing"]


def _ext(name: str, source: str) -> Pybind11Extension:
    return Pybind11Extension(
        f"kvcore._native_{name}",
        [f"src/kvcore/native/{source}"],
        cxx_std=17,
        extra_compile_args=_FLAGS,
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_ext("hotcache", "hotcache.cpp"), _ext("gather", "gather.cpp")],
    cmdclass={"build_ext": build_ext},
)
