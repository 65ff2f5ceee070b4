"""A three-step job that survives its worker being killed between steps and
does each step once: the "Resumable work" example of docs/clients.md, run as
a worker process by test_checkpoints.py.

    python resumable_job.py TARGET NAMESPACE JOB_ID LOG [--lease-ttl S] [--die-after STEP]

Each step appends a line to LOG (its effect, in place of a charge or an
email). After each step the job saves a checkpoint, the list of steps done,
under its lease. --die-after STEP kills the worker (SIGKILL) right after that
step's checkpoint is saved; the next worker to run the job, once the dead
one's lease has run out, receives the checkpoint and does the rest only.
"""

import argparse
import json
import os
import signal

from idempotency_client import IdempotencyClient

STEPS = ["reserve", "charge", "email"]


def do_step(step, job_id, fencing_token, log_path):
    """The step's effect: a line in the log, on disk before the checkpoint."""
    with open(log_path, "a") as log:
        log.write(f"{step} {job_id} pid={os.getpid()} fencing={fencing_token}\n")
        log.flush()
        os.fsync(log.fileno())


def job(job_id, log_path, die_after=None, *, run):
    # run.checkpoint: what the last worker saved (None the first time).
    done = json.loads(run.checkpoint) if run.checkpoint is not None else []
    for step in STEPS:
        if step in done:
            continue
        do_step(step, job_id, run.fencing_token, log_path)
        done.append(step)
        run.save_checkpoint(json.dumps(done).encode())
        if step == die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker dies between two steps
    return done


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("namespace")
    parser.add_argument("job_id")
    parser.add_argument("log")
    parser.add_argument("--lease-ttl", type=float, default=30)
    parser.add_argument("--die-after")
    args = parser.parse_args()
    with IdempotencyClient(args.target.split(",")) as client:
        once = client.once(args.namespace, args.job_id, lease_ttl=args.lease_ttl, wait_timeout=60)
        print(json.dumps(once.run(job, args.job_id, args.log, args.die_after)))


if __name__ == "__main__":
    main()
