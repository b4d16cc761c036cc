"""Build of kvoffload-proto: generate the Python stubs from ``kvoffload/v1/*.proto`` first.

Every build (wheel, or ``pip install -e proto``) runs ``grpc_tools.protoc`` through
``kvoffload_proto.codegen`` and writes the stubs into ``src/kvoffload_proto/v1/`` (git-ignored),
from where the build copies them into the wheel or the editable install imports them.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _codegen():
    spec = importlib.util.spec_from_file_location("_kvoffload_codegen", HERE / "src/kvoffload_proto/codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """``build_py`` that generates the gRPC/protobuf stubs before collecting modules."""

    def run(self):
        for path in _codegen().generate(HERE / "kvoffload", HERE / "src"):
            self.announce(f"generated {path.relative_to(HERE)}", level=2)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
