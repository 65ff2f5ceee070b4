"""The network between the replicas and PostgreSQL: a partition (every
packet dropped), 200 ms added delay, 5% loss, each healed in turn.

The replicas run in a network namespace of their own (`ip netns exec` is
their wrapper); two veth pairs join it to the host: one carries the
replicas' database traffic, the other the clients' gRPC calls (the replicas
listen on the namespace's end of it), so a fault on the first leaves the
second alone. See faults/infra/net.py.

- partition: nftables in the namespace drops everything on the database
  link, both ways (no RST: connections hang, as behind a dead link);
- delay: `tc netem delay 200ms` on the namespace's end when the kernel has
  sch_netem; this machine's kernel is built without it, so then the TCP
  relay that carries the database link (always in the path, host side)
  holds every byte from the replicas 200 ms before passing it on;
- loss: nftables `numgen random mod 100 < 5 drop`, both ways.

Expectations: the six counts are 0; no call outlives its deadline; no
attempt waits longer than IDEMPOTENCY_DB_TIMEOUT plus a margin (UNAVAILABLE
arrives within the DB timeout); after each heal the service resumes by
itself (recovery time measured from "healed" to the last failed attempt);
errors are UNAVAILABLE or DEADLINE_EXCEEDED only (or FAILED_PRECONDITION:
a lease that ran out during the partition).

The workload's Claims wait for another holder on the server (once()'s
default, ClaimRequest.wait), and waiting for a holder is not waiting for the
database: an answered attempt of a Claim that asked to wait is held to the
DB timeout plus the margin beyond the `waited` its answer reports; one that
failed (no `waited` to subtract) to the wait it asked plus the DB timeout
and the margin. How many of those failed later than the DB timeout plus the
margin, and the longest, are in the notes
(`waiting_claims_failed_after_limit`).
"""

from __future__ import annotations

import asyncio
import collections
import os

from faults.infra.net import NetNs, netem_available
from faults.scenario import Env, Scenario

#: The replicas' database timeout in this scenario, seconds.
DB_TIMEOUT = 2.0
#: What an attempt may take beyond it: the call's own work and scheduling
#: on a loaded 2-core machine.
MARGIN = 1.0
#: Faults in the order they are injected, with how long each lasts (s):
#: (name, --ci, longer run).
PHASES = [("partition", 5.0, 10.0), ("delay", 2.0, 10.0), ("loss", 2.0, 10.0)]
#: Load between a heal and the next fault (s): (--ci, longer run).
GAP = (1.5, 5.0)


class Network(Scenario):
    name = "network"
    description = ("replicas in a network namespace; the link to PostgreSQL partitioned, delayed 200 ms, "
                   "5% loss, each healed; UNAVAILABLE within the DB timeout, service resumes by itself")
    replicas = 3
    store = "postgres"
    ci_duration = 14.0
    workload = {"call_timeout": 10.0, "lease_ttl": 3.0}

    def __init__(self) -> None:
        self.net: NetNs | None = None
        #: coalescing on (the default) or off, for comparison:
        #: FAULTS_NETWORK_COALESCE=false
        self.coalesce = os.environ.get("FAULTS_NETWORK_COALESCE", "")

    def available(self):
        if os.geteuid() != 0:
            return "needs root (network namespaces, nftables)"
        return None

    async def prepare(self, env: Env) -> None:
        self.net = await asyncio.to_thread(lambda: NetNs().create())
        env.add_cleanup(self.net.remove)
        relay = await asyncio.to_thread(self.net.start_relay, env.pg.host, env.pg.port,
                                        str(env.tmpdir / "relay.log"))
        env.database_url = f"postgres://postgres@{self.net.db_host}:{relay.port}/idempotency"
        env.replica_env["IDEMPOTENCY_DB_TIMEOUT"] = f"{DB_TIMEOUT:g}s"
        if self.coalesce:
            env.replica_env["IDEMPOTENCY_COALESCE"] = self.coalesce
        for i in range(self.replicas):
            env.wrappers[i] = self.net.wrapper
            env.hosts[i] = self.net.client_ns
        env.note("netns", f"{self.net.name}: db link {self.net.db_ns}->{self.net.db_host}:{relay.port} (relay to "
                          f"{env.pg.host}:{env.pg.port}), replicas listen on {self.net.client_ns}")
        env.note("delay_by", "tc netem" if netem_available() else "relay delay line (no sch_netem in this kernel)")
        if not env.ci:
            env.workload.duration = max(env.workload.duration, sum(p[2] + GAP[1] for p in PHASES) + GAP[1])

    async def inject(self, env: Env) -> None:
        net = self.net
        gap = GAP[0] if env.ci else GAP[1]
        self.phases = []
        await env.sleep_load(gap)
        for name, ci_len, long_len in PHASES:
            start = env.mark("fault")
            env.mark(f"fault_{name}")
            if name == "partition":
                await asyncio.to_thread(net.partition)
            elif name == "delay":
                await asyncio.to_thread(net.delay, 200)
            else:
                await asyncio.to_thread(net.loss, 5)
            env.log(f"{name} on")
            await asyncio.sleep(ci_len if env.ci else long_len)
            await asyncio.to_thread(net.heal)
            healed = env.mark("healed")
            env.mark(f"healed_{name}")
            env.log(f"{name} healed")
            if name == "partition":
                # Resumes by itself: health SERVING again on every replica.
                serving = await env.wait_serving(timeout=30)
                env.history.mark("serving", serving)
                env.note("partition_serving_after_heal_s", round(serving - healed, 3))
            self.phases.append((name, start, healed))
            await asyncio.sleep(gap)

    def expect(self, report):
        failures = []
        attempts = report.history.attempts if report.history is not None else []
        calls = {c["id"]: c for c in report.history.calls} if report.history is not None else {}
        limit = DB_TIMEOUT + MARGIN

        def allowed(a) -> float:
            """How long the attempt may take: the limit, plus, for a Claim that
            asked to wait, the time it waited for the holder (what its answer
            says, or when it failed, the wait it asked)."""
            call = calls.get(a.get("call"))
            if a.get("op") != "Claim" or call is None or not call.get("wait"):
                return limit
            if a["code"] == "OK":
                return limit + (call.get("waited") or 0.0)
            return limit + call["wait"]

        # Every attempt, whatever its answer: one that waited on an
        # unreachable database for longer than the DB timeout broke the promise
        # even when the heal let it end OK.
        slow = [a for a in attempts if a["end"] - a["start"] > allowed(a)]
        longest = max((a["end"] - a["start"] for a in attempts if a.get("code") == "UNAVAILABLE"), default=0.0)
        report.notes["longest_unavailable_attempt_s"] = round(longest, 3)
        report.notes["attempts_over_db_timeout_plus_margin"] = len(slow)
        waiting_failed = [a for a in attempts if a["code"] != "OK" and allowed(a) > limit
                          and a["end"] - a["start"] > limit]
        report.notes["waiting_claims_failed_after_limit"] = {
            "count": len(waiting_failed),
            "longest_s": round(max((a["end"] - a["start"] for a in waiting_failed), default=0.0), 3)}
        for name, start, _ in [(p, report.mark(f"fault_{p}"), None) for p, _, _ in PHASES]:
            healed = report.mark(f"healed_{name}")
            if start is None or healed is None:
                failures.append(f"{name}: not injected/healed")
                continue
            inside = [a for a in attempts if start <= a["start"] < healed]
            codes = collections.Counter(a["code"] for a in inside)
            worst = max((a["end"] - a["start"] for a in inside), default=0.0)
            later = [a for a in attempts if a["start"] >= healed and a["code"] not in ("OK", None)]
            nxt = min((t for t in report.marks.get("fault", []) if t > healed), default=float("inf"))
            failed_after = [a["end"] for a in attempts if a["end"] >= healed and a["start"] < nxt
                            and a["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                                              "INTERNAL", "UNKNOWN")]
            report.notes[f"{name}_attempts"] = dict(codes)
            report.notes[f"{name}_longest_attempt_s"] = round(worst, 3)
            report.notes[f"{name}_recovery_s"] = round(max(failed_after) - healed, 3) if failed_after else 0.0
            del later
        if slow:
            examples = sorted(slow, key=lambda a: a["start"] - a["end"])[:3]
            failures.append(
                f"{len(slow)} attempts took longer than DB timeout {DB_TIMEOUT:g}s + {MARGIN:g}s "
                f"(beyond their wait for a holder; longest UNAVAILABLE {longest:.2f}s), e.g. "
                + "; ".join(f"{a.get('op', '?')} {a['start']:.2f}->{a['end']:.2f} {a['code']}" for a in examples))
        # FAILED_PRECONDITION: a lease that ran out during the partition (the
        # Complete or Release of its holder is refused, as it must be).
        odd = {c: n for c, n in report.errors.items()
               if c not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION")}
        if odd:
            failures.append(f"calls failed with codes other than UNAVAILABLE / DEADLINE_EXCEEDED / "
                            f"FAILED_PRECONDITION: {odd}")
        serving = report.mark("serving")
        if serving is None:
            failures.append("health never SERVING again after the partition healed")
        if report.recovery_s is not None and report.recovery_s > 15:
            failures.append(f"no recovery within 15 s of a heal ({report.recovery_s} s)")
        return failures

    async def cleanup(self, env: Env) -> None:
        if self.net is not None:
            await asyncio.to_thread(self.net.remove)


SCENARIO = Network()
