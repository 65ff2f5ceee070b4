"""Infrastructure the fault scenarios break or stand up, one module per kind
(issue 25), apart from the harness proper (workload, checker, runner):

- `pg`: throwaway PostgreSQL clusters on chosen addresses, streaming
  standbys, Debian's PgBouncer, `ensure_commands()` (apt-get installs what a
  scenario needs), `sweep()` of what killed runs left.
- `net`: a network namespace for the replicas with the link to PostgreSQL
  breakable on its own (nftables, netem), and a TCP relay with a delay line.
- `clock`: libfaketime preloaded into a replica, and a probe that catches
  decisions taken by a replica's own clock (`python -m faults.infra.clock`
  runs its negative control).
- `disk`: a small tmpfs that can be filled (ENOSPC), and SQLite's integrity
  check.
- `patroni`: etcd, Patroni nodes in synchronous_mode_strict and HAProxy
  routing on Patroni's /primary, on free ports of 127.0.0.1 (issue 21).
- `citus`: a Citus coordinator and 2 workers on free ports of 127.0.0.1,
  where Citus is installed (the project never installs it; issue 21).

Each module can be tried by hand from `faults/` (`.venv/bin/python -c
'from faults.infra import pg; ...'`); `pg`, `net`, `disk`, `patroni` and `citus`
import nothing of the harness.
"""
