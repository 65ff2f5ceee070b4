"""The scenario interface (Scenario) and what a scenario gets to work with (Env).

A scenario module in faults/scenarios/ exports SCENARIO, an instance of a
Scenario subclass (or any object with the same attributes). The runner
(faults/runner.py) does, for each scenario:

    SCENARIO.not_run()                  # a reason: "not run" (one line), next scenario
    env.pg = PgCluster().start()        # store "postgres": a throwaway cluster,
                                        # database "idempotency" created
    await SCENARIO.prepare(env)         # before the replicas start
    await env.start_replicas()          # SCENARIO.replicas processes, SERVING
    workload starts                     # env.history.t0 is "time 0"
    await SCENARIO.inject(env)          # concurrently with the workload
    load continues env.workload.tail s, then until env.workload.duration
    deliveries drain; final Claim of every key
    report = check(history); SCENARIO.expect(report) -> failures
    await SCENARIO.cleanup(env)         # always, even after a failure
    env's cleanups (LIFO), replicas killed, cluster destroyed, ledger dropped
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

from .cluster import PgCluster, Replica
from .workload import History, Options


class Env:
    """What a scenario sees. Attributes a scenario may change in prepare():
    database_url, replica_env, replica_envs, wrappers, hosts, data_dir, workload
    (an Options), client_targets."""

    def __init__(self, scenario, ci: bool, tmpdir: pathlib.Path, history: History, options: Options):
        self.scenario = scenario
        #: True in the bounded CI run (keep faults short)
        self.ci = ci
        #: a scratch folder of this run (deleted at the end); logs go here too
        self.tmpdir = tmpdir
        self.history = history
        #: the workload's knobs (consumers, duration, lease_ttl, ...)
        self.workload: Options = options
        #: the throwaway PostgreSQL cluster (store "postgres"), else None
        self.pg: Optional[PgCluster] = None
        #: the URL the replicas use (store "postgres"); prepare() may point it
        #: elsewhere (a pgbouncer, a standby's address, a netns address)
        self.database_url: Optional[str] = None
        #: folder of the embedded SQLite store (store "sqlite"): replica 0
        #: uses it, replica i > 0 uses data_dir/replica<i>
        self.data_dir: pathlib.Path = tmpdir / "data"
        #: settings for every replica (over the harness's defaults)
        self.replica_env: Dict[str, str] = {}
        #: settings for replica i only (over replica_env)
        self.replica_envs: Dict[int, Dict[str, str]] = {}
        #: command prefix for replica i (["faketime", "-f", "+1h"], ...)
        self.wrappers: Dict[int, List[str]] = {}
        #: listen host of replica i (default 127.0.0.1)
        self.hosts: Dict[int, str] = {}
        #: the replicas, once started (in order)
        self.replicas: List[Replica] = []
        #: where the workload's client connects; None: every replica's target
        self.client_targets: Optional[List[str]] = None
        #: scenario figures for the report (env.note())
        self.notes: Dict[str, Any] = {}
        self._cleanups: List[Callable[[], Any]] = []

    # -- time and notes ----------------------------------------------------
    def now(self) -> float:
        """Seconds since the workload started (the history's clock)."""
        return self.history.now()

    def mark(self, name: str) -> float:
        """Record an instant under `name` ("fault", "healed", "serving", ...);
        the report has every mark, report.mark(name) the last one. "fault" and
        "healed" marks give the recovery time."""
        return self.history.mark(name)

    def note(self, name: str, value: Any) -> None:
        """A figure for the report (report.notes[name], printed and in docs)."""
        self.notes[name] = value

    def log(self, message: str) -> None:
        print(f"    [{self.scenario.name} {self.now():7.3f}] {message}", flush=True)

    def add_cleanup(self, fn: Callable[[], Any]) -> None:
        """Run fn() (sync or async) at the end, even on failure; last added, first run."""
        self._cleanups.append(fn)

    # -- replicas ----------------------------------------------------------
    @property
    def targets(self) -> List[str]:
        return list(self.client_targets) if self.client_targets else [r.target for r in self.replicas]

    def replica_settings(self, index: int) -> Dict[str, str]:
        env: Dict[str, str] = {}
        if self.scenario.store == "postgres":
            env["DATABASE_URL"] = self.database_url
        else:
            data_dir = self.data_dir if index == 0 else self.data_dir / f"replica{index}"
            data_dir.mkdir(parents=True, exist_ok=True)
            env["IDEMPOTENCY_DATA_DIR"] = str(data_dir)
        env["IDEMPOTENCY_REAPER_INTERVAL"] = f"{self.workload.reaper_interval}s"
        env.update(self.replica_env)
        env.update(self.replica_envs.get(index, {}))
        return env

    async def start_replicas(self, timeout: float = 60.0) -> List[Replica]:
        """Create and start every replica (SERVING when this returns)."""
        for i in range(self.scenario.replicas):
            self.replicas.append(Replica(self.replica_settings(i), wrapper=self.wrappers.get(i),
                                         name=f"replica{i}", log_dir=self.tmpdir / "logs",
                                         host=self.hosts.get(i, "127.0.0.1")))
        await asyncio.gather(*(r.start(timeout=timeout) for r in self.replicas))
        return self.replicas

    async def wait_serving(self, replicas: Optional[List[Replica]] = None, timeout: float = 30.0) -> float:
        """Wait until every replica (running ones of `replicas`, default all)
        answers health SERVING; returns the instant (env.now()) it did."""
        replicas = [r for r in (replicas or self.replicas) if r.running()]
        await asyncio.gather(*(r.wait_serving(timeout) for r in replicas))
        return self.now()

    async def wait_health(self, status: str, replicas: Optional[List[Replica]] = None,
                          timeout: float = 30.0) -> float:
        """Wait until every replica has answered health `status` (e.g.
        "NOT_SERVING") at least once; returns env.now() then."""
        replicas = list(replicas or self.replicas)
        deadline = time.monotonic() + timeout

        async def one(r: Replica) -> None:
            while True:
                if await r.health(timeout=0.5) == status:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{r.name} never answered health {status} within {timeout} s")
                await asyncio.sleep(0.05)

        await asyncio.gather(*(one(r) for r in replicas))
        return self.now()

    async def sleep_load(self, seconds: float) -> None:
        """Sleep, but not past the end of the load's duration (so inject() can
        pace itself on env.load_left())."""
        await asyncio.sleep(max(0.0, min(seconds, self.load_left())))

    def load_left(self) -> float:
        """Seconds of the load's duration still to come."""
        return max(0.0, self.workload.duration - self.now())

    async def sh(self, *argv: str, check: bool = True, timeout: float = 60.0) -> str:
        """Run a command (off the event loop); its stdout. Raises on failure with `check`."""
        result = await asyncio.to_thread(subprocess.run, list(argv), capture_output=True, text=True,
                                         timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    async def run_cleanups(self) -> List[str]:
        errors = []
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                value = fn()
                if asyncio.iscoroutine(value):
                    await value
            except Exception as error:  # keep cleaning
                errors.append(f"cleanup {getattr(fn, '__name__', fn)}: {error}")
        return errors


class Scenario:
    """Base class of the scenarios; override what you need."""

    #: the name (the module's name, by convention); `run.sh NAME` runs it
    name: str = "unnamed"
    #: one line for the report and docs/reliability.md
    description: str = ""
    #: how many replicas
    replicas: int = 3
    #: "postgres" (a throwaway cluster, env.pg) or "sqlite" (env.data_dir)
    store: str = "postgres"
    #: store "postgres" with a database of the scenario's own: no env.pg is
    #: made, prepare() sets env.database_url (the patroni scenario)
    own_database: bool = False
    #: Options fields to set (consumers, duration, lease_ttl, ...); the CI
    #: run's duration wins over a "duration" here unless ci_duration is set
    workload: Dict[str, Any] = {}
    #: seconds of load in the --ci run (None: the runner's default)
    ci_duration: Optional[float] = None
    #: after the final check, every running replica must answer health
    #: SERVING within 10 s (the service resumes by itself); False: not checked
    health_at_end: bool = True
    #: False: left out of `run.sh --ci` unless named (long soaks)
    ci: bool = True

    def available(self) -> Optional[str]:
        """None when the scenario can run here, else why not (a missing tool
        that run.sh could not install...): the run then fails with that reason."""
        return None

    def not_run(self) -> Optional[str]:
        """None when the scenario runs here, else why it does not: something
        the project never installs is absent (Citus). The run prints that
        reason on one line and reports the scenario as not run: neither
        passed nor failed, and the exit status is not changed by it."""
        return None

    async def prepare(self, env: Env) -> None:
        """Before the replicas start: set env.replica_env, env.database_url,
        env.wrappers, env.pg.conf(...), start helpers, add cleanups."""

    async def inject(self, env: Env) -> None:
        """While the workload runs: inject the fault(s), heal, env.mark(...)."""

    async def cleanup(self, env: Env) -> None:
        """Always called at the end, after a failure too."""

    def expect(self, report) -> List[str]:
        """Scenario-specific expectations: the list of those that failed
        (empty: all held). The six counts are checked by the runner."""
        return []
