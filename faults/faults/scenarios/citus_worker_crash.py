"""A Citus worker crashed (pg_ctl stop -m immediate) under load and
restarted (issue 21), on a Citus coordinator and two workers of the
harness's own (faults/infra/citus.py), the replicas on the coordinator.

Keys whose shard is on the other worker must keep answering; keys on the
crashed worker's shards must answer UNAVAILABLE (never INTERNAL) and then
recover. A key's worker is read from the coordinator's metadata
(get_shard_id_for_distribution_column, pg_dist_placement, pg_dist_node).

Measured, besides the workload's history:
- probes: a Claim of a fresh key of each worker every 100 ms (no retries,
  one replica each time, round-robin, 3 s deadline), from before the crash
  to after the recovery. During the outage (the crash to the restart):
  each worker's share of probes answered OK and their codes. From the
  restart: the first probe of the crashed worker's keys answered OK (the
  recovery time);
- the workload's calls and attempts started during the outage, split by
  their key's worker: the share answered OK, and their codes;
- batch probes: every 200 ms a ClaimBatch with item_errors naming a fresh
  key of each worker, then a CompleteBatch with item_errors of what it
  claimed. During the outage every batch must be answered (no call fails),
  the live worker's items OK, the crashed worker's items UNAVAILABLE on
  their own; after the restart every item OK.

Runs only where Citus is installed (scenarios/_citus.py)."""

import asyncio
import collections
import random

from faults.scenario import Env
from faults.scenarios._citus import BatchProbes, CitusScenario, Probes, odd_codes


class CitusWorkerCrash(CitusScenario):
    name = "citus_worker_crash"
    description = ("Citus: one of 2 workers stopped with pg_ctl stop -m immediate under load, restarted after "
                   "a few seconds; keys on the other worker keep answering, the crashed one's answer "
                   "UNAVAILABLE, then recover")
    ci_duration = 6.0
    #: seconds the worker stays down (--ci: ci_outage)
    outage = 5.0
    ci_outage = 2.0
    #: probes answered OK for the live worker's keys during the outage, at least
    live_ok_share = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.ports = {}
        self._window = None
        self._healed = None

    async def inject(self, env: Env) -> None:
        self._window = None
        cluster = self.cluster
        shards = await self.distributed(env)
        if len(shards) != 2:
            raise RuntimeError(f"shards on {len(shards)} nodes, 2 workers expected: {shards}")
        crashed = random.choice(cluster.workers)
        live = next(w for w in cluster.workers if w is not crashed)
        names = {crashed.port: "crashed", live.port: "live"}
        candidates = [f"probe-{i}" for i in range(4000)]
        probe_ports = await asyncio.to_thread(cluster.ports_of, candidates)
        keys = {"live": [k for k in candidates if probe_ports[k] == live.port],
                "crashed": [k for k in candidates if probe_ports[k] == crashed.port]}
        probes = Probes(env, keys, "faults-citus-probe", every=0.1, timeout=3.0).start()
        batch_candidates = [f"batch-{i}" for i in range(4000)]
        batch_ports = await asyncio.to_thread(cluster.ports_of, batch_candidates)
        batch_keys = {"live": [k for k in batch_candidates if batch_ports[k] == live.port],
                      "crashed": [k for k in batch_candidates if batch_ports[k] == crashed.port]}
        batches = BatchProbes(env, batch_keys, "faults-citus-batch", every=0.2, timeout=3.0).start()
        try:
            await env.sleep_load(1.5)
            outage = self.ci_outage if env.ci else self.outage
            fault = env.mark("fault")
            await asyncio.to_thread(crashed.stop, "immediate")
            env.log(f"{crashed.name} (port {crashed.port}) stopped -m immediate")
            await asyncio.sleep(outage)
            restart = env.now()
            await asyncio.to_thread(crashed.start)  # pg_ctl start -w: accepting connections
            healed = env.mark("healed")
            env.history.mark("restart", restart)
            recovered = None
            while recovered is None and env.now() < healed + 30:
                await asyncio.sleep(0.05)
                recovered = probes.first_ok("crashed", healed)
            if recovered is not None:
                env.history.mark("recovered", recovered)
                env.log(f"{crashed.name}'s keys answer OK {recovered - healed:.3f} s after its restart")
            await asyncio.sleep(1.0)
        finally:
            await probes.stop()
            await batches.stop()
        self.ports = {k: names.get(p, str(p))
                      for k, p in (await asyncio.to_thread(cluster.ports_of, env.history.keys)).items()}
        env.note("crashed", {"node": crashed.name, "port": crashed.port, "shards": shards.get(crashed.port)})
        env.note("outage_s", round(restart - fault, 3))
        env.note("probes_during_outage", {g: Probes.tally(probes.window(g, fault, restart)) for g in keys})
        first = min((r["end"] for r in probes.window("crashed", fault, restart) if r["code"] != "OK"),
                    default=None)
        env.note("crashed_first_error_after_crash_s", None if first is None else round(first - fault, 3))
        env.note("probes_after_restart", {g: Probes.tally(probes.window(g, healed, env.now())) for g in keys})
        env.note("recovered_after_restart_s", None if recovered is None else round(recovered - healed, 3))
        env.note("batches_during_outage", BatchProbes.tally(batches.window(fault, restart)))
        env.note("batches_after_restart", BatchProbes.tally(batches.window(healed, env.now())))
        env.note("batch_errors", sorted({r.get("error", "")[:200] for r in batches.rows if r["call"] != "OK"})[:5])
        env.note("probe_errors", sorted({r.get("error", "")[:200] for r in probes.rows if r["code"] != "OK"})[:5])
        self._window = (fault, restart)
        self._healed = healed

    def _by_worker(self, report) -> dict:
        """The workload's calls and attempts started during the outage, by
        their key's worker (live / crashed): how many, how many OK, codes."""
        fault, restart = self._window
        calls = {c["id"]: c for c in report.history.calls}
        out = {}
        for kind, rows in (("calls", report.history.calls), ("attempts", report.history.attempts)):
            groups = collections.defaultdict(collections.Counter)
            for row in rows:
                if not fault <= row["start"] < restart:
                    continue
                key = row.get("key") or calls.get(row.get("call"), {}).get("key")
                groups[self.ports.get(key, "unknown")][row["code"]] += 1
            for group, codes in groups.items():
                n = sum(codes.values())
                out.setdefault(group, {})[kind] = {"n": n, "ok_share": round(codes["OK"] / n, 4) if n else None,
                                                   "codes": dict(codes)}
        return out

    def expect(self, report):
        failures = odd_codes(report)
        if self._window is None:
            return failures + ["the worker was never crashed"]
        report.notes["workload_during_outage"] = self._by_worker(report)
        probes = report.notes["probes_during_outage"]
        live, crashed = probes["live"], probes["crashed"]
        if not live["probes"] or live["ok_share"] < self.live_ok_share:
            failures.append(f"keys on the live worker: {live['ok_share']} of {live['probes']} probes answered OK "
                            f"during the outage ({live['codes']}), {self.live_ok_share} expected")
        odd = {c: n for c, n in crashed["codes"].items() if c not in ("UNAVAILABLE", "OK")}
        if odd:
            failures.append(f"keys on the crashed worker answered {odd} during the outage, UNAVAILABLE expected")
        if not crashed["codes"].get("UNAVAILABLE"):
            failures.append(f"no probe of the crashed worker's keys answered UNAVAILABLE: {crashed['codes']}")
        failures += self._batch_failures(report)
        if report.notes.get("recovered_after_restart_s") is None:
            failures.append("the crashed worker's keys never answered OK within 30 s of its restart")
        # Once the worker accepts connections again (pg_ctl start -w
        # returned), no attempt may fail: no connection of the coordinator's
        # cached from before the crash may surface.
        after = report.failed_attempts_after_by_code(self._healed)
        report.notes["failed_attempts_after_restart"] = after
        if after:
            failures.append(f"{sum(after.values())} attempts failed after the worker's restart: {after}")
        after = {c: n for c, n in report.notes["probes_after_restart"]["crashed"]["codes"].items() if c != "OK"}
        if after:
            failures.append(f"probes of the crashed worker's keys failed after its restart: {after}")
        return failures

    @staticmethod
    def _batch_failures(report) -> list:
        """With item_errors, a worker down fails only its own items."""
        failures = []
        during, after = report.notes["batches_during_outage"], report.notes["batches_after_restart"]
        if not during["batches"]:
            failures.append("no batch probe ran during the outage")
        if set(during["calls"]) - {"OK"}:
            failures.append(f"batches with item_errors failed as a whole during the outage: {during['calls']} "
                            f"({report.notes['batch_errors']})")
        live = during["claim"].get("live", {})
        if set(live) - {"OK"}:
            failures.append(f"the live worker's ClaimBatch items during the outage: {live}, all OK expected")
        crashed = during["claim"].get("crashed", {})
        if not crashed.get("UNAVAILABLE") or set(crashed) - {"UNAVAILABLE", "OK"}:
            failures.append(f"the crashed worker's ClaimBatch items during the outage: {crashed}, "
                            "UNAVAILABLE expected")
        completes = during["complete"].get("live", {})
        if set(completes) - {"OK"}:
            failures.append(f"the live worker's CompleteBatch items during the outage: {completes}, all OK expected")
        odd = {part: codes for part in ("claim", "complete") for codes in [after[part]]
               if any(set(c) - {"OK"} for c in codes.values())}
        if set(after["calls"]) - {"OK"} or odd:
            failures.append(f"batch probes failed after the restart: calls {after['calls']}, items {odd}")
        return failures


SCENARIO = CitusWorkerCrash()
