"""PostgreSQL crash (pg_ctl stop -m immediate) and a fast restart under load.
Once health is SERVING again on every replica, no attempt may fail (no
stale pooled connection may surface as UNAVAILABLE)."""

import asyncio

from faults.cluster import as_postgres
from faults.scenario import Env, Scenario


class PgCrash(Scenario):
    name = "pg_crash"
    description = ("pg_ctl stop -m immediate under load, restart at once; "
                   "0 failed attempts after health is SERVING again")

    async def inject(self, env: Env) -> None:
        await env.sleep_load(1.0)
        fault = env.mark("fault")
        await env.sh(*_pg_ctl(env, "stop", "-m", "immediate"), check=False)
        env.pg.running = False
        # Every replica notices (health NOT_SERVING) before the restart, so
        # that "SERVING again" is an answer given after the crash.
        noticed = await env.wait_health("NOT_SERVING", timeout=15)
        env.note("not_serving_after_s", round(noticed - fault, 3))
        await asyncio.to_thread(env.pg.start)
        healed = env.mark("healed")
        serving = await env.wait_serving(timeout=30)
        env.history.mark("serving", serving)
        env.note("serving_after_restart_s", round(serving - healed, 3))

    def expect(self, report):
        failures = []
        serving = report.mark("serving")
        if serving is None:
            return ["health never SERVING again"]
        report.notes["failed_attempts_after_serving"] = report.failed_attempts_after(serving)
        report.notes["failed_attempts_after_serving_by_code"] = report.failed_attempts_after_by_code(serving)
        if report.notes["failed_attempts_after_serving"]:
            failures.append(f"{report.notes['failed_attempts_after_serving']} attempts failed after health was "
                            f"SERVING again at {serving:.3f} s: {report.notes['failed_attempts_after_serving_by_code']}")
        if report.failed_calls:
            failures.append(f"{report.failed_calls} logical calls failed: {report.errors}")
        return failures


def _pg_ctl(env, *args):
    return as_postgres([str(env.pg.bindir / "pg_ctl"), "-D", str(env.pg.data), "-w", "-t", "60", *args])


SCENARIO = PgCrash()
