"""A small filesystem that can be filled: a tmpfs of a few MiB mounted on a
temporary folder (root only), a filler file that takes every free byte, and
SQLite's own integrity check of a database file.

    disk = SmallDisk(size_mb=16)
    disk.mount()                    # disk.path: the mounted folder
    ...                             # the server's IDEMPOTENCY_DATA_DIR inside it
    written = disk.fill()           # writes until ENOSPC; returns bytes written
    disk.free_space()               # bytes free (statvfs)
    disk.unfill()                   # deletes the filler: space returns
    disk.unmount()                  # lazy unmount + rmdir, safe to call twice

A tmpfs holds every written byte in memory pages (zeros included), so the
filler really takes the space; ENOSPC is what SQLite sees as SQLITE_FULL
(code 13) on a write that needs a new page (the WAL growing, a checkpoint
growing the main file).
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
import tempfile
from typing import List, Optional, Tuple

FILLER_NAME = "filler.bin"
OWNER_NAME = ".owner-pid"
_CHUNK = 64 * 1024


class SmallDisk:
    def __init__(self, size_mb: int = 16, prefix: str = "faults-disk-"):
        self.size_mb = size_mb
        self.prefix = prefix
        self.path: Optional[str] = None
        self.mounted = False

    # -- mount -----------------------------------------------------------
    def mount(self) -> str:
        if os.geteuid() != 0:
            raise PermissionError("SmallDisk needs root (mount -t tmpfs)")
        self.path = tempfile.mkdtemp(prefix=self.prefix)
        # mode=1777 so a server run as another user could write too.
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=1777", "tmpfs", self.path],
            check=True,
            capture_output=True,
            text=True,
        )
        self.mounted = True
        # Who owns it: sweep_stale() unmounts the disks of dead runs.
        with open(os.path.join(self.path, OWNER_NAME), "w") as owner:
            owner.write(str(os.getpid()))
        return self.path

    def unmount(self) -> None:
        if self.path is None:
            return
        if self.mounted:
            # Lazy: a server still holding a file open must not keep the mount.
            subprocess.run(["umount", "-l", self.path], check=False, capture_output=True)
            self.mounted = False
        shutil.rmtree(self.path, ignore_errors=True)
        self.path = None

    def __enter__(self) -> "SmallDisk":
        self.mount()
        return self

    def __exit__(self, *exc) -> None:
        self.unmount()

    # -- space -----------------------------------------------------------
    @property
    def filler(self) -> str:
        assert self.path is not None, "not mounted"
        return os.path.join(self.path, FILLER_NAME)

    def free_space(self) -> int:
        assert self.path is not None, "not mounted"
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> int:
        """Appends to the filler until the filesystem is full (ENOSPC), or
        until only `leave` bytes are free. Returns the bytes written."""
        written = 0
        chunk = b"\0" * _CHUNK
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while True:
                room = self.free_space() - leave
                if room <= 0:
                    break
                try:
                    written += os.write(fd, chunk[: min(_CHUNK, room)])
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    # The last pages: a byte at a time is too slow; try smaller pieces.
                    piece = _CHUNK // 2
                    while piece >= 512:
                        try:
                            written += os.write(fd, chunk[:piece])
                        except OSError as inner:
                            if inner.errno != errno.ENOSPC:
                                raise
                            piece //= 2
                    break
        finally:
            os.close(fd)
        return written

    def unfill(self) -> None:
        try:
            os.unlink(self.filler)
        except FileNotFoundError:
            pass


def sweep_stale(prefix: str = "faults-disk-") -> List[str]:
    """Unmount and delete the tmpfs disks (under the temp folder, named
    `prefix`*) whose owning process is gone (a run killed with SIGKILL).
    Returns the paths swept."""
    swept = []
    base = tempfile.gettempdir()
    try:
        with open("/proc/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[0] == "tmpfs"]
    except OSError:
        return swept
    for point in points:
        if os.path.dirname(point) != base or not os.path.basename(point).startswith(prefix):
            continue
        try:
            with open(os.path.join(point, OWNER_NAME)) as owner:
                pid = int(owner.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and os.path.exists(f"/proc/{pid}"):
            continue
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        shutil.rmtree(point, ignore_errors=True)
        swept.append(point)
    return swept


def integrity_check(db_file: str) -> List[str]:
    """PRAGMA integrity_check on a SQLite file (its -wal beside it is read
    too); ['ok'] when sound. Opens read-write so the WAL can be read (a
    read-only open of a WAL database needs the -shm), but writes nothing."""
    connection = sqlite3.connect(db_file, timeout=10)
    try:
        return [row[0] for row in connection.execute("PRAGMA integrity_check")]
    finally:
        connection.close()


def truncate_wal(db_file: str, tries: int = 20) -> Tuple[int, int, int]:
    """PRAGMA wal_checkpoint(TRUNCATE) on a SQLite file in WAL mode, beside
    the server's connections: every frame copied into the database and the
    -wal file cut to 0 bytes, so that the next write has to grow it again
    (after a checkpoint SQLite writes the WAL from its start, into the space
    the file already has: a full disk does not stop those writes). Tried
    again while a writer keeps it from finishing (busy); returns SQLite's
    (busy, frames in the WAL, frames checkpointed) of the last try."""
    connection = sqlite3.connect(db_file, timeout=10)
    try:
        result = (1, -1, -1)
        for _ in range(tries):
            result = tuple(connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())
            if result[0] == 0:
                break
        return result
    finally:
        connection.close()


def count_rows(db_file: str, table: str = "idempotency_records") -> int:
    connection = sqlite3.connect(db_file, timeout=10)
    try:
        return connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        connection.close()
