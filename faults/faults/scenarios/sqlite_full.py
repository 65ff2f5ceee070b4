"""The embedded SQLite store on a full disk.

One replica, `store = "sqlite"`, its IDEMPOTENCY_DATA_DIR on a small tmpfs
(faults/infra/disk.py). Under load the WAL is cut to 0 bytes (a TRUNCATE
checkpoint beside the server, so that every write from then on needs new
space), a filler file takes every free byte for a few seconds, then is
deleted. Promised: calls get UNAVAILABLE while the disk
is full (never INTERNAL, never a panic, never an answer that was not stored),
the file stays sound (PRAGMA integrity_check = ok, while serving and after a
clean stop), every Complete answered OK is still there (the checker's
"completions lost" = 0), and service resumes by itself once space returns.

A probe of its own runs next to the workload during the fault: Claims of
fresh keys without retries, each CLAIMED answer checked with a Get (a
reader connection): a Claim answered CLAIMED whose record is not there was
never stored, and a second claimant would get the key too.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import time
from typing import Any, Dict, List, Optional

from idempotency_client import Outcome
from idempotency_client.aio import AsyncIdempotencyClient
from idempotency_client.errors import IdempotencyError

from faults.infra import disk
from faults.scenario import Env, Scenario

#: attempt codes a full disk may cause (the client retries them)
ALLOWED_FAULT_CODES = {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
#: codes that are a bug whatever happens
FORBIDDEN_CODES = {"INTERNAL", "UNKNOWN", "DATA_LOSS"}


def _code(error: BaseException) -> str:
    code = getattr(error, "code", None)
    return getattr(code, "name", None) or type(error).__name__


class SqliteFull(Scenario):
    name = "sqlite_full"
    description = ("embedded SQLite store (1 replica) on a 64 MiB tmpfs filled by a filler file under load "
                   "for a few seconds, then freed")
    replicas = 1
    store = "sqlite"
    workload = {"consumers": 8}
    #: size of the tmpfs (MiB): room for the load's WAL growth before the fault
    disk_mb = 64
    #: seconds of load before the fault, and seconds the disk stays full
    before_s = 1.5
    full_s = 3.0
    full_s_long = 20.0
    #: how long after the space returns the service must work again
    recovery_limit_s = 10.0

    def __init__(self) -> None:
        self.disk: Optional[disk.SmallDisk] = None

    def available(self) -> Optional[str]:
        if os.geteuid() != 0:
            return "needs root to mount a tmpfs"
        return None

    async def prepare(self, env: Env) -> None:
        swept = await asyncio.to_thread(disk.sweep_stale, "faults-sqlite-full-")
        if swept:
            env.log(f"unmounted the disks of killed runs: {swept}")
        self.disk = disk.SmallDisk(size_mb=self.disk_mb, prefix="faults-sqlite-full-")
        await asyncio.to_thread(self.disk.mount)
        env.add_cleanup(self.disk.unmount)  # even when a later step fails
        env.data_dir = pathlib.Path(self.disk.path) / "data"
        env.data_dir.mkdir(parents=True, exist_ok=True)
        env.note("disk_mb", self.disk_mb)

    def _db_file(self, env: Env) -> str:
        return str(env.data_dir / "idempotency.db")

    def _sizes(self, env: Env) -> Dict[str, int]:
        sizes = {}
        for name in ("idempotency.db", "idempotency.db-wal"):
            try:
                sizes[name] = os.path.getsize(env.data_dir / name)
            except OSError:
                pass
        return sizes

    async def _probe(self, env: Env, client: AsyncIdempotencyClient, stop: asyncio.Event,
                     seen: Dict[str, Any]) -> None:
        """Claims of fresh keys without retries while the disk is full; each
        CLAIMED answer must be readable (Get shows the lease)."""
        ns = f"faults-{self.name}-probe"
        i = 0
        while not stop.is_set():
            i += 1
            key = f"probe-{i}"
            try:
                claim = await client.claim(ns, key, lease_ttl=60, timeout=3)
            except IdempotencyError as error:
                seen["claim_codes"][_code(error)] = seen["claim_codes"].get(_code(error), 0) + 1
                await asyncio.sleep(0.05)
                continue
            seen["claim_codes"]["OK"] = seen["claim_codes"].get("OK", 0) + 1
            if claim.outcome is Outcome.CLAIMED:
                try:
                    record = await client.get(ns, key, timeout=3)
                except IdempotencyError as error:
                    seen["get_codes"][_code(error)] = seen["get_codes"].get(_code(error), 0) + 1
                else:
                    if record.fencing_token != claim.fencing_token:
                        seen["unstored_claims"] += 1
                        if len(seen["examples"]) < 3:
                            seen["examples"].append(
                                f"Claim {key} answered CLAIMED (fencing {claim.fencing_token}) at "
                                f"t={env.now():.2f}s, yet Get shows {record.state.name}")
            await asyncio.sleep(0.05)

    async def inject(self, env: Env) -> None:
        assert self.disk is not None
        replica = env.replicas[0]
        full_s = self.full_s if env.ci else self.full_s_long
        await env.sleep_load(self.before_s)
        env.note("sizes_before_fault", self._sizes(env))
        # The WAL cut to 0 bytes first, so that the writes once the disk is
        # full have to grow it: after one of SQLite's checkpoints (every 1000
        # pages, ~4 MiB) the WAL is written again from its start, into space
        # the file already has, and a full disk would not stop a write until
        # the WAL outgrew its old size (seen on a loaded machine: a WAL of
        # ~4 MiB checkpointed as the disk filled, no write needed new space
        # for the few seconds of the fault, and no UNAVAILABLE at all).
        env.note("wal_checkpoint_truncate", await asyncio.to_thread(disk.truncate_wal, self._db_file(env)))
        env.note("sizes_after_truncate", self._sizes(env))

        probe_client = AsyncIdempotencyClient(replica.target, retry=None, timeout=3)
        seen: Dict[str, Any] = {"claim_codes": {}, "get_codes": {}, "unstored_claims": 0, "examples": []}
        health_seen: Dict[str, int] = {}
        stop = asyncio.Event()
        try:
            env.mark("fault")
            filled = await asyncio.to_thread(self.disk.fill)
            env.note("filler_bytes", filled)
            env.log(f"disk full ({filled} bytes of filler, {self.disk.free_space()} free)")
            probe = asyncio.create_task(self._probe(env, probe_client, stop, seen))
            end = time.monotonic() + full_s
            while time.monotonic() < end:
                status = await replica.health(timeout=0.5)
                health_seen[status] = health_seen.get(status, 0) + 1
                await asyncio.sleep(0.1)
            stop.set()
            await probe
            env.note("sizes_while_full", self._sizes(env))
        finally:
            await asyncio.to_thread(self.disk.unfill)
            healed_at = env.mark("healed")
            await probe_client.close()
        env.log("filler deleted: space is back")
        env.note("health_while_full", health_seen)
        env.note("probe_claims_while_full", seen["claim_codes"])
        env.note("probe_gets_while_full", seen["get_codes"])
        env.note("unstored_claims", seen["unstored_claims"])
        if seen["examples"]:
            env.note("unstored_claim_examples", seen["examples"])

        # Recovery: the first Claim + Complete that succeeds, without retries.
        first_ok = None
        client = AsyncIdempotencyClient(replica.target, retry=None, timeout=2)
        try:
            deadline = time.monotonic() + self.recovery_limit_s
            i = 0
            while time.monotonic() < deadline:
                i += 1
                key = f"recovered-{i}"
                try:
                    claim = await client.claim(f"faults-{self.name}-probe", key, lease_ttl=10)
                    await client.complete(f"faults-{self.name}-probe", key, claim.lease_token, b"ok")
                    first_ok = env.now() - healed_at
                    break
                except IdempotencyError:
                    await asyncio.sleep(0.02)
        finally:
            await client.close()
        env.note("first_ok_after_space_returned_s", None if first_ok is None else round(first_ok, 3))
        try:
            serving = await env.wait_serving(timeout=self.recovery_limit_s)
            env.mark("serving")
            env.note("serving_after_space_returned_s", round(serving - healed_at, 3))
        except Exception as error:
            env.note("serving_after_space_returned_s", None)
            env.note("health_after", f"{await replica.health(timeout=0.5)}: {error}")
        # The file while serving (a reader beside the server, WAL included).
        env.note("integrity_check_serving", await asyncio.to_thread(disk.integrity_check, self._db_file(env)))
        env.note("sizes_after", self._sizes(env))

    async def cleanup(self, env: Env) -> None:
        # The file after a clean stop (the WAL checkpointed into it, or not).
        failures = []
        if env.replicas:
            replica = env.replicas[0]
            if replica.running():
                await replica.terminate()
            log = _read(replica.log)
            if re.search(r"panicked at|RUST_BACKTRACE", log):
                failures.append(f"the replica panicked (see {replica.log})")
        if self.disk is not None and self.disk.path and os.path.exists(self._db_file(env)):
            result = await asyncio.to_thread(disk.integrity_check, self._db_file(env))
            print(f"    [{self.name}] integrity_check after a clean stop: {result}", flush=True)
            if result != ["ok"]:
                failures.append(f"integrity_check after a clean stop: {result}")
        if self.disk is not None:
            await asyncio.to_thread(self.disk.unmount)
        if failures:
            raise RuntimeError("; ".join(failures))

    def expect(self, report) -> List[str]:
        failures = []
        notes = report.notes
        fault, healed = report.mark("fault"), report.mark("healed")
        attempts = report.history.attempts if report.history is not None else []
        during = [a for a in attempts if fault is not None and healed is not None and fault <= a["start"] <= healed]
        codes_during: Dict[str, int] = {}
        for a in during:
            codes_during[a["code"]] = codes_during.get(a["code"], 0) + 1
        report.notes["workload_attempts_while_full"] = codes_during
        probe_codes = dict(notes.get("probe_claims_while_full", {}))
        if codes_during.get("UNAVAILABLE", 0) + probe_codes.get("UNAVAILABLE", 0) == 0:
            failures.append(f"the full disk caused no UNAVAILABLE (workload attempts while full: {codes_during}; "
                            f"probe Claims: {probe_codes}; WAL TRUNCATE checkpoint (busy, frames, checkpointed): "
                            f"{notes.get('wal_checkpoint_truncate')})")
        # Never INTERNAL / UNKNOWN (a panic in a handler is UNKNOWN), whenever.
        bad = {c: n for c, n in report.attempt_errors.items() if c in FORBIDDEN_CODES}
        bad.update({f"probe {c}": n for c, n in probe_codes.items() if c in FORBIDDEN_CODES})
        if bad:
            failures.append(f"answers other than UNAVAILABLE for a full disk: {bad}")
        # While full, a workload call either succeeds or gets UNAVAILABLE; a
        # NOT_FOUND / FAILED_PRECONDITION on a lease just granted says an
        # earlier answer (a Claim) was not stored.
        odd = {c: n for c, n in codes_during.items() if c != "OK" and c not in ALLOWED_FAULT_CODES}
        if odd:
            report.notes["odd_codes_while_full"] = odd
        if notes.get("unstored_claims"):
            failures.append(f"{notes['unstored_claims']} Claims answered CLAIMED while the disk was full were "
                            f"not stored (a second claimant gets the same key): "
                            f"{notes.get('unstored_claim_examples')}")
        if notes.get("integrity_check_serving") != ["ok"]:
            failures.append(f"integrity_check while serving: {notes.get('integrity_check_serving')}")
        if notes.get("first_ok_after_space_returned_s") is None:
            failures.append(f"no Claim + Complete succeeded within {self.recovery_limit_s} s after space returned")
        if notes.get("serving_after_space_returned_s") is None:
            failures.append(f"health not SERVING within {self.recovery_limit_s} s after space returned "
                            f"({notes.get('health_after')})")
        return failures


def _read(path) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


SCENARIO = SqliteFull()
