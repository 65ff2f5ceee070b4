"""Runs scenarios: sets up the cluster, the replicas and the ledger, runs the
workload with the scenario's fault, checks the history, cleans up."""

from __future__ import annotations

import asyncio
import importlib
import os
import json
import pathlib
import pkgutil
import shutil
import tempfile
import time
import traceback
from typing import Dict, List, Optional, Tuple

from . import scenarios as scenarios_pkg
from .checker import COUNTS, Report, check
from .cluster import PgCluster
from .scenario import Env
from .workload import History, Ledger, Options, Workload

OUT = pathlib.Path(__file__).resolve().parents[1] / "out"

#: seconds of load per scenario in --ci
CI_DURATION = 4.0
#: after the final check, how long every replica has to answer health SERVING
HEALTH_AT_END_TIMEOUT = 10.0
#: seconds of load per scenario otherwise
DEFAULT_DURATION = 20.0


def verbose() -> bool:
    return os.environ.get("FAULTS_VERBOSE", "") not in ("", "0")


def discover() -> Dict[str, object]:
    """Every module in faults/scenarios/ that exports SCENARIO, by name.
    A module that fails to import is returned as the error text."""
    found: Dict[str, object] = {}
    for info in sorted(pkgutil.iter_modules(scenarios_pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{scenarios_pkg.__name__}.{info.name}")
        except Exception:
            found[info.name] = f"import failed:\n{traceback.format_exc()}"
            continue
        scenario = getattr(module, "SCENARIO", None)
        if scenario is not None:
            found[getattr(scenario, "name", info.name)] = scenario
    return found


async def run_scenario(scenario, ci: bool, duration: Optional[float], command: str) -> Report:
    options = Options(**getattr(scenario, "workload", {}) or {})
    if duration is not None:
        options.duration = duration
    elif ci:
        options.duration = getattr(scenario, "ci_duration", None) or CI_DURATION
    elif "duration" not in (getattr(scenario, "workload", {}) or {}):
        options.duration = DEFAULT_DURATION
    tmpdir = pathlib.Path(tempfile.mkdtemp(prefix=f"faults-{scenario.name}-"))
    history = History()
    env = Env(scenario, ci, tmpdir, history, options)
    ledger = Ledger()
    workload: Optional[Workload] = None
    errors: List[str] = []
    report: Optional[Report] = None
    started = time.monotonic()

    def phase(what: str) -> None:
        if verbose():
            print(f"    [{scenario.name} +{time.monotonic() - started:6.1f}s] {what}", flush=True)

    try:
        reason = scenario.available() if hasattr(scenario, "available") else None
        if reason:
            raise RuntimeError(f"cannot run here: {reason}")
        if scenario.store == "postgres" and not getattr(scenario, "own_database", False):
            env.pg = PgCluster()  # its own temp folder (owned by postgres when root)
            await asyncio.to_thread(env.pg.start)
            await asyncio.to_thread(env.pg.psql, "CREATE DATABASE idempotency")
            env.database_url = env.pg.database_url("idempotency")
        await ledger.open()
        await scenario.prepare(env)
        await env.start_replicas()
        phase("replicas SERVING")
        history.t0 = time.monotonic()  # time 0: the load starts
        history.wall0 = time.time()
        workload = Workload(env.targets, options, history, ledger, namespace=f"faults-{scenario.name}")
        await workload.start()
        inject = asyncio.create_task(scenario.inject(env))
        limit = options.duration + 120
        await asyncio.wait([inject], timeout=limit)
        phase("inject() returned")
        if not inject.done():
            inject.cancel()
            errors.append(f"inject() still running after {limit:.0f} s")
        elif not inject.cancelled() and inject.exception() is not None:
            raise inject.exception()
        end = max(options.duration, history.now() + options.tail)
        await asyncio.sleep(max(0.0, end - history.now()))
        await workload.stop_load()
        phase("load stopped, deliveries drained")
        await workload.final_check()
        phase("final check done")
        if getattr(scenario, "health_at_end", True):
            # The service resumes by itself: every running replica SERVING.
            health = {r.name: "not running" for r in env.replicas if not r.running()}
            try:
                await env.wait_serving(timeout=HEALTH_AT_END_TIMEOUT)
            except Exception:
                health.update({r.name: await r.health() for r in env.replicas if r.running()})
                errors.append(f"health at the end, {HEALTH_AT_END_TIMEOUT:.0f} s after the final check: {health}")
    except Exception:
        errors.append(f"scenario error:\n{traceback.format_exc()}")
    finally:
        if workload is not None:
            try:
                await workload.abort()
                await workload.close()
            except Exception:
                pass
        report = check(history, scenario.name)
        report.notes.update(env.notes)
        # A run whose workload did no work proves nothing, whatever its counts.
        if history.workload_errors:
            errors.append(f"the workload itself failed {len(history.workload_errors)} time(s): "
                          f"{history.workload_errors[:3]}")
        if not history.effects:
            errors.append("the workload applied no effect: the run exercised nothing")
        report.command = command
        if not errors:
            try:
                report.failures.extend(scenario.expect(report) or [])
            except AssertionError as error:
                report.failures.append(f"expect: {error}")
            except Exception:
                report.failures.append(f"expect() raised:\n{traceback.format_exc()}")
        phase("cleanup")
        try:
            await scenario.cleanup(env)
        except Exception:
            errors.append(f"cleanup() raised:\n{traceback.format_exc()}")
        errors.extend(await env.run_cleanups())
        for replica in env.replicas:
            replica.stop_now()
        if env.pg is not None:
            await asyncio.to_thread(env.pg.destroy)
        await ledger.close()
        OUT.mkdir(exist_ok=True)
        try:
            history.dump(OUT / f"{scenario.name}.history.jsonl")
            logs = OUT / f"{scenario.name}.logs"
            shutil.rmtree(logs, ignore_errors=True)
            if (tmpdir / "logs").exists():
                shutil.copytree(tmpdir / "logs", logs)
            if env.pg is not None and env.pg.logfile.exists():
                shutil.copy(env.pg.logfile, logs / "postgres.log") if logs.exists() else None
        except Exception:
            pass
        shutil.rmtree(tmpdir, ignore_errors=True)
    report.failures = errors + report.failures
    report.notes["wall_s"] = round(time.monotonic() - started, 1)
    (OUT / f"{scenario.name}.json").write_text(json.dumps(report.summary(), indent=2, default=str))
    return report


def fmt(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: Report) -> None:
    status = "ok" if report.ok else "FAILED"
    counts = " ".join(f"{k}={v}" for k, v in report.counts.items())
    print(f"== {report.scenario}: {status}", flush=True)
    print(f"   calls={report.calls} attempts={report.attempts} keys={report.keys} load={report.load_s}s "
          f"failed_calls={report.failed_calls} recovery={fmt(report.recovery_s)}s "
          f"p50={fmt(report.latency['p50'])}s p99={fmt(report.latency['p99'])}s max={fmt(report.latency['max'])}s")
    print(f"   errors={report.errors or {}} attempt_errors={report.attempt_errors or {}}")
    print(f"   counts: {counts}")
    if report.counters:
        print(f"   workload: {report.counters}")
    if report.notes:
        print(f"   notes: {json.dumps(report.notes, default=str)}")
    for name, examples in report.examples.items():
        for example in examples:
            print(f"   {name}: {example}")
    for failure in report.failures:
        print("   FAILED: " + failure.replace("\n", "\n           "))


async def run_all(names: List[str], ci: bool, duration: Optional[float],
                  command: str) -> Tuple[bool, List[Report], Dict[str, str]]:
    """Runs the scenarios named (default: all; in --ci those with `ci`):
    (every scenario run passed, their reports, {name: why} of those not run)."""
    found = discover()
    # In --ci, scenarios with `ci = False` (long soaks) run only when named.
    selected = names or [n for n, s in found.items() if not ci or getattr(s, "ci", True)]
    unknown = [n for n in selected if n not in found]
    if unknown:
        print(f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(found)}")
        return False, [], {}
    ok = True
    reports = []
    not_run: Dict[str, str] = {}
    for name in selected:
        scenario = found[name]
        if isinstance(scenario, str):
            print(f"== {name}: FAILED\n   {scenario}")
            ok = False
            continue
        reason = scenario.not_run() if hasattr(scenario, "not_run") else None
        if reason:
            # Neither passed nor failed: one line, and a report that says so.
            print(f"== {name}: not run: {reason}", flush=True)
            not_run[name] = reason
            OUT.mkdir(exist_ok=True)
            (OUT / f"{name}.json").write_text(json.dumps(
                {"scenario": name, "ok": None, "not_run": reason, "command": f"{command} {name}"}, indent=2))
            continue
        print(f"-- {name}: {getattr(scenario, 'description', '')}", flush=True)
        cmd = f"{command} {name}".strip()
        report = await run_scenario(scenario, ci, duration, cmd)
        print_report(report)
        reports.append(report)
        ok = ok and report.ok
    return ok, reports, not_run
