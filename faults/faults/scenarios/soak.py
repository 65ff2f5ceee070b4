"""A soak: mixed faults for the whole duration (SIGKILL or SIGTERM of a
replica and its restart, PostgreSQL crashes and restarts), with a short
retention so that the reaper deletes as fast as the load inserts. The table
size (rows of idempotency_records) and the RSS of a replica that is never
restarted are sampled all along: both must stay flat.

Not in `run.sh --ci` (it is long by nature):

    faults/run.sh --duration 1800 soak     # 30 minutes
    faults/run.sh --duration 120 soak      # 2 minutes
"""

import asyncio
import random

from faults.scenario import Env, Scenario

#: retention of every record, seconds: the reaper keeps the table at about
#: (keys per second x retention) rows
RETENTION = 30.0
#: seconds between two faults
FAULT_EVERY = 10.0
#: seconds between two samples of table size and RSS
SAMPLE_EVERY = 5.0
RSS_SLACK_KB = 32 * 1024


class Soak(Scenario):
    name = "soak"
    description = (f"mixed faults every {FAULT_EVERY:.0f} s (kill -9, SIGTERM, PostgreSQL crash) with retention "
                   f"{RETENTION:.0f} s and the reaper on; table size and RSS sampled, both flat")
    ci = False
    workload = {"retention": RETENTION, "duration": 120.0}

    async def inject(self, env: Env) -> None:
        samples = []
        env.note("samples", samples)  # [t, rows, rss_kb of replica0]
        sampler = asyncio.create_task(self._sample(env, samples))
        faults = {"kill9": 0, "sigterm": 0, "pg_crash": 0}
        try:
            while env.load_left() > FAULT_EVERY:
                await env.sleep_load(FAULT_EVERY)
                kind = random.choice(list(faults))
                faults[kind] += 1
                env.mark("fault")
                if kind == "pg_crash":
                    await asyncio.to_thread(env.pg.stop, "immediate")
                    await asyncio.sleep(1.0)
                    await asyncio.to_thread(env.pg.start)
                else:
                    # replica0 is never restarted: its RSS is the one sampled
                    replica = random.choice(env.replicas[1:])
                    if kind == "kill9":
                        await replica.kill()
                    else:
                        await replica.terminate()
                    await replica.start()
                env.mark("healed")
                env.history.mark("serving", await env.wait_serving(timeout=30))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        env.note("faults", faults)

    async def _sample(self, env: Env, samples) -> None:
        while True:
            try:
                rows = int(await asyncio.to_thread(env.pg.psql, "SELECT count(*) FROM idempotency_records",
                                                   "idempotency"))
            except Exception:
                rows = None  # PostgreSQL down right now
            samples.append([round(env.now(), 1), rows, env.replicas[0].rss_kb()])
            await asyncio.sleep(SAMPLE_EVERY)

    def expect(self, report):
        failures = []
        samples = [s for s in report.notes.get("samples", []) if s[1] is not None and s[2] is not None]
        # Flat once the first retention has passed (the table fills up to its level first).
        steady = [s for s in samples if s[0] >= RETENTION + 10]
        if len(steady) < 3:
            return failures  # too short to judge flatness: only the six counts apply
        rows = [s[1] for s in steady]
        rss = [s[2] for s in steady]
        report.notes["rows_first_last_max"] = [rows[0], rows[-1], max(rows)]
        report.notes["rss_kb_first_last_max"] = [rss[0], rss[-1], max(rss)]
        if rows[-1] > 2 * rows[0] + 1000:
            failures.append(f"the table grew from {rows[0]} to {rows[-1]} rows (the reaper falls behind)")
        if rss[-1] > rss[0] + RSS_SLACK_KB:
            failures.append(f"replica0's RSS grew from {rss[0]} to {rss[-1]} KiB")
        return failures


SCENARIO = Soak()
