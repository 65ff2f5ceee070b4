"""kill -9 of a replica every few seconds, restarted at once."""

import random

from faults.scenario import Env, Scenario


class Kill9(Scenario):
    name = "kill9"
    description = "SIGKILL of a random replica every ~1.5 s, restarted at once (3 replicas, one PostgreSQL)"
    #: seconds between kills
    interval = 1.5

    async def inject(self, env: Env) -> None:
        kills = 0
        while env.load_left() > self.interval:
            await env.sleep_load(self.interval)
            replica = random.choice(env.replicas)
            env.mark("fault")
            await replica.kill()
            kills += 1
            await replica.start()  # back once SERVING
            env.mark("healed")
        env.note("kills", kills)

    def expect(self, report):
        failures = []
        if report.notes.get("kills", 0) < 1:
            failures.append("no replica was killed")
        if report.failed_calls:
            failures.append(f"{report.failed_calls} logical calls failed (retries on another replica "
                            f"should hide a killed one): {report.errors}")
        return failures


SCENARIO = Kill9()
