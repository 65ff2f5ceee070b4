#!/usr/bin/env python3
"""Check one example's retention settings against docs/recipes.md's rule.

    python3 examples/check_settings.py EXAMPLE [SERVER_BINARY]

Reads the table under "Retention against remember_for: the rule" in
docs/recipes.md, the example's default retention from its code, and the
server's default remember_for from `SERVER_BINARY --help` (else from the
README's configuration table), and checks:

  - the example's code default is the table's retention;
  - the table's remember_for is the server's default;
  - window <= retention < remember_for;
  - the example pins late_retry on its Claims, as the table's late_retry says;
  - the example waits on IN_PROGRESS as long as the table's wait says (or not).

Every example's run-tests.sh runs it for its example; it needs only Python 3.
Exits 1 with one line per problem.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPES = REPO / "docs" / "recipes.md"
SECTION = "### Retention against remember_for: the rule"

#: Where each example sets its default retention: (file, regex whose group is
#: an arithmetic product, unit in seconds of that product).
RETENTION_IN_CODE = {
    "webhook-python": ("receiver.py", r'"WEBHOOK_RETENTION_SECONDS",\s*str\(([0-9* ]+)\)', 1),
    "http-api-python": ("app.py", r'"API_RETENTION_SECONDS",\s*str\(([0-9* ]+)\)', 1),
    "rabbitmq-python": ("consumer.py", r'env_float\("RETENTION_SECONDS",\s*([0-9* ]+)\)', 1),
    "rabbitmq-batch-python": ("consumer.py", r'env_float\("RETENTION_SECONDS",\s*([0-9* ]+)\)', 1),
    "rabbitmq-go": ("main.go", r'"retention",\s*([0-9*]+)\*time\.Hour', 3600),
    "nats-typescript": ("src/main.ts", r'intEnv\("RETENTION_MS",\s*([0-9*_ ]+)\)', 0.001),
}

#: Where each example pins late_retry on its Claims (regex whose group is the policy).
LATE_RETRY_IN_CODE = {
    "webhook-python": ("receiver.py", r'late_retry="(\w+)"'),
    "http-api-python": ("app.py", r'late_retry="(\w+)"'),
    "rabbitmq-python": ("consumer.py", r'late_retry="(\w+)"'),
    "rabbitmq-batch-python": ("consumer.py", r'late_retry="(\w+)"'),
    "rabbitmq-go": ("main.go", r'WithLateRetry\(idempotency\.LateRetry(\w+)\)'),
    "nats-typescript": ("src/consumer.ts", r'lateRetry: "(\w+)"'),
}

#: How each example answers IN_PROGRESS: ("wait", file, regex whose group is
#: the default wait, unit in seconds) or ("no", file, a regex that must match:
#: the call that does not wait).
WAIT_IN_CODE = {
    "webhook-python": ("no", "receiver.py", r'on_in_progress="raise"'),
    "http-api-python": ("no", "app.py", r'on_in_progress="raise"'),
    "rabbitmq-python": ("wait", "consumer.py", r'env_float\("WAIT_SECONDS",\s*([0-9.]+)\)', 1),
    "rabbitmq-go": ("wait", "main.go", r'"wait",\s*([0-9]+)\*time\.Second', 1),
    "rabbitmq-batch-python": ("no", "consumer.py", r'claim_batch\('),
    "nats-typescript": ("no", "src/consumer.ts", r'onInProgress: "throw"'),
}

UNITS = {"s": 1, "min": 60, "h": 3600, "hours": 3600, "day": 86400, "days": 86400}


def duration(text: str) -> float:
    """'2.5 days', '24 h', '7days' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", text)
    if not m or m.group(2) not in UNITS:
        raise ValueError(f"not a duration: {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def product(expression: str) -> float:
    value = 1.0
    for factor in expression.replace("_", "").split("*"):
        value *= float(factor.strip())
    return value


def table() -> dict:
    text = RECIPES.read_text()
    start = text.index(SECTION)
    rows = {}
    header = None
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def server_remember_for(binary: str | None) -> tuple[float, str]:
    if binary:
        try:
            out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            out = ""
        # The option's own paragraph: up to the next line that starts an option.
        option = re.search(r"--remember-for\b(.*?)(?=\n\s*-[-\w]|\Z)", out, re.S)
        default = option and re.search(r"\[default:\s*([^\]]+)\]", option.group(1))
        if default:
            return duration(default.group(1)), f"{binary} --help"
    readme = (REPO / "README.md").read_text()
    m = re.search(r"\| `IDEMPOTENCY_REMEMBER_FOR` \| `--remember-for` \| `([^`]+)` \|", readme)
    if not m:
        raise SystemExit("check_settings: the server's default remember_for is neither in --help nor in README.md")
    return duration(m.group(1)), "README.md"


def check(example: str, binary: str | None) -> list:
    rows = table()
    if example not in rows:
        return [f"{example}: no row in docs/recipes.md's table ({SECTION[4:]})"]
    row = rows[example]
    window, retention, remember = (duration(row[c]) for c in ("window", "retention", "remember_for"))
    problems = []

    path, pattern, unit = RETENTION_IN_CODE[example]
    source = (REPO / "examples" / example / path).read_text()
    found = re.findall(pattern, source)
    if len(found) != 1:
        problems.append(f"{example}: {path}: expected one default retention matching {pattern}, found {found}")
    else:
        in_code = product(found[0]) * unit
        if in_code != retention:
            problems.append(f"{example}: {path} defaults the retention to {in_code:g} s; "
                            f"docs/recipes.md says {row['retention']} ({retention:g} s)")

    path, pattern = LATE_RETRY_IN_CODE[example]
    pinned = [p.lower() for p in re.findall(pattern, (REPO / "examples" / example / path).read_text())]
    if pinned != [row["late_retry"]]:
        problems.append(f"{example}: {path} pins late_retry {pinned or 'nowhere'} on its Claims; "
                        f"docs/recipes.md says {row['late_retry']} (pinned once, on every Claim)")

    kind, path, pattern, *unit = WAIT_IN_CODE[example]
    source = (REPO / "examples" / example / path).read_text()
    if kind == "no":
        if row["wait"] != "no" or not re.search(pattern, source):
            problems.append(f"{example}: docs/recipes.md says wait {row['wait']}; {path} "
                            + ("does not wait" if re.search(pattern, source) else f"has no {pattern}"))
    else:
        found = re.findall(pattern, source)
        waits = float(found[0]) * unit[0] if len(found) == 1 else None
        if row["wait"] == "no" or waits != duration(row["wait"]):
            problems.append(f"{example}: docs/recipes.md says wait {row['wait']}; {path} waits "
                            f"{'?' if waits is None else f'{waits:g} s'} on IN_PROGRESS")

    server, where = server_remember_for(binary)
    if remember != server:
        problems.append(f"{example}: docs/recipes.md says remember_for {row['remember_for']}; "
                        f"the server's default is {server:g} s ({where})")
    if not window <= retention:
        problems.append(f"{example}: the retention ({row['retention']}) does not cover the window ({row['window']})")
    if not retention < remember:
        problems.append(f"{example}: the retention ({row['retention']}) is not shorter than remember_for "
                        f"({row['remember_for']}): nothing would be remembered after it")
    return problems


def main() -> int:
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in RETENTION_IN_CODE:
        print(f"usage: {sys.argv[0]} {{{','.join(RETENTION_IN_CODE)}}} [SERVER_BINARY]", file=sys.stderr)
        return 2
    example = sys.argv[1]
    problems = check(example, sys.argv[2] if len(sys.argv) == 3 else None)
    for problem in problems:
        print(f"check_settings: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_settings: {example}: window <= retention < remember_for, late_retry pinned, wait, "
              "as docs/recipes.md says")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
