"""Checks of the monitoring files: the Grafana dashboard, the alert rules, and
the metrics table of docs/operations.md, against the metrics the server serves.

Run by scripts/check-helm.sh (which also runs yamllint, `promtool check rules`
and `promtool test rules` on deploy/prometheus); by hand:

    .cache/check-helm/venv/bin/pytest helm/tests/test_observability.py

Every PromQL expression is parsed with a real PromQL parser (promql-parser),
so a typo in a metric or label name, or an expression that does not parse,
fails here instead of drawing an empty panel or an alert that never fires.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import promql_parser as promql
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "idempotency-service.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
OPERATIONS = REPO / "docs" / "operations.md"
README = REPO / "README.md"
METRICS_SOURCE = REPO / "src" / "metrics.rs"
# The stable reasons of ErrorInfo (`Reason::as_str`), and the Claim outcomes
# metrics and logs name (`ClaimOutcome::name`).
ERROR_SOURCE = REPO / "src" / "error.rs"
DOMAIN_SOURCE = REPO / "src" / "domain.rs"
PROTO = REPO / "proto" / "idempotency" / "v1" / "idempotency.proto"
GRPC_SOURCE = REPO / "src" / "grpc" / "mod.rs"
# The one map from gRPC codes to the names metrics and logs use.
STATUS_SOURCE = REPO / "src" / "grpc" / "status.rs"

METHODS = {
    "Claim",
    "Complete",
    "Release",
    "ExtendLease",
    "Get",
    "ClaimBatch",
    "CompleteBatch",
    "Purge",
}
# The codes calls are counted with: "ok", the names `code_name` in
# src/grpc/mod.rs gives, and its catch-all "error".
CODES = {
    "ok",
    "invalid_argument",
    "not_found",
    "failed_precondition",
    "aborted",
    "unauthenticated",
    "permission_denied",
    "resource_exhausted",
    "deadline_exceeded",
    "unavailable",
    "internal",
    "error",
}
# The codes of calls refused for access or limits (mostly by the guard in
# src/grpc/guard.rs, before the call runs).
REFUSED_CODES = {"unauthenticated", "permission_denied", "resource_exhausted", "deadline_exceeded"}
# The stable reasons every non-OK status carries in google.rpc.ErrorInfo, as
# `Reason::as_str` in src/error.rs names them (idempotency_errors_total's
# `reason`).
REASONS = {
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "KEY_EXPIRED",
    "LEASE_LOST",
    "LEASE_RELEASED",
    "KEY_COMPLETED",
    "CONTENDED",
    "STORE_UNAVAILABLE",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "RATE_LIMITED",
    "OVERLOADED",
    "DEADLINE_EXCEEDED",
    "INTERNAL",
}
# Claim outcomes as `ClaimOutcome::name` in src/domain.rs names them
# (idempotency_claims_total's `outcome`).
CLAIM_OUTCOMES = frozenset(
    {"claimed", "retried", "reexecuted", "in_progress", "completed", "fingerprint_mismatch", "expired"}
)


@dataclass(frozen=True)
class Metric:
    type: str
    # Label name -> its possible values (None: not a fixed set).
    labels: dict[str, frozenset[str] | None] = field(default_factory=dict)


# `namespace` is there only when IDEMPOTENCY_METRICS_NAMESPACES lists some.
NAMESPACE = {"namespace": None}

# How a waiting Claim's wait ended (`record_wait` in src/metrics.rs).
WAIT_OUTCOMES = frozenset(
    {"completed", "claimed", "fingerprint_mismatch", "timed_out", "shutdown", "over_cap", "error"}
)

# What the server exports: the names, types and labels docs/operations.md lists.
METRICS: dict[str, Metric] = {
    "idempotency_calls_total": Metric(
        "counter", {"method": frozenset(METHODS), "code": frozenset(CODES), **NAMESPACE}
    ),
    "idempotency_call_duration_seconds": Metric("histogram", {"method": frozenset(METHODS)}),
    "idempotency_claims_total": Metric("counter", {"outcome": CLAIM_OUTCOMES, **NAMESPACE}),
    "idempotency_errors_total": Metric(
        "counter", {"method": frozenset(METHODS), "reason": frozenset(REASONS)}
    ),
    "idempotency_lease_takeovers_total": Metric("counter", {**NAMESPACE}),
    "idempotency_lease_lost_total": Metric(
        "counter", {"method": frozenset({"Complete", "Release", "ExtendLease"}), **NAMESPACE}
    ),
    "idempotency_purges_total": Metric("counter"),
    "idempotency_batch_splits_total": Metric("counter", {"operation": frozenset({"claim", "complete"})}),
    "idempotency_tls_handshake_failures_total": Metric("counter"),
    "idempotency_db_pool_connections": Metric("gauge"),
    "idempotency_db_pool_idle": Metric("gauge"),
    "idempotency_db_pool_max": Metric("gauge"),
    "idempotency_db_pool_waiting": Metric("gauge"),
    "idempotency_reaper_runs_total": Metric("counter", {"result": frozenset({"ok", "error"})}),
    "idempotency_reaper_deleted_total": Metric("counter"),
    "idempotency_reaper_remembered_total": Metric("counter"),
    "idempotency_records": Metric(
        "gauge", {"state": frozenset({"in_progress", "completed", "released", "expired", "remembered"})}
    ),
    "idempotency_reaper_lag_seconds": Metric("gauge"),
    "idempotency_store_up": Metric("gauge"),
    "idempotency_replay_cache_lookups_total": Metric("counter", {"result": frozenset({"hit", "miss"})}),
    "idempotency_replay_cache_bytes": Metric("gauge"),
    "idempotency_replay_cache_entries": Metric("gauge"),
    "idempotency_replay_cache_fresh": Metric("gauge"),
    "idempotency_replay_cache_too_large_total": Metric("counter"),
    "idempotency_waiters": Metric("gauge"),
    "idempotency_waits_total": Metric("counter", {"outcome": WAIT_OUTCOMES}),
    "idempotency_wait_duration_seconds": Metric("histogram", {"outcome": WAIT_OUTCOMES}),
    "idempotency_wait_reads_total": Metric(
        "counter", {"cause": frozenset({"joined", "woken", "lease_expired", "poll", "lost"})}
    ),
    "idempotency_wait_feed_fresh": Metric("gauge"),
}

# Labels Prometheus adds to every scraped series, which queries may use.
TARGET_LABELS = {"job", "instance"}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_of(series_name: str) -> tuple[str, Metric]:
    """The exported metric a series name belongs to (a histogram's _bucket,
    _sum and _count series belong to the histogram)."""
    if series_name in METRICS:
        metric = METRICS[series_name]
        assert metric.type != "histogram", f"{series_name}: query a histogram's _bucket, _sum or _count"
        return series_name, metric
    for suffix in HISTOGRAM_SUFFIXES:
        base = series_name.removesuffix(suffix)
        if base != series_name and METRICS.get(base, Metric("")).type == "histogram":
            return base, METRICS[base]
    raise AssertionError(f"{series_name} is not a metric the server exports")


def labels_of(series_name: str) -> set[str]:
    _, metric = metric_of(series_name)
    extra = {"le"} if series_name.endswith("_bucket") else set()
    return set(metric.labels) | TARGET_LABELS | extra


# --- PromQL ------------------------------------------------------------------


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by values PromQL can parse."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?[A-Za-z_]\w*(?::\w+)?\}?", "variable", expr)


def selectors(tree) -> list:
    found = []

    def visit(node):
        if isinstance(node, promql.VectorSelector):
            found.append(node)

    promql.walk(tree, visit)
    return found


def check_expression(expr: str) -> set[str]:
    """Parses expr, checks its metric and label names and label values, and
    returns the metrics it reads."""
    tree = promql.parse(expr)
    used = set()
    for selector in selectors(tree):
        assert selector.name, f"select metrics by name, not by __name__: {expr}"
        base, metric = metric_of(selector.name)
        used.add(base)
        allowed = labels_of(selector.name)
        matchers = list(selector.matchers.matchers)
        for group in selector.matchers.or_matchers:
            matchers.extend(group)
        for matcher in matchers:
            if matcher.name == "__name__":
                continue
            assert matcher.name in allowed, (
                f"{selector.name} has no label {matcher.name!r} (it has {sorted(allowed)}): {expr}"
            )
            values = metric.labels.get(matcher.name)
            if values is None or "variable" in matcher.value:
                continue
            if matcher.op in (promql.MatchOp.Equal, promql.MatchOp.NotEqual):
                wanted = {matcher.value}
            else:
                assert re.fullmatch(r"[\w|]+", matcher.value), (
                    f"use a plain alternation (a|b) in regex matchers on {matcher.name}: {expr}"
                )
                wanted = set(matcher.value.split("|"))
            assert wanted <= values, (
                f"{matcher.name} of {base} is one of {sorted(values)}, not {sorted(wanted - values)}: {expr}"
            )

    def check_grouping(node):
        if isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            grouped = set(node.modifier.labels)
            available = set().union(*(labels_of(s.name) for s in selectors(node.expr)))
            assert grouped <= available, (
                f"grouping by {sorted(grouped - available)}, which {sorted(used)} do not have: {expr}"
            )

    promql.walk(tree, check_grouping)
    return used


@pytest.mark.parametrize(
    "expr, message",
    [
        ("rate(idempotency_call_total[5m])", "idempotency_call_total is not a metric"),
        ("rate(idempotency_calls_total{method=\"Clam\"}[5m])", "not ['Clam']"),
        ("rate(idempotency_calls_total{status=\"ok\"}[5m])", "has no label 'status'"),
        ("sum by (state) (rate(idempotency_calls_total[5m]))", "grouping by ['state']"),
        ("rate(idempotency_call_duration_seconds[5m])", "query a histogram's _bucket"),
        ("idempotency_records{state=~\"expired|gone\"}", "not ['gone']"),
        ("sum(rate(idempotency_calls_total[5m])", "unclosed"),
    ],
)
def test_the_expression_check_rejects_what_it_is_meant_to(expr, message):
    with pytest.raises((AssertionError, ValueError), match=re.escape(message)):
        check_expression(expr)


# --- the dashboard ---------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def visualisations(board: dict) -> list[dict]:
    return [p for p in panels(board) if p["type"] != "row"]


def test_the_dashboard_is_json_with_a_prometheus_datasource_variable_and_job_and_instance():
    board = dashboard()
    assert board["schemaVersion"] == 39
    assert board["uid"] == "idempotency-service"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variables[name]["multi"] is True and variables[name]["includeAll"] is True


def test_variable_queries_read_exported_metrics():
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        assert variable["definition"] == variable["query"]["query"]
        series, label = match.groups()
        check_expression(grafana_to_promql(series))
        [selector] = selectors(promql.parse(grafana_to_promql(series)))
        assert label in labels_of(selector.name)


def test_every_panel_has_a_target_on_the_datasource_variable():
    board = dashboard()
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for panel in visualisations(board):
        assert panel["targets"], f"panel {panel['title']!r} has no target"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{panel['title']}: refIds repeat"
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert target["expr"].strip(), f"{panel['title']}: empty expression"
        assert panel["fieldConfig"]["defaults"]["unit"], f"{panel['title']}: no unit"


def test_every_dashboard_expression_parses_and_uses_only_exported_metrics_and_labels():
    for panel in visualisations(dashboard()):
        for target in panel["targets"]:
            expr = target["expr"]
            check_expression(grafana_to_promql(expr))
            # Each series selector follows the dashboard's job and instance.
            for selector in selectors(promql.parse(grafana_to_promql(expr))):
                names = {m.name for m in selector.matchers.matchers}
                assert {"job", "instance"} <= names, f"{panel['title']}: {expr}"


def test_the_dashboard_shows_every_exported_metric():
    used = set()
    for panel in visualisations(dashboard()):
        for target in panel["targets"]:
            used |= check_expression(grafana_to_promql(target["expr"]))
    assert used == set(METRICS)


def test_the_dashboard_has_the_panels_an_operator_looks_for():
    titles = [p["title"] for p in visualisations(dashboard())]
    assert titles == [
        "Call rate by method and code",
        "Error ratio",
        "Latency p50 and p99 by method",
        "Errors by reason",
        "Refused calls by code",
        "TLS handshake failures",
        "Claim outcomes",
        "Replay ratio",
        "Lease takeovers and lost leases",
        "Store up",
        "Connection pool",
        "Records by state",
        "Reaper",
        "Reaper lag",
        "Purges",
        "Remembered keys",
        "Late retries",
        "Replay cache hit ratio",
        "Replay cache size",
        "Replay cache fresh",
        "Waiting Claims",
        "Waits by outcome",
        "Wait reads by cause",
        "Wait duration p50 and p99",
        "Wait feed fresh",
    ]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in visualisations(dashboard())}
    assert units["Error ratio"] == units["Replay ratio"] == units["Replay cache hit ratio"] == "percentunit"
    assert units["Latency p50 and p99 by method"] == units["Reaper lag"] == "s"
    assert units["Wait duration p50 and p99"] == "s"
    assert units["Call rate by method and code"] == units["Refused calls by code"] == "reqps"
    assert units["Errors by reason"] == "reqps"
    assert units["Remembered keys"] == "short"
    assert units["Late retries"] == "ops"


def test_the_refused_calls_panel_shows_every_refusal_code():
    [panel] = [p for p in visualisations(dashboard()) if p["title"] == "Refused calls by code"]
    shown = set()
    for target in panel["targets"]:
        for selector in selectors(promql.parse(grafana_to_promql(target["expr"]))):
            for matcher in selector.matchers.matchers:
                if matcher.name == "code":
                    shown |= set(matcher.value.split("|"))
    assert shown == REFUSED_CODES


def metrics_and_matchers(panel: dict) -> list[tuple[str, dict[str, str]]]:
    """Each series a panel selects: its metric and its equality and regex
    matchers other than job and instance."""
    out = []
    for target in panel["targets"]:
        for selector in selectors(promql.parse(grafana_to_promql(target["expr"]))):
            matchers = {
                m.name: m.value
                for m in selector.matchers.matchers
                if m.name not in TARGET_LABELS and m.name != "__name__"
            }
            out.append((selector.name, matchers))
    return out


def panel_titled(title: str) -> dict:
    [panel] = [p for p in visualisations(dashboard()) if p["title"] == title]
    return panel


def test_the_errors_panel_shows_every_failed_call_by_its_reason():
    panel = panel_titled("Errors by reason")
    # Every reason, none filtered out, one series per reason.
    assert metrics_and_matchers(panel) == [("idempotency_errors_total", {})]
    [target] = panel["targets"]
    tree = promql.parse(grafana_to_promql(target["expr"]))
    assert isinstance(tree, promql.AggregateExpr) and list(tree.modifier.labels) == ["reason"]
    assert target["legendFormat"] == "{{reason}}"


def test_remembered_keys_have_their_panels():
    # The markers, as the records gauge counts them.
    assert metrics_and_matchers(panel_titled("Remembered keys")) == [
        ("idempotency_records", {"state": "remembered"})
    ]
    # Late retries, re-executed and refused.
    assert metrics_and_matchers(panel_titled("Late retries")) == [
        ("idempotency_claims_total", {"outcome": "reexecuted|expired"})
    ]
    # The reaper's two steps: markers made, rows deleted.
    reaper = [name for name, _ in metrics_and_matchers(panel_titled("Reaper"))]
    assert {"idempotency_reaper_remembered_total", "idempotency_reaper_deleted_total"} <= set(reaper)
    # Records by state takes every state, markers included.
    assert metrics_and_matchers(panel_titled("Records by state")) == [("idempotency_records", {})]


def test_panels_do_not_overlap():
    taken: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


# --- the alert rules -------------------------------------------------------------


def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert list(doc) == ["groups"]
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_alerts_are_the_nine_examples():
    assert [r["alert"] for r in rules()] == [
        "IdempotencyStoreDown",
        "IdempotencyUnavailableRateHigh",
        "IdempotencyLeaseLostRateHigh",
        "IdempotencyCallLatencyHigh",
        "IdempotencyDbPoolSaturated",
        "IdempotencyReaperLagHigh",
        "IdempotencyAccessDeniedRateHigh",
        "IdempotencyWaitersAtCap",
        "IdempotencyWaitFeedNotFresh",
    ]


def test_every_alert_has_a_severity_a_summary_and_a_description():
    for rule in rules():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


def test_every_alert_expression_parses_and_uses_only_exported_metrics_and_labels():
    for rule in rules():
        assert check_expression(rule["expr"]), rule["alert"]


def test_the_alerts_have_the_documented_thresholds():
    by_name = {r["alert"]: r for r in rules()}
    assert by_name["IdempotencyStoreDown"]["expr"].strip() == "idempotency_store_up == 0"
    assert by_name["IdempotencyStoreDown"]["for"] == "2m"
    assert by_name["IdempotencyReaperLagHigh"]["for"] == "15m"
    assert by_name["IdempotencyReaperLagHigh"]["expr"].strip().endswith("> 600")
    assert by_name["IdempotencyDbPoolSaturated"]["expr"].strip() == "idempotency_db_pool_waiting > 0"
    assert by_name["IdempotencyDbPoolSaturated"]["for"] == "10m"
    assert by_name["IdempotencyAccessDeniedRateHigh"]["for"] == "10m"
    assert by_name["IdempotencyAccessDeniedRateHigh"]["expr"].strip().endswith("> 1")
    assert by_name["IdempotencyWaitersAtCap"]["for"] == "10m"
    assert 'idempotency_waits_total{outcome="over_cap"}' in by_name["IdempotencyWaitersAtCap"]["expr"]
    assert by_name["IdempotencyWaitFeedNotFresh"]["for"] == "5m"
    assert by_name["IdempotencyWaitFeedNotFresh"]["expr"].strip().startswith("idempotency_wait_feed_fresh == 0")


def test_every_alert_has_a_unit_test_and_a_section_in_the_operations_page():
    alert_tests = yaml.safe_load((ALERTS.parent / "alerts.test.yaml").read_text())
    tested = {case["alertname"] for test in alert_tests["tests"] for case in test["alert_rule_test"]}
    page = OPERATIONS.read_text()
    for rule in rules():
        assert rule["alert"] in tested, f"{rule['alert']} has no case in alerts.test.yaml"
        assert re.search(rf"^#+ {rule['alert']} \(", page, re.M), (
            f"{rule['alert']} has no section in docs/operations.md"
        )


# --- the metric names themselves -----------------------------------------------


def test_the_server_source_names_exactly_the_metrics_checked_here():
    names = set(re.findall(r'"(idempotency_[a-z_]+)"', METRICS_SOURCE.read_text()))
    assert names == set(METRICS)


def test_every_histogram_checked_here_gets_buckets_in_the_server_source():
    # Without set_buckets_for_metric, metrics-exporter-prometheus serves a
    # describe_histogram! metric as a summary: no _bucket series, so the
    # dashboard's histogram_quantile draws nothing.
    with_buckets = set(re.findall(r'Matcher::Full\(\s*"(idempotency_\w+)"', METRICS_SOURCE.read_text()))
    histograms = {name for name, metric in METRICS.items() if metric.type == "histogram"}
    assert histograms <= with_buckets, f"served as summaries (no buckets): {sorted(histograms - with_buckets)}"


def test_the_server_source_names_exactly_the_methods_and_codes_checked_here():
    source = GRPC_SOURCE.read_text()
    methods = set(re.findall(r'self\.start\("(\w+)"', source))
    assert methods == METHODS
    code_name = re.search(r"fn code_name\(.*?\n}\n", STATUS_SOURCE.read_text(), re.S)
    assert code_name, "code_name is gone from src/grpc/status.rs"
    codes = set(re.findall(r'=> "(\w+)"', code_name.group(0)))
    assert codes | {"ok"} == CODES


def source_names(path: Path, function: str) -> set[str]:
    """The string literals a Rust function's match arms give (`=> "name"`)."""
    body = re.search(rf"fn {function}\(.*?\n    }}\n", path.read_text(), re.S)
    assert body, f"{function} is gone from {path.relative_to(REPO)}"
    return set(re.findall(r'=> "(\w+)"', body.group(0)))


def proto_enum(name: str, prefix: str) -> list[str]:
    """The value names of a proto enum, without their prefix, UNSPECIFIED left out."""
    body = re.search(rf"^enum {name} \{{(.*?)^\}}", PROTO.read_text(), re.S | re.M)
    assert body, f"enum {name} is gone from the proto"
    names = re.findall(rf"^\s*{prefix}(\w+) = \d+;", body.group(1), re.M)
    return [n for n in names if n != "UNSPECIFIED"]


def test_the_server_source_names_exactly_the_reasons_and_claim_outcomes_checked_here():
    assert source_names(ERROR_SOURCE, "as_str") == REASONS
    assert set(proto_enum("ErrorReason", "ERROR_REASON_")) == REASONS
    assert source_names(DOMAIN_SOURCE, "name") == CLAIM_OUTCOMES


# The gRPC code each reason comes with (src/grpc/status.rs, `code_of`).
REASON_CODES = {
    "INVALID_ARGUMENT": "INVALID_ARGUMENT",
    "NOT_FOUND": "NOT_FOUND",
    "KEY_EXPIRED": "NOT_FOUND",
    "LEASE_LOST": "FAILED_PRECONDITION",
    "LEASE_RELEASED": "FAILED_PRECONDITION",
    "KEY_COMPLETED": "FAILED_PRECONDITION",
    "CONTENDED": "ABORTED",
    "STORE_UNAVAILABLE": "UNAVAILABLE",
    "UNAUTHENTICATED": "UNAUTHENTICATED",
    "PERMISSION_DENIED": "PERMISSION_DENIED",
    "RATE_LIMITED": "RESOURCE_EXHAUSTED",
    "OVERLOADED": "RESOURCE_EXHAUSTED",
    "DEADLINE_EXCEEDED": "DEADLINE_EXCEEDED",
    "INTERNAL": "INTERNAL",
}
# What a caller does next, as the README's table says it (one of four).
NEXT_STEPS = {"retry the same key", "use a new key", "wait", "stop"}


def what_to_do_next() -> list[list[str]]:
    """The rows of README's "What to do next" table, as cells."""
    section = re.search(r"^### What to do next\n(.*?)^#", README.read_text(), re.S | re.M)
    assert section, "README has no \"What to do next\" section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("| ")]
    header, rows = rows[0], rows[1:]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "answer",
        "what it means",
        "what to do",
        "what the helpers do",
    ]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows]


def test_the_readme_says_what_to_do_next_for_every_outcome_and_reason():
    rows = what_to_do_next()
    answers = [row[0] for row in rows]
    outcomes = [f"`OUTCOME_{name}`" for name in proto_enum("Outcome", "OUTCOME_")]
    # Every Claim outcome, and the re-executed late retry apart.
    expected = outcomes[:1] + ["`OUTCOME_CLAIMED` with `completed_at` set"] + outcomes[1:]
    # Every reason, with its code, in the proto's order.
    expected += [
        f"`{REASON_CODES[reason]}` · `{reason}`" for reason in proto_enum("ErrorReason", "ERROR_REASON_")
    ]
    assert answers == expected
    for row in rows:
        assert len(row) == 4, row[0]
        assert all(row), f"{row[0]}: an empty cell"
        steps = {step for step in NEXT_STEPS if f"**{step}**" in row[2]}
        # Doing the work is the next step of a won Claim; every other answer
        # names one of the four.
        assert steps or row[0].startswith("`OUTCOME_CLAIMED`"), f"{row[0]}: {row[2]}"
    assert set(REASON_CODES) == REASONS


def test_the_operations_page_names_every_reason():
    row = re.search(r"^\| `idempotency_errors_total` \|.*$", OPERATIONS.read_text(), re.M)
    assert row
    assert set(re.findall(r"\b[A-Z][A-Z_]+[A-Z]\b", row.group(0))) >= REASONS


def test_the_operations_page_lists_every_metric_with_its_type_and_labels():
    rows = re.findall(r"^\| `(idempotency_\w+)` \| (\w+) \| ([^|]*) \|", OPERATIONS.read_text(), re.M)
    documented = {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert documented == {
        name: (metric.type, set(metric.labels)) for name, metric in METRICS.items()
    }
