"""PgBouncer (Debian's package) in transaction pooling mode in front of
PostgreSQL, as many deployments run it.

prepare() first probes the service through PgBouncer, with one replica and
a burst of 300 concurrent Claims and Completes on 50 keys (calls without
retries, so each error shows):

1. PgBouncer as installed (only pool_mode = transaction set): the service's
   start is refused, PgBouncer not knowing sqlx's startup parameter
   `extra_float_digits` (then `options`: the service's session settings).
2. With `ignore_startup_parameters = extra_float_digits, options` (and
   `max_prepared_statements = 200` on PgBouncer 1.21 or later, which can
   then keep sqlx's prepared statements apart per server connection), and
   IDEMPOTENCY_REPLAY_CACHE_BYTES=0 (the replay cache LISTENs, which needs a
   session).

The scenario passes when the burst of probe 2 gets no error and the workload
then runs through PgBouncer with all counts 0, or when the service detects
the transaction pooler and says what to set (its start refused, or health
NOT_SERVING, with a message naming pool_mode or max_prepared_statements);
the workload then runs through PgBouncer in session mode. Otherwise it
fails, with the errors seen.

FAULTS_PGBOUNCER_POOL_MODE=session runs it all in session pooling (which
works: each client connection keeps its server connection).

In session pooling each connection a replica opens holds one of PgBouncer's
server connections for as long as it stays open, so PgBouncer's pool must
cover every replica's pool (IDEMPOTENCY_DB_POOL_SIZE, plus the one more the
service opens, plus its feed's listener): the scenario sets
IDEMPOTENCY_DB_POOL_SIZE=SESSION_DB_POOL_SIZE on the replicas and PgBouncer's
default_pool_size to what 3 of them can hold. With less (PgBouncer's 20 for
3 replicas of the default 16), the replicas that grow their pools first keep
every server connection and the last one starves: PoolTimedOut, NOT_SERVING
until the end (seen once waiting Claims made the replicas read more at once).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import subprocess
import time

from faults.cluster import free_port, health_status, server_binary
from faults.infra.pg import sweep, PgBouncer, Postgres, ensure_commands
from faults.scenario import Env, Scenario

#: The replicas' pool in session pooling (IDEMPOTENCY_DB_POOL_SIZE); each
#: replica holds at most this + 2 of PgBouncer's server connections.
SESSION_DB_POOL_SIZE = 8

#: A message of the service's that names what to set.
SAYS_WHAT_TO_SET = re.compile(r"pool_mode|max_prepared_statements|transaction pool", re.I)


def _version_tuple(text: str) -> tuple:
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _normalise(line: str) -> str:
    line = re.sub(r"^\S+\s+", "", line)
    line = re.sub(r"sqlx_s_\d+", "sqlx_s_N", line)
    line = re.sub(r"\d+ parameters", "K parameters", line)
    line = re.sub(r"requires \d+", "requires M", line)
    line = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line)
    return line[:300]


async def probe(url: str, extra_env: dict, log_path: str, burst: int = 300) -> dict:
    """One replica against `url`: did it start (SERVING), the codes of a
    burst of Claim+Complete calls (no retries), the WARN/ERROR lines of its
    log (normalised, counted)."""
    from idempotency_client import AsyncIdempotencyClient

    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update({"DATABASE_URL": url, "IDEMPOTENCY_LISTEN_ADDR": target, "IDEMPOTENCY_METRICS_ADDR": "",
                "IDEMPOTENCY_DB_TIMEOUT": "2s", "IDEMPOTENCY_HEALTH_CHECK_INTERVAL": "250ms", "RUST_LOG": "info"})
    env.update(extra_env)
    result: dict = {"started": False, "exit": None, "health": None, "codes": {}, "log": {}}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(server_binary())], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 8
        status = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                result["exit"] = proc.returncode
                break
            status = await health_status(target, timeout=0.5)
            if status == "SERVING":
                result["started"] = True
                break
            await asyncio.sleep(0.1)
        result["health"] = status
        if result["started"]:
            codes: collections.Counter = collections.Counter()
            async with AsyncIdempotencyClient(target, timeout=5, retry=None) as client:
                async def one(i: int) -> None:
                    key = f"k{i % 50}"
                    try:
                        claim = await client.claim("pgbouncer-probe", key)
                        codes["Claim OK"] += 1
                        if claim.lease_token:
                            await client.complete("pgbouncer-probe", key, claim.lease_token, b"x")
                            codes["Complete OK"] += 1
                    except Exception as error:  # the code of the failed call
                        codes[f"{type(error).__name__}: {getattr(error, 'code', '')}"] += 1
                await asyncio.gather(*(one(i) for i in range(burst)))
            result["codes"] = dict(codes)
            await asyncio.sleep(0.6)  # a health check or two
            result["health"] = await health_status(target, timeout=0.5)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    with open(log_path, errors="replace") as f:
        lines = [_normalise(l.strip()) for l in f if " WARN " in l or " ERROR " in l or l.startswith("error")]
    result["log"] = dict(collections.Counter(l for l in lines if "NO ACCESS POLICY" not in l))
    return result


class PgBouncerScenario(Scenario):
    name = "pgbouncer"
    description = ("Debian's pgbouncer in transaction pooling in front of PostgreSQL: the workload passes "
                   "through it, or the service says what to set")
    replicas = 3
    store = "postgres"
    ci_duration = 4.0

    def __init__(self) -> None:
        self.mode = os.environ.get("FAULTS_PGBOUNCER_POOL_MODE", "transaction")
        self.bouncers: list = []
        self.outcome = ""

    def available(self):
        try:
            ensure_commands({"pgbouncer": "pgbouncer"})
        except RuntimeError as error:
            return str(error)
        return None

    def _session_settings(self, settings: dict) -> dict:
        """PgBouncer's settings in session pooling: a pool that covers every
        replica's connections (see the module's doc)."""
        return {**settings, "default_pool_size": self.replicas * (SESSION_DB_POOL_SIZE + 2)}

    def _bouncer(self, env: Env, mode: str, settings: dict) -> PgBouncer:
        bouncer = PgBouncer(_AsPostgres(env.pg), pool_mode=mode, settings=settings)
        self.bouncers.append(bouncer)
        env.add_cleanup(bouncer.remove)
        return bouncer.start()

    async def prepare(self, env: Env) -> None:
        await asyncio.to_thread(sweep)  # what a killed run left
        logs = env.tmpdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        plain = await asyncio.to_thread(self._bouncer, env, self.mode, {})
        version = plain.version()
        env.note("pgbouncer", version)
        env.note("pool_mode", self.mode)
        newer = _version_tuple(version) >= (1, 21)

        # 1. As installed.
        first = await probe(plain.url("idempotency"), {}, str(logs / "probe-as-installed.log"))
        env.note("probe_as_installed", first)

        # 2. With what it takes to connect.
        settings = {"ignore_startup_parameters": "extra_float_digits,options"}
        if newer:
            settings["max_prepared_statements"] = 200
        if self.mode == "session":
            settings = self._session_settings(settings)
        bouncer = await asyncio.to_thread(self._bouncer, env, self.mode, settings)
        extra = ({"IDEMPOTENCY_REPLAY_CACHE_BYTES": "0"} if self.mode == "transaction"
                 else {"IDEMPOTENCY_DB_POOL_SIZE": str(SESSION_DB_POOL_SIZE)})
        second = await probe(bouncer.url("idempotency"), extra, str(logs / "probe-configured.log"))
        env.note("probe_configured", {"pgbouncer_settings": settings, "replica_env": extra, **second})

        errors = {c: n for c, n in second["codes"].items() if not c.endswith(" OK")}
        said = any(SAYS_WHAT_TO_SET.search(line) for line in second["log"]) or any(
            SAYS_WHAT_TO_SET.search(line) for line in first["log"])
        if second["started"] and not errors and second["health"] == "SERVING":
            self.outcome = f"passes through PgBouncer ({self.mode} pooling)"
            env.database_url = bouncer.url("idempotency")
            env.replica_env.update(extra)
        elif said:
            self.outcome = "the service detects the transaction pooler and says what to set; load in session mode"
            session = await asyncio.to_thread(self._bouncer, env, "session", self._session_settings(settings))
            env.database_url = session.url("idempotency")
            env.replica_env["IDEMPOTENCY_DB_POOL_SIZE"] = str(SESSION_DB_POOL_SIZE)
        else:
            raise RuntimeError(
                f"through {version} in {self.mode} pooling the service neither works nor says what to set:\n"
                f"  as installed: started={first['started']} exit={first['exit']} log={first['log']}\n"
                f"  with {settings} and {extra}: started={second['started']} health={second['health']} "
                f"calls={second['codes']}\n  log={second['log']}")
        env.note("outcome", self.outcome)

    def expect(self, report):
        odd = {c: n for c, n in report.errors.items() if c in ("INTERNAL", "UNKNOWN")}
        return [f"calls failed with {odd} through PgBouncer"] if odd else []

    async def cleanup(self, env: Env) -> None:
        for bouncer in self.bouncers:
            await asyncio.to_thread(bouncer.remove)


class _AsPostgres:
    """The harness's PgCluster seen as infra.pg.Postgres (host and port are
    all PgBouncer needs)."""

    def __init__(self, cluster) -> None:
        self.host = cluster.host
        self.port = cluster.port


SCENARIO = PgBouncerScenario()
