#!/usr/bin/env python3
"""Check the README's tables of retried status codes against the code.

    python3 examples/check_retried_codes.py

The README's "retried by default" table (under "Retry-safe Claims") must say
exactly what clients/service-config.json's retryPolicy retries (for a stock
gRPC client) and what each helper's default retry policy retries (Python,
TypeScript, Go, Java: read from their source); and the status table's
"helpers" column must say "retried" for exactly those codes. Run by
examples/http-api-python/run-tests.sh; needs only Python 3. Exits 1 with
one line per problem.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

#: Each helper's default set of retried codes: (file, regex whose group lists them).
HELPERS = {
    "Python": ("clients/python/src/idempotency_client/retry.py",
               r"RETRYABLE_CODES: FrozenSet\[grpc\.StatusCode\] = frozenset\(\s*\{([^}]*)\}"),
    "TypeScript": ("clients/node/src/client.ts", r"RETRYABLE_CODES: ReadonlySet<grpc\.status> = new Set\(\[([^\]]*)\]"),
    "Go": ("clients/go/idempotency/retry.go", r"var RetryableCodes = \[\]codes\.Code\{([^}]*)\}"),
    "Java": ("clients/java/src/main/java/idempotency/client/RetryPolicy.java",
             r"RETRYABLE_CODES = Set\.copyOf\(\s*EnumSet\.of\(([^)]*)\)"),
}


def canonical(name: str) -> str:
    """UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, codes.Unavailable, ResourceExhausted -> the proto name."""
    name = name.strip().split(".")[-1]
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).upper()


def helper_codes() -> dict:
    out = {}
    for helper, (path, pattern) in HELPERS.items():
        m = re.search(pattern, (REPO / path).read_text())
        if not m:
            raise SystemExit(f"check_retried_codes: {path}: the default retried codes were not found ({pattern})")
        out[helper] = {canonical(c) for c in m.group(1).split(",") if c.strip()}
    return out


def service_config_codes() -> set:
    config = json.loads((REPO / "clients" / "service-config.json").read_text())
    sets = [frozenset(m["retryPolicy"]["retryableStatusCodes"]) for m in config["methodConfig"] if "retryPolicy" in m]
    if len(set(sets)) != 1:
        raise SystemExit(f"check_retried_codes: service-config.json retries different codes per method: {sets}")
    return set(sets[0])


def main() -> int:
    readme = (REPO / "README.md").read_text()
    problems = []
    helpers = helper_codes()
    for helper, codes in helpers.items():
        if codes != helpers["Python"]:
            problems.append(f"the {helper} helper retries {sorted(codes)}, the Python one {sorted(helpers['Python'])}")
    helper_set = helpers["Python"]
    config_set = service_config_codes()

    # The "retried by default" table.
    m = re.search(r"^\| retried by default \|(.*)\n\| ---.*\n((?:\|.*\n)+)", readme, re.M)
    if not m:
        return print("check_retried_codes: README.md has no 'retried by default' table", file=sys.stderr) or 1
    columns = [c.strip().strip("`") for c in m.group(1).strip().strip("|").split("|")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in m.group(2).splitlines()]
    want = {"helpers": helper_set, "service-config.json": config_set}
    for who, expected in want.items():
        row = next((r for r in rows if who in r[0]), None)
        if row is None:
            problems.append(f"the 'retried by default' table has no row for {who}")
            continue
        said = {code for code, cell in zip(columns, row[1:]) if cell == "yes"}
        if said != expected & set(columns) or not expected <= set(columns):
            problems.append(f"the 'retried by default' table says {who} retries {sorted(said)}; "
                            f"the code retries {sorted(expected)}")

    # The status table's helpers column: "retried" exactly for those codes.
    verdicts = {}
    for line in readme.splitlines():
        r = re.match(r"\| `([A-Z_]+)` · `([A-Z_]+)` \|(.*)\|\s*$", line)
        if not r:
            continue
        code, reason, rest = r.groups()
        helpers_cell = rest.split("|")[-1].strip()
        same = re.match(r"as for `([A-Z_]+)`", helpers_cell)
        if same:
            verdicts[(code, reason)] = verdicts.get(next((k for k in verdicts if same.group(1) in k), None))
        else:
            verdicts[(code, reason)] = "retried" in helpers_cell and "not retried" not in helpers_cell
    if not verdicts:
        problems.append("README.md: no status table rows found")
    for (code, reason), retried in verdicts.items():
        if retried != (code in helper_set):
            problems.append(f"the status table says the helpers {'retry' if retried else 'do not retry'} "
                            f"{code} · {reason}; they {'do' if code in helper_set else 'do not'}")

    for problem in problems:
        print(f"check_retried_codes: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_retried_codes: the helpers retry {sorted(helper_set)}, service-config.json "
              f"{sorted(config_set)}, as README.md says")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
