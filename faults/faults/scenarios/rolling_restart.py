"""Rolling restart: SIGTERM each replica in turn, restart it, wait SERVING
before the next. The client retries UNAVAILABLE on another replica, so no
logical call fails."""

from faults.scenario import Env, Scenario


class RollingRestart(Scenario):
    name = "rolling_restart"
    description = "SIGTERM each replica in turn and restart it (SERVING before the next); 0 failed calls"

    async def inject(self, env: Env) -> None:
        rounds = 0
        await env.sleep_load(0.5)
        while True:
            for replica in env.replicas:
                env.mark("fault")
                code = await replica.terminate()
                env.log(f"{replica.name} exited with {code}")
                await replica.start()
                env.mark("healed")
            rounds += 1
            if env.load_left() < 2.0:
                break
        env.note("rounds", rounds)

    def expect(self, report):
        failures = []
        if report.failed_calls or report.errors:
            failures.append(f"{sum(report.errors.values())} logical calls failed: {report.errors}")
        return failures


SCENARIO = RollingRestart()
