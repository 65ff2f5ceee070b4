"""Generate the gRPC stubs of idempotency.v1 from the repository's proto/.

The stubs are build output, never committed: the proto file is the contract,
and stubs generated from it by the pinned grpcio-tools cannot drift from it.
setup-venv.sh runs this script, and setup.py runs it before setuptools lists
the package's files, so `pip install ./clients/python` works from a fresh
checkout too, and an sdist carries the stubs it was made with.

    python gen_proto.py            # writes src/idempotency_client/_proto/

protoc writes `from idempotency.v1 import idempotency_pb2` into the service
module, an import that only works with the output directory on sys.path. We
rewrite it to a relative import so the stubs live inside our package, while the
descriptor keeps the proto's own file name (idempotency/v1/idempotency.proto),
so stubs generated elsewhere in the same process do not conflict with ours.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
PROTO_FILE = "idempotency/v1/idempotency.proto"
OUT = HERE / "src" / "idempotency_client" / "_proto"

#: What generate() writes into OUT (and nothing else).
GENERATED = ("__init__.py", "idempotency_pb2.py", "idempotency_pb2.pyi", "idempotency_pb2_grpc.py")

_ABSOLUTE_IMPORT = re.compile(r"^from idempotency\.v1 import idempotency_pb2 as ", re.M)


def generate(proto_root: pathlib.Path = PROTO_ROOT, out: pathlib.Path = OUT) -> None:
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit(
            "gen_proto: grpcio-tools is missing (the build requirement in pyproject.toml); "
            "pip installs it unless --no-build-isolation is given"
        ) from None
    import importlib.resources

    if not (proto_root / PROTO_FILE).is_file():
        raise SystemExit(f"gen_proto: {proto_root / PROTO_FILE} not found")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{proto_root}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(proto_root / PROTO_FILE),
            ]
        )
        if status != 0:
            raise SystemExit(f"gen_proto: protoc failed with status {status}")
        generated = pathlib.Path(tmp) / "idempotency" / "v1"
        service = generated / "idempotency_pb2_grpc.py"
        text, count = _ABSOLUTE_IMPORT.subn("from . import idempotency_pb2 as ", service.read_text())
        if count != 1:
            raise SystemExit("gen_proto: the generated service module's import changed shape")
        service.write_text(text)

        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name in ("idempotency_pb2.py", "idempotency_pb2.pyi", "idempotency_pb2_grpc.py"):
            shutil.copy(generated / name, out / name)
        (out / "__init__.py").write_text(
            '"""Stubs generated from proto/idempotency/v1/idempotency.proto by gen_proto.py."""\n'
        )


if __name__ == "__main__":
    generate()
    print(f"gen_proto: wrote {OUT.relative_to(HERE)}", file=sys.stderr)
