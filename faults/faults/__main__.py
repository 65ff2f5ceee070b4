"""python -m faults [--ci] [--duration S] [--list] [SCENARIO...]"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from .runner import discover, run_all


async def _main(args, command):
    """run_all(), cancelled by SIGTERM/SIGINT so that every cleanup runs."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await run_all(args.scenarios, args.ci, args.duration, command)
    except asyncio.CancelledError:
        print("faults: interrupted; cleaned up", flush=True)
        return False, [], {}


def main() -> int:
    parser = argparse.ArgumentParser(prog="faults", description="fault-injection scenarios against idempotency-service")
    parser.add_argument("scenarios", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--ci", action="store_true", help="bounded run: a few seconds of load per scenario")
    parser.add_argument("--duration", type=float, default=None, help="seconds of load per scenario")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args()
    if args.list:
        for name, scenario in discover().items():
            print(f"{name:18} {scenario if isinstance(scenario, str) else getattr(scenario, 'description', '')}")
        return 0
    command = "faults/run.sh" + (" --ci" if args.ci else "") + (f" --duration {args.duration:g}" if args.duration else "")
    started = time.monotonic()
    ok, reports, not_run = asyncio.run(_main(args, command))
    # Scenarios not run (Citus absent) count neither as ok nor as failed.
    skipped = f"; {len(not_run)} not run ({', '.join(not_run)})" if not_run else ""
    print(f"faults: {len(reports)} scenario(s) run in {time.monotonic() - started:.0f} s: "
          f"{('all ok' if reports else 'none') if ok else 'FAILED'}{skipped}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
