"""Failover to a synchronous standby under load: 0 acknowledged completions
lost.

A primary on 127.0.0.2:P and a streaming standby on 127.0.0.3:P (the same
port, another loopback address; pg_basebackup -R, application_name
standby1). The primary has `synchronous_standby_names = 'standby1'` and
`synchronous_commit = on`: a COMMIT returns only once the standby has
flushed its WAL, so every Complete the service answered OK is on the
standby. The replicas' DATABASE_URL names 127.0.0.2:P. Under load the
primary is killed (`pg_ctl stop -m immediate`), the standby promoted
(`pg_ctl promote`) and restarted listening on 127.0.0.2 (the address the
replicas use, as a floating IP or a DNS name moved by a failover manager
would make it). The checker then counts completions lost (a Complete
answered OK that a later Claim or Get does not show): 0.

FAULTS_FAILOVER_SYNC=off runs the same with asynchronous replication
(`synchronous_standby_names = ''`): acknowledged completions may be lost
(the WAL not yet sent when the primary died); the run reports what it saw
and fails when some were lost. It is not part of the CI run. On loopback
the standby is microseconds behind, so a loss is rare;
FAULTS_FAILOVER_REPLICATION_DELAY_MS=200 puts 200 ms each way on the
replication link (a TCP relay with a delay line, as a standby in another
zone): then asynchronous replication loses the completions of the last
~200 ms, and synchronous replication loses none (its commits wait the
round trip instead).
"""

from __future__ import annotations

import asyncio
import os
import time

from faults.infra.net import Relay
from faults.infra.pg import sweep, Postgres, free_port
from faults.scenario import Env, Scenario

PRIMARY = "127.0.0.2"
STANDBY = "127.0.0.3"


class Failover(Scenario):
    name = "failover"
    description = ("primary killed (-m immediate) under load, synchronous standby promoted and moved to the "
                   "primary's address; 0 acknowledged completions lost")
    replicas = 3
    store = "postgres"
    ci_duration = 6.0
    workload = {"lease_ttl": 3.0, "call_timeout": 15.0}

    def __init__(self) -> None:
        self.sync = os.environ.get("FAULTS_FAILOVER_SYNC", "on").lower() not in ("off", "0", "false", "async")
        #: added latency (ms, each way) on the replication link: a standby
        #: farther away (FAULTS_FAILOVER_REPLICATION_DELAY_MS, default 0)
        self.repl_delay = int(os.environ.get("FAULTS_FAILOVER_REPLICATION_DELAY_MS", "0") or 0)
        self.primary: Postgres | None = None
        self.standby: Postgres | None = None

    async def prepare(self, env: Env) -> None:
        await asyncio.to_thread(sweep)  # what a killed run left
        settings = {"wal_level": "replica", "max_wal_senders": 5, "synchronous_commit": "on",
                    "wal_sender_timeout": "5s", "wal_receiver_status_interval": "1s"}
        port = free_port(PRIMARY, also=[STANDBY])  # the same port on both addresses
        self.primary = Postgres(listen=PRIMARY, port=port, name="primary", settings=settings)
        env.add_cleanup(self.primary.remove)
        await asyncio.to_thread(lambda: self.primary.init().start())
        await asyncio.to_thread(self.primary.psql, "CREATE DATABASE idempotency")
        self.standby = Postgres(listen=STANDBY, port=self.primary.port, name="standby",
                                settings={"hot_standby": "on"})
        env.add_cleanup(self.standby.remove)
        via = None
        if self.repl_delay:
            relay = Relay("127.0.0.1", PRIMARY, self.primary.port, str(env.tmpdir / "relay.log"), both_ways=True)
            env.add_cleanup(relay.stop)
            await asyncio.to_thread(relay.start)
            relay.set_delay(self.repl_delay)
            via = (relay.host, relay.port)
            env.note("replication_link_delay_ms_each_way", self.repl_delay)
        await asyncio.to_thread(lambda: self.standby.standby_of(self.primary, "standby1", via=via).start())
        # Synchronous from now on (not before: CREATE DATABASE would wait for a
        # standby that does not exist yet).
        if self.sync:
            await asyncio.to_thread(self.primary.psql,
                                    "ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
            await asyncio.to_thread(self.primary.psql, "SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        want = "sync" if self.sync else "async"
        state = ""
        while time.monotonic() < deadline:
            state = await asyncio.to_thread(self.primary.psql,
                                            "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'")
            if state == want:
                break
            await asyncio.sleep(0.1)
        if state != want:
            raise RuntimeError(f"standby not streaming as {want} (pg_stat_replication says {state!r})")
        env.database_url = self.primary.url("idempotency")
        env.note("replication", f"{want}: primary {PRIMARY}:{self.primary.port}, standby {STANDBY}:{self.standby.port}")

    async def inject(self, env: Env) -> None:
        await env.sleep_load(2.0)
        fault = env.mark("fault")
        # What the standby had received when the primary died (for the note).
        lag = await asyncio.to_thread(
            self.primary.psql,
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn) FROM pg_stat_replication")
        await asyncio.to_thread(self.primary.stop, "immediate")
        killed = env.now()
        await asyncio.to_thread(self.standby.promote)
        promoted = env.now()
        # The promoted standby takes over the primary's address.
        self.standby.listen = self.standby.host = PRIMARY
        self.standby.settings["listen_addresses"] = f"'{PRIMARY}'"
        await asyncio.to_thread(self.standby.restart)
        healed = env.mark("healed")
        serving = await env.wait_serving(timeout=30)
        env.history.mark("serving", serving)
        env.note("standby_flush_lag_bytes_before_kill", lag)
        env.note("kill_s", round(killed - fault, 3))
        env.note("promote_s", round(promoted - killed, 3))
        env.note("moved_s", round(healed - promoted, 3))
        env.note("serving_after_fault_s", round(serving - fault, 3))
        in_recovery = await asyncio.to_thread(self.standby.psql, "SELECT pg_is_in_recovery()")
        env.note("new_primary_in_recovery", in_recovery)
        env.log(f"primary killed, standby promoted and on {PRIMARY} after {healed - fault:.2f} s; "
                f"SERVING after {serving - fault:.2f} s")

    def expect(self, report):
        failures = []
        if report.mark("serving") is None:
            failures.append("health never SERVING again after the failover")
        if report.notes.get("new_primary_in_recovery") not in (None, "f"):
            failures.append("the promoted standby is still in recovery")
        odd = {c: n for c, n in report.errors.items()
               if c not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION")}
        if odd:
            failures.append(f"calls failed with unexpected codes: {odd}")
        return failures

    async def cleanup(self, env: Env) -> None:
        for pg in (self.primary, self.standby):
            if pg is not None:
                await asyncio.to_thread(pg.remove)


SCENARIO = Failover()
