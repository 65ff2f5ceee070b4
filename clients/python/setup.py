"""Build hook: generate the gRPC stubs from ../../proto before packaging.

Everything else about the package is declared in pyproject.toml.

The stubs are generated here, before setup() is called, and not in a build
command: setup() reads pyproject.toml, and its `packages.find` and
`package-data` are evaluated right then, before any command runs. Stubs made
later (in build_py.run, as they once were) are missing from that list, so a
first build from a fresh clone shipped `_proto/` without its modules. Every
build step (metadata, sdist, wheel, editable) evaluates this file first, so
each sees the stubs as ordinary package files: `idempotency_client._proto` is
found as a package, its modules go into the wheel and the sdist, its `.pyi`
as package data.

From a checkout the stubs are regenerated every time (a fraction of a second),
so they always match the proto. An sdist has no proto/ beside it: it carries
the stubs generated when it was made (its PKG-INFO says it is one).
"""

import pathlib
import sys

from setuptools import setup

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gen_proto  # noqa: E402  (beside this file, in a checkout and in the sdist)


def ensure_stubs() -> None:
    stubs = [gen_proto.OUT / name for name in gen_proto.GENERATED]
    if (HERE / "PKG-INFO").is_file():
        # An unpacked sdist: use the stubs it was made with.
        missing = [str(path.relative_to(HERE)) for path in stubs if not path.is_file()]
        if missing:
            raise SystemExit(f"idempotency-client: this sdist lacks its generated stubs: {', '.join(missing)}")
        return
    if not (gen_proto.PROTO_ROOT / gen_proto.PROTO_FILE).is_file():
        raise SystemExit(
            f"idempotency-client: {gen_proto.PROTO_ROOT / gen_proto.PROTO_FILE} not found; "
            "build the package from a checkout of the repository (pip install ./clients/python)"
        )
    gen_proto.generate()


ensure_stubs()
setup()
