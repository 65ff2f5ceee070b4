"""Assertions on what the chart renders, through the real helm binary.

Run by scripts/check-helm.sh, which installs helm and sets HELM; by hand:

    HELM=.cache/check-helm/bin/helm .cache/check-helm/venv/bin/pytest helm/tests
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import values_table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "idempotency-service"
ALL_ON = CHART / "ci" / "all-on-values.yaml"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
CHART_ALERTS = CHART / "files" / "alerts.yaml"
HELM = os.environ.get("HELM", str(REPO / ".cache" / "check-helm" / "bin" / "helm"))

RELEASE = "idempotency-service"
NAMESPACE = "idempotency"
SERVICE_NAME = "idempotency.v1.IdempotencyService"

RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
SERVER_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
SELECTOR = {
    "app.kubernetes.io/name": "idempotency-service",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/component": "server",
}
CONFIG_ENV = {
    "IDEMPOTENCY_DEFAULT_LEASE_TTL": "30s",
    "IDEMPOTENCY_MAX_LEASE_TTL": "1h",
    "IDEMPOTENCY_DEFAULT_RETENTION": "24h",
    "IDEMPOTENCY_MAX_RETENTION": "30days",
    "IDEMPOTENCY_MAX_RESPONSE_BYTES": "1048576",
    "IDEMPOTENCY_MAX_CHECKPOINT_BYTES": "65536",
    "IDEMPOTENCY_MAX_WAIT": "30s",
    "IDEMPOTENCY_MAX_WAITERS": "512",
    "IDEMPOTENCY_REMEMBER_FOR": "7days",
    "IDEMPOTENCY_LATE_RETRY": "reexecute",
    "IDEMPOTENCY_REAPER_INTERVAL": "60s",
    "IDEMPOTENCY_REAPER_BATCH_SIZE": "1000",
    "IDEMPOTENCY_DB_POOL_SIZE": "16",
    "IDEMPOTENCY_DB_TIMEOUT": "5s",
    "IDEMPOTENCY_HEALTH_CHECK_INTERVAL": "1s",
    "IDEMPOTENCY_SHUTDOWN_TIMEOUT": "30s",
    "IDEMPOTENCY_LOG_FORMAT": "json",
    "RUST_LOG": "info",
    "IDEMPOTENCY_RECORDS_GAUGE_INTERVAL": "60s",
}
LIMITS_ENV = {
    "IDEMPOTENCY_MAX_CONCURRENT_CALLS": "1024",
    "IDEMPOTENCY_MAX_STREAMS_PER_CONNECTION": "128",
    "IDEMPOTENCY_CALL_TIMEOUT": "30s",
}
TLS_ENV = {
    "IDEMPOTENCY_TLS_CERT_FILE",
    "IDEMPOTENCY_TLS_KEY_FILE",
    "IDEMPOTENCY_TLS_CLIENT_CA_FILE",
    "IDEMPOTENCY_TLS_CLIENT_AUTH",
}
HEALTH_PORT = 50052
TEST_POD_PEER = {
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/name": "idempotency-service",
            "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "test",
        }
    }
}
DEFAULT_DATABASE_URL_ENV = {
    "name": "DATABASE_URL",
    "valueFrom": {
        "secretKeyRef": {"name": "idempotency-service-database", "key": "database-url"}
    },
}


# --- rendering ---------------------------------------------------------------


def helm_template(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        check=False,
    )


@functools.cache
def render(*args: str) -> tuple[dict, ...]:
    result = helm_template(*args)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render_fails(*args: str) -> str:
    result = helm_template(*args)
    assert result.returncode != 0, "the render was expected to fail"
    return result.stderr


def default() -> tuple[dict, ...]:
    return render()


def all_on() -> tuple[dict, ...]:
    return render("-f", str(ALL_ON))


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def volumes_of(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod.get("volumes", [])}


def mounts_of(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def kinds(docs) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for d in docs)


def server(docs) -> dict:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server"]
    return containers[0]


def migrate_job(docs) -> dict:
    return one(docs, "Job")


def migrate_container(docs) -> dict:
    containers = migrate_job(docs)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["migrate"]
    return containers[0]


def env_of(container: dict) -> dict[str, dict]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), f"duplicate env vars: {names}"
    return {e["name"]: e for e in container["env"]}


def plain_env(container: dict) -> dict[str, str]:
    return {name: e["value"] for name, e in env_of(container).items() if "value" in e}


# --- what is rendered ----------------------------------------------------------


def test_default_values_render_exactly_the_server_its_service_pdb_migration_and_test():
    assert kinds(default()) == [
        ("Deployment", "idempotency-service"),
        ("Job", "idempotency-service-migrate"),
        ("Pod", "idempotency-service-test-health"),
        ("PodDisruptionBudget", "idempotency-service"),
        ("Service", "idempotency-service"),
    ]


def test_every_option_on_adds_hpa_monitoring_networkpolicy_serviceaccount_headless_service_and_policy():
    assert kinds(all_on()) == [
        ("ConfigMap", "idempotency-service-policy"),
        ("Deployment", "idempotency-service"),
        ("HorizontalPodAutoscaler", "idempotency-service"),
        ("Job", "idempotency-service-migrate"),
        ("NetworkPolicy", "idempotency-service"),
        ("Pod", "idempotency-service-test-health"),
        ("PodDisruptionBudget", "idempotency-service"),
        ("PrometheusRule", "idempotency-service"),
        ("Service", "idempotency-service"),
        ("Service", "idempotency-service-headless"),
        ("ServiceAccount", "idempotency-service"),
        ("ServiceMonitor", "idempotency-service"),
    ]


def test_app_version_equals_the_crate_version_in_cargo_toml():
    cargo = tomllib.loads((REPO / "Cargo.toml").read_text())["package"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == cargo
    assert chart["version"] == "0.1.0"
    assert server(default())["image"] == f"idempotency-service:{cargo}"


def test_kubernetes_older_than_1_27_is_refused():
    assert chart_kube_version() == ">=1.27.0-0"
    assert "incompatible with Kubernetes v1.26.0" in render_fails("--kube-version", "1.26.0")


def chart_kube_version() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]


# --- Deployment ------------------------------------------------------------------


def test_two_replicas_roll_with_max_unavailable_zero():
    spec = one(default(), "Deployment")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert spec["selector"] == {"matchLabels": SELECTOR}
    assert {**spec["template"]["metadata"]["labels"], **SELECTOR} == spec["template"][
        "metadata"
    ]["labels"]


def test_probes_are_native_grpc_on_the_plaintext_health_port():
    container = server(default())
    assert container["ports"][0] == {"name": "grpc", "containerPort": 50051, "protocol": "TCP"}
    assert container["ports"][-1] == {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}
    assert plain_env(container)["IDEMPOTENCY_HEALTH_LISTEN_ADDR"] == f"0.0.0.0:{HEALTH_PORT}"
    assert container["startupProbe"] == {
        "grpc": {"port": HEALTH_PORT, "service": "liveness"},
        "periodSeconds": 2,
        "timeoutSeconds": 2,
        "failureThreshold": 60,
    }
    assert container["livenessProbe"] == {
        "grpc": {"port": HEALTH_PORT, "service": "liveness"},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }


def test_readiness_probe_asks_for_the_idempotency_service_by_name():
    assert server(default())["readinessProbe"] == {
        "grpc": {"port": HEALTH_PORT, "service": SERVICE_NAME},
        "periodSeconds": 5,
        "timeoutSeconds": 2,
        "failureThreshold": 2,
        "successThreshold": 1,
    }


def test_termination_grace_covers_the_prestop_pause_and_the_servers_drain():
    pod = one(default(), "Deployment")["spec"]["template"]["spec"]
    container = server(default())
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert plain_env(container)["IDEMPOTENCY_SHUTDOWN_TIMEOUT"] == "30s"
    # 5 s preStop + 30 s drain + 5 s margin.
    assert pod["terminationGracePeriodSeconds"] == 40


def test_a_longer_drain_lengthens_the_termination_grace_with_it():
    docs = render("--set", "config.shutdownTimeoutSeconds=60", "--set", "lifecycle.preStopSleepSeconds=10")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 75
    assert plain_env(server(docs))["IDEMPOTENCY_SHUTDOWN_TIMEOUT"] == "60s"
    assert server(docs)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]


def test_a_longer_wait_leaves_the_termination_grace_alone():
    # Waiting Claims answer at once at SIGTERM (OUTCOME_IN_PROGRESS), so a
    # wait never holds the drain: the grace follows the drain, not the wait.
    docs = render("--set", "config.maxWait=10m")
    assert plain_env(server(docs))["IDEMPOTENCY_MAX_WAIT"] == "10m"
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 40


def test_server_container_runs_with_the_restricted_security_context():
    pod = one(default(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == SERVER_POD_SECURITY
    assert server(default())["securityContext"] == RESTRICTED_CONTAINER
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == "default"


def test_the_read_only_root_filesystem_gets_a_writable_tmp():
    pod = one(default(), "Deployment")["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert server(default())["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_replicas_spread_across_nodes_and_zones():
    pod = one(default(), "Deployment")["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": SELECTOR},
        }
        for key in ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    ]


def test_server_has_requests_and_a_memory_limit():
    assert server(default())["resources"] == {
        "requests": {"cpu": "100m", "memory": "64Mi"},
        "limits": {"memory": "256Mi"},
    }


def test_server_serves_with_the_servers_own_migrations_off():
    container = server(default())
    assert container["args"] == ["serve"]
    assert plain_env(container)["IDEMPOTENCY_RUN_MIGRATIONS"] == "false"


def test_every_server_setting_reaches_the_server_as_an_environment_variable():
    server_env = {
        "IDEMPOTENCY_LISTEN_ADDR": "0.0.0.0:50051",
        "IDEMPOTENCY_HEALTH_LISTEN_ADDR": f"0.0.0.0:{HEALTH_PORT}",
        "IDEMPOTENCY_METRICS_ADDR": "0.0.0.0:8464",
        "IDEMPOTENCY_RUN_MIGRATIONS": "false",
        **LIMITS_ENV,
    }
    assert plain_env(server(default())) == {**CONFIG_ENV, **server_env}
    env = env_of(server(default()))
    assert env["DATABASE_URL"] == DEFAULT_DATABASE_URL_ENV
    assert set(env) == {*CONFIG_ENV, *server_env, "DATABASE_URL"}


def test_config_values_are_passed_through_unchanged():
    docs = render(
        "--set", "config.defaultLeaseTtl=45s",
        "--set", "config.maxResponseBytes=2097152",
        "--set", "config.dataDir=/data",
        "--set", "grpc.port=6000",
        "--set", "healthPort=6001",
        "--set", "bindHost=[::]",
    )
    env = plain_env(server(docs))
    assert env["IDEMPOTENCY_DEFAULT_LEASE_TTL"] == "45s"
    assert env["IDEMPOTENCY_MAX_RESPONSE_BYTES"] == "2097152"
    assert env["IDEMPOTENCY_DATA_DIR"] == "/data"
    assert env["IDEMPOTENCY_LISTEN_ADDR"] == "[::]:6000"
    assert env["IDEMPOTENCY_METRICS_ADDR"] == "[::]:8464"
    assert env["IDEMPOTENCY_HEALTH_LISTEN_ADDR"] == "[::]:6001"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server(docs)[probe]["grpc"]["port"] == 6001
    assert server(docs)["ports"][-1] == {"name": "health", "containerPort": 6001, "protocol": "TCP"}
    assert one(docs, "Service")["spec"]["ports"][-1]["port"] == 6001
    assert "-addr=idempotency-service.idempotency.svc:6001" in one(docs, "Pod")["spec"]["containers"][0]["args"]


# --- the database URL ------------------------------------------------------------


def test_database_url_comes_from_the_existing_secret_by_default():
    assert env_of(server(default()))["DATABASE_URL"] == DEFAULT_DATABASE_URL_ENV
    assert env_of(migrate_container(default()))["DATABASE_URL"] == DEFAULT_DATABASE_URL_ENV


def test_the_existing_secret_name_and_key_come_from_values():
    docs = render("--set", "database.existingSecret.name=idempotency-db", "--set", "database.existingSecret.key=url")
    expected = {
        "name": "DATABASE_URL",
        "valueFrom": {"secretKeyRef": {"name": "idempotency-db", "key": "url"}},
    }
    assert env_of(server(docs))["DATABASE_URL"] == expected
    assert env_of(migrate_container(docs))["DATABASE_URL"] == expected


def test_url_from_file_mounts_the_secret_and_sets_database_url_file_instead_of_database_url():
    volume = {
        "name": "database",
        "secret": {"secretName": "idempotency-db", "items": [{"key": "url", "path": "database-url"}]},
    }
    mount = {"name": "database", "mountPath": "/etc/idempotency/database", "readOnly": True}
    for pod in (pod_spec(all_on()), migrate_job(all_on())["spec"]["template"]["spec"]):
        assert volumes_of(pod)["database"] == volume
        [container] = pod["containers"]
        env = env_of(container)
        assert "DATABASE_URL" not in env
        assert env["DATABASE_URL_FILE"] == {
            "name": "DATABASE_URL_FILE", "value": "/etc/idempotency/database/database-url"
        }
        # A directory mount of the one key, never subPath.
        assert mounts_of(container)["database"] == mount


def test_url_from_file_defaults_to_the_charts_secret_name_and_key():
    docs = render("--set", "database.urlFromFile=true")
    assert volumes_of(pod_spec(docs))["database"]["secret"] == {
        "secretName": "idempotency-service-database",
        "items": [{"key": "database-url", "path": "database-url"}],
    }
    assert "DATABASE_URL" not in env_of(server(docs))


def test_without_url_from_file_nothing_database_is_mounted():
    for container in (server(default()), migrate_container(default())):
        assert "DATABASE_URL_FILE" not in env_of(container)
        assert "database" not in mounts_of(container)
    assert "database" not in volumes_of(pod_spec(default()))


def test_url_from_file_with_a_plain_text_url_fails_the_render():
    stderr = render_fails(
        "--set", "database.url=postgres://u:p@db/idem",
        "--set", "database.allowPlainTextUrl=true",
        "--set", "database.urlFromFile=true",
    )
    assert "database.urlFromFile mounts database.existingSecret" in stderr


def test_the_default_render_holds_no_plain_text_database_url_or_password():
    text = json.dumps(default()).lower()
    for needle in ["postgres://", "postgresql://", "sqlite://", "password"]:
        assert needle not in text
    assert not [d for d in default() if d["kind"] in ("Secret", "ConfigMap")]
    for container in (server(default()), migrate_container(default())):
        assert "value" not in env_of(container)["DATABASE_URL"]


def test_a_plain_text_url_without_the_opt_in_fails_the_render():
    stderr = render_fails("--set", "database.url=postgres://u:p@db:5432/idem")
    assert "database.allowPlainTextUrl is false" in stderr


def test_a_plain_text_url_with_the_opt_in_is_used_as_is():
    url = "postgres://u:p@db:5432/idem"
    docs = render("--set", f"database.url={url}", "--set", "database.allowPlainTextUrl=true")
    for container in (server(docs), migrate_container(docs)):
        assert env_of(container)["DATABASE_URL"] == {"name": "DATABASE_URL", "value": url}


# --- migrations ------------------------------------------------------------------


def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook_job():
    job = migrate_job(default())
    assert job["metadata"]["annotations"] == {
        "helm.sh/hook": "pre-install,pre-upgrade",
        "helm.sh/hook-weight": "0",
        "helm.sh/hook-delete-policy": "before-hook-creation",
    }
    assert job["spec"]["backoffLimit"] == 3
    assert job["spec"]["activeDeadlineSeconds"] == 600
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"] == SERVER_POD_SECURITY
    assert "serviceAccountName" not in pod
    container = migrate_container(default())
    assert container["image"] == server(default())["image"]
    assert container["args"] == ["migrate"]
    assert container["securityContext"] == RESTRICTED_CONTAINER
    assert plain_env(container) == CONFIG_ENV


def test_migrations_can_be_left_to_the_operator():
    docs = render("--set", "migrations.enabled=false")
    assert not [d for d in docs if d["kind"] == "Job"]
    assert plain_env(server(docs))["IDEMPOTENCY_RUN_MIGRATIONS"] == "false"


# --- Service, PDB, test pod ---------------------------------------------------------


def test_service_exposes_the_grpc_metrics_and_health_ports_of_the_server_pods():
    spec = one(default(), "Service")["spec"]
    assert spec == {
        "type": "ClusterIP",
        "selector": SELECTOR,
        "ports": [
            {"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
            {"name": "metrics", "port": 8464, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"},
            {"name": "health", "port": HEALTH_PORT, "targetPort": "health", "protocol": "TCP", "appProtocol": "grpc"},
        ],
    }


def test_pdb_lets_a_drain_take_one_of_two_replicas():
    pdb = one(default(), "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR}}


def test_no_pdb_for_a_single_replica():
    docs = render("--set", "replicaCount=1")
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]


def test_helm_test_pod_checks_grpc_health_through_the_services_plaintext_health_port():
    pod = one(default(), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    [container] = pod["spec"]["containers"]
    assert container["image"] == "ghcr.io/grpc-ecosystem/grpc-health-probe:v0.4.41"
    assert container["args"] == [
        f"-addr=idempotency-service.idempotency.svc:{HEALTH_PORT}",
        f"-service={SERVICE_NAME}",
        "-connect-timeout=5s",
        "-rpc-timeout=5s",
    ]
    assert container["securityContext"] == RESTRICTED_CONTAINER
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# --- the optional parts, all on ---------------------------------------------------------


def test_with_autoscaling_the_hpa_owns_the_replica_count():
    assert "replicas" not in one(all_on(), "Deployment")["spec"]
    hpa = one(all_on(), "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "idempotency-service"},
        "minReplicas": 3,
        "maxReplicas": 9,
        "metrics": [
            {"type": "Resource", "resource": {"name": name, "target": {"type": "Utilization", "averageUtilization": target}}}
            for name, target in [("cpu", 75), ("memory", 80)]
        ],
    }
    assert one(all_on(), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_metrics_port_service_port_and_servicemonitor_line_up():
    container = server(all_on())
    assert container["ports"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8464, "protocol": "TCP"},
        {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
    ]
    assert plain_env(container)["IDEMPOTENCY_METRICS_ADDR"] == "0.0.0.0:8464"
    service = one(all_on(), "Service", "idempotency-service")
    assert service["spec"]["ports"][1] == {
        "name": "metrics", "port": 8464, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"
    }
    monitor = one(all_on(), "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"] == {
        "selector": {"matchLabels": SELECTOR},
        "namespaceSelector": {"matchNames": [NAMESPACE]},
        "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}],
    }


def test_metrics_are_served_on_port_8464_by_default():
    container = server(default())
    assert container["ports"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8464, "protocol": "TCP"},
        {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
    ]
    assert env_of(container)["IDEMPOTENCY_METRICS_ADDR"] == {
        "name": "IDEMPOTENCY_METRICS_ADDR", "value": "0.0.0.0:8464"
    }
    assert one(default(), "Service")["spec"]["ports"][1] == {
        "name": "metrics", "port": 8464, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"
    }
    # Scraping and alerting need the prometheus-operator CRDs: opt-in.
    assert not [d for d in default() if d["kind"] in ("ServiceMonitor", "PrometheusRule")]


def test_metrics_turned_off_set_an_empty_address_and_expose_no_port():
    docs = render("--set", "metrics.enabled=false")
    container = server(docs)
    # Empty, not absent: without the variable the server would listen on 0.0.0.0:8464.
    assert env_of(container)["IDEMPOTENCY_METRICS_ADDR"] == {"name": "IDEMPOTENCY_METRICS_ADDR", "value": ""}
    assert container["ports"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
        {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
    ]
    assert [p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["grpc", "health"]
    # The migration Job never serves metrics, whatever the setting.
    assert "IDEMPOTENCY_METRICS_ADDR" not in env_of(migrate_container(docs))


def test_another_metrics_port_moves_the_address_the_container_port_and_the_service_port():
    docs = render("--set", "metrics.port=9100")
    container = server(docs)
    assert plain_env(container)["IDEMPOTENCY_METRICS_ADDR"] == "0.0.0.0:9100"
    assert container["ports"][1] == {"name": "metrics", "containerPort": 9100, "protocol": "TCP"}
    assert one(docs, "Service")["spec"]["ports"][1]["port"] == 9100


def test_listed_namespaces_and_the_records_interval_reach_server_and_migration_job():
    for container in (server(all_on()), migrate_container(all_on())):
        env = plain_env(container)
        assert env["IDEMPOTENCY_METRICS_NAMESPACES"] == "payments,orders"
        assert env["IDEMPOTENCY_RECORDS_GAUGE_INTERVAL"] == "5m"


def test_no_listed_namespaces_leaves_the_variable_unset():
    # An empty value would read as one namespace called "", labelling all as "other".
    assert "IDEMPOTENCY_METRICS_NAMESPACES" not in env_of(server(default()))
    docs = render("--set", "config.recordsGaugeInterval=0s")
    assert plain_env(server(docs))["IDEMPOTENCY_RECORDS_GAUGE_INTERVAL"] == "0s"


def test_prometheus_rule_carries_exactly_the_groups_of_deploy_prometheus_alerts_yaml():
    rule = one(all_on(), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    assert [r["alert"] for r in rule["spec"]["groups"][0]["rules"]] == [
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
    # Prometheus's own templates pass through the chart untouched.
    assert rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"] == (
        "idempotency-service {{ $labels.instance }} cannot reach its database"
    )


def test_the_charts_alert_rules_are_a_byte_for_byte_copy_of_deploy_prometheus_alerts_yaml():
    assert CHART_ALERTS.read_bytes() == ALERTS.read_bytes(), (
        "deploy/prometheus/alerts.yaml is the source: "
        "cp deploy/prometheus/alerts.yaml helm/idempotency-service/files/alerts.yaml"
    )


def test_a_prometheus_rule_without_metrics_fails_the_render():
    stderr = render_fails("--set", "prometheusRule.enabled=true", "--set", "metrics.enabled=false")
    assert "prometheusRule.enabled needs metrics.enabled" in stderr


def test_a_servicemonitor_without_metrics_fails_the_render():
    stderr = render_fails("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.enabled=false")
    assert "metrics.serviceMonitor.enabled needs metrics.enabled" in stderr


def test_network_policy_admits_listed_clients_and_the_helm_test_pod():
    policy = one(all_on(), "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": SELECTOR}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    grpc_rule, metrics_rule = spec["ingress"]
    # The health port goes with the gRPC port: the test pod checks it, and the
    # kubelet's probes come from the node, which NetworkPolicy never blocks.
    assert grpc_rule == {
        "ports": [{"port": "grpc", "protocol": "TCP"}, {"port": "health", "protocol": "TCP"}],
        "from": [
            {"namespaceSelector": {"matchLabels": {"idempotency-client": "true"}}},
            TEST_POD_PEER,
        ],
    }
    assert metrics_rule == {
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    }
    assert [rule["ports"][0]["port"] for rule in spec["egress"]] == [53, 5432]
    # The test pod it admits is the one the chart renders.
    test_labels = one(all_on(), "Pod")["metadata"]["labels"]
    for key, value in grpc_rule["from"][1]["podSelector"]["matchLabels"].items():
        assert test_labels[key] == value


def test_created_service_account_is_used_without_a_mounted_token():
    account = one(all_on(), "ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["annotations"] == {"example.com/role": "idempotency-service"}
    pod = one(all_on(), "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "idempotency-service"
    assert pod["automountServiceAccountToken"] is False
    # Hooks run before the release's ServiceAccount exists, so the Job uses its own.
    assert migrate_job(all_on())["spec"]["template"]["spec"]["serviceAccountName"] == "idempotency-migrate"


def test_headless_service_resolves_to_the_server_pods():
    spec = one(all_on(), "Service", "idempotency-service-headless")["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["selector"] == SELECTOR


def test_all_on_render_keeps_the_restricted_security_context_and_secret_reference():
    assert server(all_on())["securityContext"] == RESTRICTED_CONTAINER
    assert "password" not in json.dumps(all_on()).lower()


# --- TLS, the access policy, the abuse limits ------------------------------------------------

TLS_DIR = "/etc/idempotency/tls"
POLICY_DIR = "/etc/idempotency/policy"
TLS_ON = ("--set", "tls.enabled=true", "--set", "tls.secretName=idem-tls")


def test_tls_is_off_by_default_no_tls_variables_volume_or_mount():
    container = server(default())
    assert not TLS_ENV & set(env_of(container))
    assert "tls" not in mounts_of(container)
    assert "tls" not in volumes_of(pod_spec(default()))


def test_tls_on_sets_the_certificate_and_key_files_of_a_read_only_directory_mount():
    docs = render(*TLS_ON)
    container = server(docs)
    env = plain_env(container)
    assert env["IDEMPOTENCY_TLS_CERT_FILE"] == f"{TLS_DIR}/tls.crt"
    assert env["IDEMPOTENCY_TLS_KEY_FILE"] == f"{TLS_DIR}/tls.key"
    # No client CA without clientAuth, even if the Secret carries a ca.crt.
    assert "IDEMPOTENCY_TLS_CLIENT_CA_FILE" not in env
    assert "IDEMPOTENCY_TLS_CLIENT_AUTH" not in env
    # A directory mount (no subPath), so a renewed certificate reaches the pod.
    assert mounts_of(container)["tls"] == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
    assert volumes_of(pod_spec(docs))["tls"] == {
        "name": "tls",
        "projected": {
            "sources": [
                {
                    "secret": {
                        "name": "idem-tls",
                        "items": [
                            {"key": "tls.crt", "path": "tls.crt"},
                            {"key": "tls.key", "path": "tls.key"},
                        ],
                    }
                }
            ]
        },
    }
    # The migration Job serves nothing: no TLS there.
    assert not TLS_ENV & set(env_of(migrate_container(docs)))


def test_no_volume_mount_of_any_render_uses_sub_path():
    for docs in (default(), all_on(), render(*TLS_ON, "--set", "policy.existingSecret=p")):
        for container in (server(docs), migrate_container(docs)):
            for mount in container["volumeMounts"]:
                assert "subPath" not in mount and "subPathExpr" not in mount, mount


@pytest.mark.parametrize("mode", ["required", "optional"])
def test_client_auth_adds_the_client_ca_from_the_tls_secrets_ca_crt(mode):
    docs = render(*TLS_ON, "--set", f"tls.clientAuth={mode}")
    env = plain_env(server(docs))
    assert env["IDEMPOTENCY_TLS_CLIENT_CA_FILE"] == f"{TLS_DIR}/ca.crt"
    assert env["IDEMPOTENCY_TLS_CLIENT_AUTH"] == mode
    [source] = volumes_of(pod_spec(docs))["tls"]["projected"]["sources"]
    assert source["secret"] == {
        "name": "idem-tls",
        "items": [
            {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"},
            {"key": "ca.crt", "path": "ca.crt"},
        ],
    }


def test_a_separate_client_ca_secret_supplies_ca_crt_into_the_same_directory():
    container = server(all_on())
    env = plain_env(container)
    assert {name: env[name] for name in TLS_ENV} == {
        "IDEMPOTENCY_TLS_CERT_FILE": f"{TLS_DIR}/tls.crt",
        "IDEMPOTENCY_TLS_KEY_FILE": f"{TLS_DIR}/tls.key",
        "IDEMPOTENCY_TLS_CLIENT_CA_FILE": f"{TLS_DIR}/ca.crt",
        "IDEMPOTENCY_TLS_CLIENT_AUTH": "required",
    }
    assert mounts_of(container)["tls"] == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
    assert [s["secret"] for s in volumes_of(pod_spec(all_on()))["tls"]["projected"]["sources"]] == [
        {
            "name": "idempotency-service-tls",
            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
        },
        {"name": "idempotency-client-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
    ]


def test_probes_and_the_test_pod_stay_on_the_plaintext_health_port_with_tls_on():
    container = server(all_on())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == HEALTH_PORT
    assert plain_env(container)["IDEMPOTENCY_HEALTH_LISTEN_ADDR"] == f"0.0.0.0:{HEALTH_PORT}"
    args = one(all_on(), "Pod")["spec"]["containers"][0]["args"]
    assert args[0] == f"-addr=idempotency-service.idempotency.svc:{HEALTH_PORT}"
    assert not [a for a in args if a.startswith("-tls")]
    service = one(all_on(), "Service", "idempotency-service")
    assert service["spec"]["ports"][-1] == {
        "name": "health", "port": HEALTH_PORT, "targetPort": "health", "protocol": "TCP", "appProtocol": "grpc"
    }


@pytest.mark.parametrize(
    "settings, message",
    [
        (("--set", "tls.enabled=true"), "tls.enabled needs tls.secretName"),
        (("--set", "tls.clientAuth=required"), "tls.clientAuth (mutual TLS) needs tls.enabled"),
        ((*TLS_ON, "--set", "tls.clientCaSecretName=ca"), "tls.clientCaSecretName is only used with tls.clientAuth"),
        (("--set", "tls.clientAuth=sometimes"), "/tls/clientAuth"),
        (("--set", "healthPort=50051"), "healthPort 50051 is already the gRPC or the metrics port"),
        (("--set", "healthPort=8464"), "healthPort 8464 is already the gRPC or the metrics port"),
    ],
)
def test_tls_and_health_port_settings_that_cannot_work_fail_the_render(settings, message):
    assert message in render_fails(*settings)


def test_the_health_port_may_reuse_the_metrics_port_number_when_metrics_are_off():
    docs = render("--set", "metrics.enabled=false", "--set", "healthPort=8464")
    assert server(docs)["readinessProbe"]["grpc"]["port"] == 8464


def test_without_a_policy_there_is_no_policy_variable_volume_or_configmap():
    container = server(default())
    assert "IDEMPOTENCY_POLICY_FILE" not in env_of(container)
    assert "policy" not in mounts_of(container)
    assert "policy" not in volumes_of(pod_spec(default()))
    assert not [d for d in default() if d["kind"] == "ConfigMap"]


@pytest.mark.parametrize(
    "setting, volume",
    [
        (
            "policy.existingSecret=idem-policy",
            {"secret": {"secretName": "idem-policy", "items": [{"key": "policy.toml", "path": "policy.toml"}]}},
        ),
        (
            "policy.existingConfigMap=idem-policy",
            {"configMap": {"name": "idem-policy", "items": [{"key": "policy.toml", "path": "policy.toml"}]}},
        ),
        (
            "policy.content=[[identity]]",
            {
                "configMap": {
                    "name": "idempotency-service-policy",
                    "items": [{"key": "policy.toml", "path": "policy.toml"}],
                }
            },
        ),
    ],
)
def test_each_policy_source_is_mounted_as_a_directory_and_named_by_the_policy_file(setting, volume):
    docs = render("--set", setting)
    container = server(docs)
    assert plain_env(container)["IDEMPOTENCY_POLICY_FILE"] == f"{POLICY_DIR}/policy.toml"
    assert mounts_of(container)["policy"] == {"name": "policy", "mountPath": POLICY_DIR, "readOnly": True}
    assert volumes_of(pod_spec(docs))["policy"] == {"name": "policy", **volume}
    # The chart renders a ConfigMap only for the inline policy.
    configmaps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(configmaps) == (1 if setting.startswith("policy.content") else 0)
    # The server reads the policy; the migration Job does not.
    assert "IDEMPOTENCY_POLICY_FILE" not in env_of(migrate_container(docs))


def test_the_inline_policy_becomes_the_charts_configmap_word_for_word():
    values = yaml.safe_load(ALL_ON.read_text())
    configmap = one(all_on(), "ConfigMap", "idempotency-service-policy")
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert configmap["data"] == {"policy.toml": values["policy"]["content"]}
    policy = tomllib.loads(configmap["data"]["policy.toml"])
    assert [identity["name"] for identity in policy["identity"]] == ["orders", "operator"]
    assert policy["identity"][0]["token_hashes"][0].startswith("sha256:")
    assert policy["namespace"] == [
        {"names": ["payments/*"], "remember_for": "90days", "late_retry": "refuse"}
    ]
    assert volumes_of(pod_spec(all_on()))["policy"]["configMap"]["name"] == "idempotency-service-policy"


def test_two_policy_sources_at_once_fail_the_render():
    stderr = render_fails("--set", "policy.existingSecret=a", "--set", "policy.existingConfigMap=b")
    assert "set at most one of policy.existingSecret, policy.existingConfigMap and policy.content" in stderr


def test_a_bearer_token_pasted_into_the_inline_policy_fails_the_render():
    token = "idem_" + "ab" * 32
    stderr = render_fails("--set", f'policy.content=token_hashes = ["{token}"]')
    assert "looks like a bearer token" in stderr
    assert token not in stderr


def test_limits_reach_the_server_only():
    assert {k: plain_env(server(default()))[k] for k in LIMITS_ENV} == LIMITS_ENV
    assert {k: plain_env(server(all_on()))[k] for k in LIMITS_ENV} == {
        "IDEMPOTENCY_MAX_CONCURRENT_CALLS": "2048",
        "IDEMPOTENCY_MAX_STREAMS_PER_CONNECTION": "64",
        "IDEMPOTENCY_CALL_TIMEOUT": "15s",
    }
    assert not set(LIMITS_ENV) & set(env_of(migrate_container(all_on())))


def test_the_wait_settings_reach_server_and_migration_job():
    for container in (server(all_on()), migrate_container(all_on())):
        env = plain_env(container)
        assert env["IDEMPOTENCY_MAX_WAIT"] == "20s"
        assert env["IDEMPOTENCY_MAX_WAITERS"] == "1000"


def test_the_remembered_keys_settings_reach_server_and_migration_job():
    # The server's defaults (7 days, re-execute) unless set.
    assert {k: plain_env(server(default()))[k] for k in ("IDEMPOTENCY_REMEMBER_FOR", "IDEMPOTENCY_LATE_RETRY")} == {
        "IDEMPOTENCY_REMEMBER_FOR": "7days",
        "IDEMPOTENCY_LATE_RETRY": "reexecute",
    }
    for container in (server(all_on()), migrate_container(all_on())):
        env = plain_env(container)
        assert env["IDEMPOTENCY_REMEMBER_FOR"] == "30days"
        assert env["IDEMPOTENCY_LATE_RETRY"] == "refuse"
    # 0s turns remembering off.
    docs = render("--set", "config.rememberFor=0s")
    assert plain_env(server(docs))["IDEMPOTENCY_REMEMBER_FOR"] == "0s"


def test_waiters_just_below_the_concurrent_calls_render():
    docs = render("--set", "config.maxWaiters=1023")
    env = plain_env(server(docs))
    assert (env["IDEMPOTENCY_MAX_WAITERS"], env["IDEMPOTENCY_MAX_CONCURRENT_CALLS"]) == ("1023", "1024")
    docs = render("--set", "config.maxWaiters=0", "--set", "limits.maxConcurrentCalls=1")
    assert plain_env(server(docs))["IDEMPOTENCY_MAX_WAITERS"] == "0"


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            ("--set", "config.maxWaiters=1024"),
            "config.maxWaiters (1024) must be below limits.maxConcurrentCalls (1024)",
        ),
        (
            ("--set", "limits.maxConcurrentCalls=100"),
            "config.maxWaiters (512) must be below limits.maxConcurrentCalls (100)",
        ),
    ],
)
def test_waiters_not_below_the_concurrent_calls_fail_the_render(settings, message):
    # The server would refuse to start: each waiting Claim is a call in flight.
    assert message in render_fails(*settings)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("limits.maxConcurrentCalls=0", "/limits/maxConcurrentCalls"),
        ("limits.maxStreamsPerConnection=0", "/limits/maxStreamsPerConnection"),
        ("limits.callTimeout=forever", "/limits/callTimeout"),
    ],
)
def test_the_schema_rejects_limits_that_cannot_work(setting, message):
    assert message in render_fails("--set", setting)


# --- values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, message",
    [
        ("unknownKey=1", "additional properties 'unknownKey' not allowed"),
        ("securityContext.readOnlyRootFilesystem=false", "value must be true"),
        ("podSecurityContext.runAsNonRoot=false", "value must be true"),
        ("config.logFormat=yaml", "/config/logFormat"),
        ("config.defaultLeaseTtl=soon", "/config/defaultLeaseTtl"),
        ("config.recordsGaugeInterval=hourly", "/config/recordsGaugeInterval"),
        ("config.maxWait=forever", "/config/maxWait"),
        ("config.maxWaiters=-1", "/config/maxWaiters"),
        ("config.rememberFor=forever", "/config/rememberFor"),
        ("config.lateRetry=retry", "/config/lateRetry"),
        ("config.metricsNamespaces={a,b,a}", "/config/metricsNamespaces"),
        ("config.metricsNamespaces={a\\,b}", "/config/metricsNamespaces/0"),
        ("config.metricsNamespaces={" + ",".join(f"n{i}" for i in range(101)) + "}", "/config/metricsNamespaces"),
        ("prometheusRule.enabled=yes", "/prometheusRule/enabled"),
    ],
)
def test_the_schema_rejects_values_that_would_weaken_or_break_the_deployment(setting, message):
    assert message in render_fails("--set", setting)


def test_every_key_in_values_yaml_has_a_description():
    keys = values_table.documented_keys((CHART / "values.yaml").read_text())
    assert len(keys) > 50
    assert [k.path for k in keys if not k.description] == []


def test_the_readme_values_table_is_the_one_generated_from_values_yaml():
    readme = (CHART / "README.md").read_text()
    generated = values_table.table((CHART / "values.yaml").read_text())
    assert values_table.readme_with_table(readme, generated) == readme


# --- NOTES.txt ------------------------------------------------------------------------------


def notes(*args: str) -> str:
    result = subprocess.run(
        [HELM, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:\n", 1)[1]


def test_notes_name_the_secret_the_endpoint_and_the_test():
    text = notes()
    assert 'of Secret\n"idempotency-service-database"' in text
    assert "idempotency-service.idempotency.svc:50051" in text
    assert "Prometheus metrics: /metrics on port 8464 of each pod and of the Service.\n" in text
    assert "helm test idempotency-service -n idempotency" in text
    assert "WARNING: DATABASE_URL" not in text


def test_notes_warn_that_without_a_policy_the_service_runs_open_and_tls_is_off():
    text = notes()
    assert "WARNING: no access policy is set" in text
    assert "runs OPEN" in text
    assert "idempotency-service token" in text
    assert "TLS: off." in text
    assert "grpcurl -plaintext localhost:50051" in text


def test_notes_report_tls_mutual_tls_and_the_policy_source_when_set():
    text = notes("-f", str(ALL_ON))
    assert "WARNING" not in text
    assert 'TLS: on. The gRPC port speaks TLS only, with tls.crt and tls.key of Secret "idempotency-service-tls"' in text
    assert "Mutual TLS: client certificates required" in text
    assert 'ca.crt of Secret "idempotency-client-ca"' in text
    assert 'Access policy: policy.toml of ConfigMap "idempotency-service-policy" (from policy.content)' in text
    assert "-cert client.crt -key client.key" in text
    assert "-plaintext" not in text
    secret = notes("--set", "policy.existingSecret=idem-policy")
    assert 'Access policy: policy.toml of Secret "idem-policy"' in secret
    configmap = notes("--set", "policy.existingConfigMap=idem-policy")
    assert 'Access policy: policy.toml of ConfigMap "idem-policy"' in configmap


def test_notes_warn_about_a_plain_text_database_url():
    text = notes("--set", "database.url=postgres://u:p@db/idem", "--set", "database.allowPlainTextUrl=true")
    assert "WARNING: DATABASE_URL was given as plain text" in text


# --- the gateway -----------------------------------------------------------------

GATEWAY_ROUTES = '[[route]]\nmethod = "POST"\npath = "/v1/charges"\nnamespace = "charges"\n'
GATEWAY_ON = (
    "--set", "gateway.enabled=true",
    "--set", "gateway.upstream=http://api.shop.svc:3000",
    "--set-string", f"gateway.routes={GATEWAY_ROUTES}",
)
GATEWAY_SELECTOR = {**SELECTOR, "app.kubernetes.io/component": "gateway"}


def test_the_gateway_is_off_by_default():
    assert not [d for d in default() if d["metadata"]["name"].endswith("-gateway")]


def test_the_gateway_renders_its_config_deployment_and_service_beside_the_server():
    docs = render(*GATEWAY_ON)
    assert kinds(docs) == sorted(
        kinds(default())
        + [
            ("ConfigMap", "idempotency-service-gateway"),
            ("Deployment", "idempotency-service-gateway"),
            ("Service", "idempotency-service-gateway"),
        ]
    )
    config = tomllib.loads(one(docs, "ConfigMap", "idempotency-service-gateway")["data"]["gateway.toml"])
    assert config["listen"] == "0.0.0.0:8080"
    assert config["admin_listen"] == "0.0.0.0:8465"
    assert config["upstream"] == "http://api.shop.svc:3000"
    assert config["service"] == f"http://idempotency-service.{NAMESPACE}.svc:50051"
    assert config["route"] == [{"method": "POST", "path": "/v1/charges", "namespace": "charges"}]
    assert "service_token_file" not in config
    deployment = one(docs, "Deployment", "idempotency-service-gateway")
    assert deployment["spec"]["selector"] == {"matchLabels": GATEWAY_SELECTOR}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["/usr/local/bin/idempotency-gateway"]
    server_pod = one(docs, "Deployment", "idempotency-service")["spec"]["template"]["spec"]
    assert container["image"] == server_pod["containers"][0]["image"]
    assert container["securityContext"] == server_pod["containers"][0]["securityContext"]
    assert pod["securityContext"] == server_pod["securityContext"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "gateway-admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "gateway-admin"}
    # Its shutdown (30 s) ends before the kill.
    assert config["shutdown_timeout"] == "30s"
    assert pod["terminationGracePeriodSeconds"] == 35
    service = one(docs, "Service", "idempotency-service-gateway")
    assert service["spec"]["selector"] == GATEWAY_SELECTOR
    assert service["spec"]["ports"][0]["targetPort"] == "gateway"
    # The server's Service and PDB never select the gateway's pods.
    assert one(docs, "Service", "idempotency-service")["spec"]["selector"] == SELECTOR
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"] == {"matchLabels": SELECTOR}


def test_the_gateway_with_a_policy_presents_its_token_from_a_secret():
    docs = render(
        *GATEWAY_ON,
        "--set", "gateway.tokenSecret=gateway-token",
        "--set", "policy.existingSecret=idempotency-policy",
    )
    config = tomllib.loads(one(docs, "ConfigMap", "idempotency-service-gateway")["data"]["gateway.toml"])
    assert config["service_token_file"] == "/etc/idempotency-gateway/token/token"
    pod = one(docs, "Deployment", "idempotency-service-gateway")["spec"]["template"]["spec"]
    assert volumes_of(pod)["idempotency-gateway-token"]["secret"] == {
        "secretName": "gateway-token",
        "items": [{"key": "token", "path": "token"}],
    }
    mounts = mounts_of(pod["containers"][0])
    assert mounts["idempotency-gateway-token"]["mountPath"] == "/etc/idempotency-gateway/token"


def test_the_network_policy_admits_the_charts_gateway():
    docs = render(*GATEWAY_ON, "--set", "networkPolicy.enabled=true",
                  "--set", "networkPolicy.grpcFrom[0].namespaceSelector.matchLabels.team=shop")
    peers = one(docs, "NetworkPolicy")["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": GATEWAY_SELECTOR}} in peers


@pytest.mark.parametrize(
    "settings, message",
    [
        (("--set", "gateway.enabled=true"), "gateway.enabled needs gateway.upstream"),
        ((*GATEWAY_ON, "--set", "tls.enabled=true", "--set", "tls.secretName=t"),
         "the gateway does not speak TLS to the server yet"),
        ((*GATEWAY_ON, "--set", "policy.existingSecret=p"), "needs gateway.tokenSecret"),
        ((*GATEWAY_ON[:2], "--set", "gateway.upstream=https://api:443"), "/gateway/upstream"),
    ],
)
def test_gateway_settings_that_cannot_work_fail_the_render(settings, message):
    assert message in render_fails(*settings)


GATEWAY_SIDECAR = CHART / "ci" / "gateway-sidecar-values.yaml"


def sidecar_snippet(text: str) -> dict:
    """The pod spec fields NOTES.txt prints for the gateway sidecar."""
    begin = text.index("# BEGIN idempotency-gateway sidecar")
    end = text.index("# END idempotency-gateway sidecar")
    return yaml.safe_load(text[begin:end])


def test_the_gateway_sidecar_renders_its_config_for_the_api_in_the_same_pod():
    docs = render("-f", str(GATEWAY_SIDECAR))
    assert kinds(docs) == sorted(kinds(default()) + [("ConfigMap", "idempotency-service-gateway-sidecar")])
    configmap = one(docs, "ConfigMap", "idempotency-service-gateway-sidecar")
    assert configmap["metadata"]["namespace"] == "shop"
    config = tomllib.loads(configmap["data"]["gateway.toml"])
    assert config["upstream"] == "http://127.0.0.1:3000"
    assert config["listen"] == "0.0.0.0:8080"
    assert config["service"] == f"http://idempotency-service.{NAMESPACE}.svc:50051"
    assert config["service_token_file"] == "/etc/idempotency-gateway/token/token"
    assert config["shutdown_timeout"] == "30s"
    assert config["route"] == [{"method": "POST", "path": "/v1/charges", "namespace": "charges"}]


def test_the_gateway_sidecar_snippet_in_the_notes_is_the_deployments_container():
    text = notes("-f", str(GATEWAY_SIDECAR), "--set", "gateway.enabled=true",
                 "--set", "gateway.upstream=http://api.shop.svc:3000")
    assert 'ConfigMap "idempotency-service-gateway-sidecar" in namespace shop' in text
    snippet = sidecar_snippet(text)
    deployment = one(
        render("-f", str(GATEWAY_SIDECAR), "--set", "gateway.enabled=true",
               "--set", "gateway.upstream=http://api.shop.svc:3000"),
        "Deployment", "idempotency-service-gateway",
    )
    pod = deployment["spec"]["template"]["spec"]
    assert snippet["containers"] == pod["containers"]
    assert snippet["terminationGracePeriodSeconds"] == pod["terminationGracePeriodSeconds"] == 35
    volumes = {v["name"]: v for v in snippet["volumes"]}
    assert volumes["idempotency-gateway-config"]["configMap"] == {"name": "idempotency-service-gateway-sidecar"}
    assert volumes["idempotency-gateway-token"]["secret"]["secretName"] == "idempotency-gateway-token"


def test_the_gateway_sidecar_snippet_makes_a_valid_pod_beside_an_api(tmp_path):
    snippet = sidecar_snippet(notes("-f", str(GATEWAY_SIDECAR)))
    api = {
        "name": "api",
        "image": "example.com/shop/api:1",
        "ports": [{"name": "http", "containerPort": 3000}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "api", "namespace": "shop"},
        "spec": {**snippet, "containers": [api, *snippet["containers"]]},
    }
    names = [p["name"] for c in pod["spec"]["containers"] for p in c["ports"]]
    assert len(names) == len(set(names)), names
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    validate = Path(sys.executable).parent / "kubernetes-validate"
    for kube in ("1.27.0", "1.37.0"):
        result = subprocess.run(
            [str(validate), "--strict", "--quiet", "-k", kube, str(manifest)],
            capture_output=True, text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        (("-f", str(GATEWAY_SIDECAR), "--set", "gateway.sidecar.apiPort=8080"),
         "gateway.sidecar.apiPort 8080 is the gateway's port"),
        (("-f", str(GATEWAY_SIDECAR), "--set", "gateway.tokenSecret="),
         "gateway.sidecar.enabled with a policy needs gateway.tokenSecret"),
        (("-f", str(GATEWAY_SIDECAR), "--set", "tls.enabled=true", "--set", "tls.secretName=t"),
         "gateway.sidecar.enabled with tls.enabled"),
    ],
)
def test_gateway_sidecar_settings_that_cannot_work_fail_the_render(settings, message):
    assert message in render_fails(*settings)
