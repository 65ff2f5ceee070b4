"""Build hook: generate the gRPC stubs from ../../proto before packaging.

Everything else about the package is declared in pyproject.toml.
"""

import pathlib
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self):
        sys.path.insert(0, str(HERE))
        import gen_proto

        stubs = gen_proto.OUT / "idempotency_pb2.py"
        if (gen_proto.PROTO_ROOT / gen_proto.PROTO_FILE).is_file():
            gen_proto.generate()
        elif not stubs.is_file():
            # Built outside the repository (from an sdist without stubs).
            raise SystemExit("idempotency-client: no proto/ to generate the stubs from")
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
