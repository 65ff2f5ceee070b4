"""PostgreSQL crash (pg_ctl stop -m immediate) and a fast restart under load,
repeated every few seconds. Once health is SERVING again on every replica
(polled from the moment PostgreSQL accepts connections again), no attempt
may fail until the next crash: no connection kept from before the restart
may surface as UNAVAILABLE ("terminating connection due to administrator
command")."""

import asyncio

from faults.checker import FAILURE_CODES
from faults.cluster import as_postgres
from faults.scenario import Env, Scenario


class PgCrash(Scenario):
    name = "pg_crash"
    description = ("pg_ctl stop -m immediate under load and an immediate restart, every ~3 s; "
                   "0 failed attempts once health is SERVING again")
    ci_duration = 6.0
    #: seconds of load between a SERVING and the next crash
    between = 2.0

    async def inject(self, env: Env) -> None:
        crashes = []
        await env.sleep_load(1.0)
        while True:
            fault = env.mark("fault")
            await env.sh(*as_postgres([str(env.pg.bindir / "pg_ctl"), "-D", str(env.pg.data), "-m", "immediate",
                                       "-w", "-t", "60", "stop"]), check=False)
            await asyncio.to_thread(env.pg.start)
            healed = env.mark("healed")
            serving = await env.wait_serving(timeout=30)
            env.history.mark("serving", serving)
            crashes.append({"down_s": round(healed - fault, 3), "serving_after_restart_s": round(serving - healed, 3)})
            if env.load_left() < self.between + 2.0:
                break
            await env.sleep_load(self.between)
        env.note("crashes", crashes)

    def expect(self, report):
        failures = []
        servings = report.marks.get("serving", [])
        if not servings:
            return ["health never SERVING again"]
        faults = sorted(report.marks.get("fault", []))
        after = {}
        total = 0
        for serving in servings:
            next_fault = min((f for f in faults if f > serving), default=float("inf"))
            codes = {}
            for a in report.history.attempts:
                # started after SERVING and ended before the next crash
                # (an attempt cut by the next crash is that crash's)
                if serving <= a["start"] and a["end"] < next_fault and a["code"] in FAILURE_CODES:
                    codes[a["code"]] = codes.get(a["code"], 0) + 1
            total += sum(codes.values())
            for code, n in codes.items():
                after[code] = after.get(code, 0) + n
        report.notes["failed_attempts_after_serving"] = total
        report.notes["failed_attempts_after_serving_by_code"] = after
        if total:
            failures.append(f"{total} attempts failed after health was SERVING again: {after}")
        if report.failed_calls:
            failures.append(f"{report.failed_calls} logical calls failed: {report.errors}")
        return failures


SCENARIO = PgCrash()
