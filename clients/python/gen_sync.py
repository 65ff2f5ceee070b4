"""Generate the synchronous client from the asyncio one, as encode/httpcore does.

    python gen_sync.py          write src/idempotency_client/_sync/ from _async/
    python gen_sync.py --check  fail (exit 1, with a diff) when the committed
                                _sync/ is not what a fresh generation writes

The asyncio code in src/idempotency_client/_async/ is the source. unasync
(PyPI, pinned in pyproject.toml's `test` extra) removes `async` and `await`,
turns `__aenter__` into `__enter__` and so on, and renames the names in
REPLACEMENTS; the output goes to _sync/ with a header saying so. The few
things that really differ between the two (a pause, the heartbeat's task or
thread, closing the channels) are written by hand for each side, in
_concurrency.py, _run.py and channels.py, under the names mapped here.

The output is committed, so installing the package needs neither unasync nor
this script; run-tests.sh runs `--check`, so a change to _async/ without a
fresh generation fails the tests.
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import shutil
import sys
import tempfile
from typing import Dict

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE / "src" / "idempotency_client"
ASYNC_DIR = PACKAGE / "_async"
SYNC_DIR = PACKAGE / "_sync"

#: The asyncio name on the left, its synchronous twin on the right.
REPLACEMENTS = {
    "AsyncIdempotencyClient": "IdempotencyClient",
    "AsyncOnce": "Once",
    "AsyncLeaseCalls": "LeaseCalls",
    "AsyncRun": "Run",
    "AsyncHeartbeat": "Heartbeat",
    "AsyncChannel": "Channel",
    "async_sleep": "sleep",
    "aio_endpoints": "sync_endpoints",
    "aio_channel_endpoints": "sync_channel_endpoints",
    "close_aio": "close_sync",
}

HEADER = (
    "# Generated from ../_async/{name} by clients/python/gen_sync.py (unasync): do not edit.\n"
    "# Change the asyncio source and run the script again.\n"
)


def generate() -> Dict[str, str]:
    """The files of _sync/, by name, as a fresh generation writes them."""
    import unasync  # the test extra's; imported here so --help works without it

    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp) / "_async"
        shutil.copytree(ASYNC_DIR, source, ignore=shutil.ignore_patterns("__pycache__"))
        rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=REPLACEMENTS)
        unasync.unasync_files(sorted(str(path) for path in source.glob("*.py")), [rule])
        generated = pathlib.Path(tmp) / "_sync"
        return {
            path.name: HEADER.format(name=path.name) + path.read_text(encoding="utf-8")
            for path in sorted(generated.glob("*.py"))
        }


def committed() -> Dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(SYNC_DIR.glob("*.py"))}


def check() -> int:
    fresh, present = generate(), committed()
    stale = sorted(name for name in fresh.keys() | present.keys() if fresh.get(name) != present.get(name))
    if not stale:
        print(f"gen_sync: _sync/ is current ({len(fresh)} files generated from _async/)")
        return 0
    for name in stale:
        sys.stdout.writelines(
            difflib.unified_diff(
                present.get(name, "").splitlines(keepends=True),
                fresh.get(name, "").splitlines(keepends=True),
                f"committed _sync/{name}",
                f"generated _sync/{name}",
            )
        )
    print(
        f"gen_sync: _sync/ differs from a fresh generation ({', '.join(stale)}):"
        " edit _async/, then run python clients/python/gen_sync.py",
        file=sys.stderr,
    )
    return 1


def write() -> None:
    fresh = generate()
    SYNC_DIR.mkdir(exist_ok=True)
    for name in committed().keys() - fresh.keys():
        (SYNC_DIR / name).unlink()
    for name, text in fresh.items():
        (SYNC_DIR / name).write_text(text, encoding="utf-8")
    print(f"gen_sync: wrote {len(fresh)} files to {SYNC_DIR.relative_to(HERE)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed _sync/ is stale")
    if parser.parse_args().check:
        return check()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
