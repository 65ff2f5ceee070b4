"""Connection exhaustion: PostgreSQL at max_connections (other sessions hold
every free slot) and a pool smaller than the callers (IDEMPOTENCY_DB_POOL_SIZE=2
with 64 concurrent consumers).

The replicas connect as an ordinary role (faults_app); the other sessions are
the superuser's. Phase 1 ("fault"): the other sessions take every slot, up to
max_connections; the replicas keep only the connections they had, and 64
callers share 2 pooled connections per replica. Phase 2 ("starved"): the
replicas' sessions are terminated; the slots this frees are within
superuser_reserved_connections, so a replica's new connection is refused
("remaining connection slots are reserved", SQLSTATE 53300, as "too many
clients"). Then the other sessions go away ("healed").

Expected: latency bounded (p99 and max reported; max within the call
deadline), errors only RESOURCE_EXHAUSTED or UNAVAILABLE, the replicas' RSS
flat (VmRSS before the fault and after it; both reported)."""

import asyncio

import asyncpg

from faults.scenario import Env, Scenario

MAX_CONNECTIONS = 40
#: more than the replicas' sessions (3 x (pool 2 + background + listener)),
#: so the slots their terminated sessions free stay out of their reach
RESERVED = 16
ALLOWED = {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
#: RSS may grow by this much (KiB) over the run: caches filling, not a leak
RSS_SLACK_KB = 32 * 1024
#: how long after the heal every replica has to answer health SERVING
SERVING_TIMEOUT = 10.0


async def _sessions(env):
    """The replicas' sessions (role faults_app): pid, state, wait, age, query."""
    rows = await asyncio.to_thread(
        env.pg.psql, "SELECT pid, state, coalesce(wait_event, ''), date_trunc('second', now() - backend_start), "
        "regexp_replace(left(query, 50), '\\s+', ' ', 'g') FROM pg_stat_activity "
        "WHERE usename = 'faults_app' ORDER BY backend_start")
    return rows.splitlines()


class Exhaustion(Scenario):
    name = "exhaustion"
    description = (f"PostgreSQL at max_connections={MAX_CONNECTIONS} (other sessions hold the rest), "
                   "IDEMPOTENCY_DB_POOL_SIZE=2 under 64 consumers; then the replicas' sessions terminated")
    # A lease longer than the worst wait, so that a slow Complete is not
    # refused for a lease that ran out (that would be a verdict, not a fault).
    workload = {"consumers": 64, "lease_ttl": 4.0}
    ci_duration = 7.0

    def __init__(self):
        self.holders = []

    async def prepare(self, env: Env) -> None:
        env.replica_env["IDEMPOTENCY_DB_POOL_SIZE"] = "2"
        env.pg.conf(max_connections=MAX_CONNECTIONS, superuser_reserved_connections=RESERVED)
        await asyncio.to_thread(env.pg.restart)
        await asyncio.to_thread(env.pg.psql, "CREATE ROLE faults_app LOGIN; "
                                "ALTER DATABASE idempotency OWNER TO faults_app")
        env.database_url = f"postgres://faults_app@{env.pg.host}:{env.pg.port}/idempotency"

    async def _fill(self, env: Env) -> int:
        """Open sessions until PostgreSQL refuses one; how many were opened."""
        opened = 0
        while True:
            try:
                conn = await asyncpg.connect(env.pg.database_url("postgres"), timeout=5)
            except (asyncpg.TooManyConnectionsError, asyncpg.CannotConnectNowError):
                return opened
            except OSError:
                return opened
            self.holders.append(conn)
            opened += 1

    async def inject(self, env: Env) -> None:
        duration = env.workload.duration
        await env.sleep_load(min(1.0, duration / 6))
        env.note("rss_kb_before", {r.name: r.rss_kb() for r in env.replicas})
        env.mark("fault")
        held = await self._fill(env)
        used = await self.holders[0].fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")
        env.note("sessions_held_by_others", held)
        env.note("client_sessions_at_full", used)
        env.log(f"PostgreSQL full: {held} other sessions hold slots, {used} client sessions in all")
        await env.sleep_load(duration / 3)
        # Phase 2: the replicas lose their sessions and cannot get new ones.
        env.mark("starved")
        terminated = await self.holders[0].fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE usename = 'faults_app'")
        env.note("replica_sessions_terminated", terminated)
        # longer than IDEMPOTENCY_DB_TIMEOUT (2 s), so that calls get their UNAVAILABLE
        await env.sleep_load(3.0)
        await asyncio.gather(*(c.close() for c in self.holders), return_exceptions=True)
        self.holders.clear()
        env.mark("healed")
        try:
            serving = await env.wait_serving(timeout=SERVING_TIMEOUT)
            env.history.mark("serving", serving)
            env.note("serving_after_heal_s", round(serving - env.history.marks[-1][1], 3))
        except TimeoutError:
            # Not SERVING again: say which sessions the replicas hold (expect() fails).
            env.note("health_after_heal", {r.name: await r.health() for r in env.replicas})
            env.note("replica_sessions_after_heal", await _sessions(env))
        await env.sleep_load(env.load_left())
        env.note("rss_kb_after", {r.name: r.rss_kb() for r in env.replicas})
        health = {r.name: await r.health() for r in env.replicas}
        env.note("health_at_load_end", health)
        if any(status != "SERVING" for status in health.values()):
            env.note("replica_sessions_at_load_end", await _sessions(env))

    async def cleanup(self, env: Env) -> None:
        await asyncio.gather(*(c.close() for c in self.holders), return_exceptions=True)
        self.holders.clear()

    def expect(self, report):
        failures = []
        if report.mark("serving") is None:
            failures.append(f"health not SERVING on every replica within {SERVING_TIMEOUT:.0f} s after the other "
                            f"sessions went away: {report.notes.get('health_after_heal')}")
        elif any(v != "SERVING" for v in (report.notes.get("health_at_load_end") or {}).values()):
            failures.append(f"health at the end of the load: {report.notes.get('health_at_load_end')}")
        bad = {code: n for code, n in report.errors.items() if code not in ALLOWED}
        bad_attempts = {code: n for code, n in report.attempt_errors.items() if code not in ALLOWED}
        if bad or bad_attempts:
            failures.append(f"errors other than RESOURCE_EXHAUSTED/UNAVAILABLE: calls {bad}, attempts {bad_attempts}")
        if report.notes.get("sessions_held_by_others", 0) < 1:
            failures.append("PostgreSQL was never filled up")
        deadline = report.history.calls[0]["deadline"] if report.history and report.history.calls else 10.0
        if report.latency["max"] is not None and report.latency["max"] > deadline + 1:
            failures.append(f"a call took {report.latency['max']:.3f} s, over its deadline of {deadline} s")
        before = report.notes.get("rss_kb_before") or {}
        after = report.notes.get("rss_kb_after") or {}
        for name, kb in before.items():
            if kb is None or after.get(name) is None:
                failures.append(f"{name}: no RSS sample ({kb} -> {after.get(name)})")
            elif after[name] > kb + RSS_SLACK_KB:
                failures.append(f"{name}: RSS grew from {kb} KiB to {after[name]} KiB")
        return failures


SCENARIO = Exhaustion()
