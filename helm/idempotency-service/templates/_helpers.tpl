{{/*
Names, labels and the pieces the Deployment and the migration Job share.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "idempotency-service.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else the release name
when it already contains the chart name, else "<release>-<chart>".
Truncated to 63 characters because some names are DNS labels.
*/}}
{{- define "idempotency-service.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "idempotency-service.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the server pods; never change them after a release. */}}
{{- define "idempotency-service.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idempotency-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Labels that select the gateway's pods (never the server's). */}}
{{- define "idempotency-service.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "idempotency-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* Labels of every resource. */}}
{{- define "idempotency-service.labels" -}}
helm.sh/chart: {{ include "idempotency-service.chart" . }}
app.kubernetes.io/name: {{ include "idempotency-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: idempotency-service
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "idempotency-service.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "idempotency-service.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "idempotency-service.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "idempotency-service.databaseSecretName" -}}
{{- default (printf "%s-database" (include "idempotency-service.fullname" .)) .Values.database.existingSecret.name }}
{{- end }}

{{/* Replicas that run at the least: what decides whether a PDB makes sense. */}}
{{- define "idempotency-service.minReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.minReplicas }}{{ else }}{{ .Values.replicaCount }}{{ end }}
{{- end }}

{{/*
DATABASE_URL: from the existing Secret, or as plain text only with the explicit
opt-in. A url without the opt-in fails the render rather than being ignored, so
nobody believes a value is in use that is not. With database.urlFromFile the
Secret is mounted instead (databaseVolume) and DATABASE_URL_FILE names the file;
the server refuses both variables at once, so DATABASE_URL is then not set.
*/}}
{{- define "idempotency-service.databaseUrlEnv" -}}
{{- if .Values.database.url }}
{{- if not .Values.database.allowPlainTextUrl }}
{{- fail "database.url is set but database.allowPlainTextUrl is false: put DATABASE_URL in a Secret and set database.existingSecret.name, or opt in to plain text with database.allowPlainTextUrl=true" }}
{{- end }}
{{- if .Values.database.urlFromFile }}
{{- fail "database.urlFromFile mounts database.existingSecret as a file, but database.url is set: put the URL in the Secret and unset database.url" }}
{{- end }}
- name: DATABASE_URL
  value: {{ .Values.database.url | quote }}
{{- else if .Values.database.urlFromFile }}
- name: DATABASE_URL_FILE
  value: {{ include "idempotency-service.databaseUrlFile" . | quote }}
{{- else }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "idempotency-service.databaseSecretName" . }}
      key: {{ .Values.database.existingSecret.key }}
{{- end }}
{{- end }}

{{/* Every server setting from .Values.config, shared by the server and the migration Job. */}}
{{- define "idempotency-service.configEnv" -}}
{{- with .Values.config }}
- name: IDEMPOTENCY_DEFAULT_LEASE_TTL
  value: {{ .defaultLeaseTtl | quote }}
- name: IDEMPOTENCY_MAX_LEASE_TTL
  value: {{ .maxLeaseTtl | quote }}
- name: IDEMPOTENCY_DEFAULT_RETENTION
  value: {{ .defaultRetention | quote }}
- name: IDEMPOTENCY_MAX_RETENTION
  value: {{ .maxRetention | quote }}
- name: IDEMPOTENCY_MAX_RESPONSE_BYTES
  value: {{ .maxResponseBytes | int64 | quote }}
- name: IDEMPOTENCY_MAX_CHECKPOINT_BYTES
  value: {{ .maxCheckpointBytes | int64 | quote }}
- name: IDEMPOTENCY_MAX_WAIT
  value: {{ .maxWait | quote }}
- name: IDEMPOTENCY_MAX_WAITERS
  value: {{ .maxWaiters | int64 | quote }}
- name: IDEMPOTENCY_REMEMBER_FOR
  value: {{ .rememberFor | quote }}
- name: IDEMPOTENCY_LATE_RETRY
  value: {{ .lateRetry | quote }}
- name: IDEMPOTENCY_REAPER_INTERVAL
  value: {{ .reaperInterval | quote }}
- name: IDEMPOTENCY_REAPER_BATCH_SIZE
  value: {{ .reaperBatchSize | int64 | quote }}
- name: IDEMPOTENCY_DB_POOL_SIZE
  value: {{ .dbPoolSize | int64 | quote }}
- name: IDEMPOTENCY_DB_TIMEOUT
  value: {{ .dbTimeout | quote }}
- name: IDEMPOTENCY_HEALTH_CHECK_INTERVAL
  value: {{ .healthCheckInterval | quote }}
- name: IDEMPOTENCY_SHUTDOWN_TIMEOUT
  value: {{ printf "%ds" (.shutdownTimeoutSeconds | int64) | quote }}
- name: IDEMPOTENCY_LOG_FORMAT
  value: {{ .logFormat | quote }}
- name: RUST_LOG
  value: {{ .logFilter | quote }}
- name: IDEMPOTENCY_RECORDS_GAUGE_INTERVAL
  value: {{ .recordsGaugeInterval | quote }}
{{- /* Unset when empty: an empty value would be one namespace named "". */}}
{{- with .metricsNamespaces }}
- name: IDEMPOTENCY_METRICS_NAMESPACES
  value: {{ join "," . | quote }}
{{- end }}
{{- if .dataDir }}
- name: IDEMPOTENCY_DATA_DIR
  value: {{ .dataDir | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes every pod of the server image gets: a writable /tmp on a read-only root. */}}
{{- define "idempotency-service.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{/* Where database.urlFromFile puts the URL: one file in a directory mount. */}}
{{- define "idempotency-service.databaseDir" -}}
/etc/idempotency/database
{{- end }}

{{- define "idempotency-service.databaseUrlFile" -}}
{{- printf "%s/database-url" (include "idempotency-service.databaseDir" .) }}
{{- end }}

{{/* The database Secret's key as a file (with database.urlFromFile): volume, then mount. */}}
{{- define "idempotency-service.databaseVolume" -}}
- name: database
  secret:
    secretName: {{ include "idempotency-service.databaseSecretName" . }}
    items:
      - key: {{ .Values.database.existingSecret.key }}
        path: database-url
{{- end }}

{{- define "idempotency-service.databaseVolumeMount" -}}
- name: database
  mountPath: {{ include "idempotency-service.databaseDir" . }}
  readOnly: true
{{- end }}

{{/* The TLS files and the access policy: directory mounts, never subPath (see deployment.yaml). */}}
{{- define "idempotency-service.tlsDir" -}}
/etc/idempotency/tls
{{- end }}

{{- define "idempotency-service.policyDir" -}}
/etc/idempotency/policy
{{- end }}

{{- define "idempotency-service.policyConfigMapName" -}}
{{- printf "%s-policy" (include "idempotency-service.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Non-empty when an access policy is configured, from whichever source. */}}
{{- define "idempotency-service.policyEnabled" -}}
{{- with .Values.policy }}{{ if or .existingSecret .existingConfigMap .content }}true{{ end }}{{ end }}
{{- end }}

{{/*
Settings that only make sense together. Each mistake fails the render with
what to change, rather than deploying something other than what was asked.
*/}}
{{- define "idempotency-service.validate" -}}
{{- with .Values.tls }}
{{- if and .enabled (not .secretName) }}
{{- fail "tls.enabled needs tls.secretName: an existing kubernetes.io/tls Secret with tls.crt and tls.key (e.g. from a cert-manager Certificate)" }}
{{- end }}
{{- if and .clientAuth (not .enabled) }}
{{- fail "tls.clientAuth (mutual TLS) needs tls.enabled and tls.secretName" }}
{{- end }}
{{- if and .clientCaSecretName (not .clientAuth) }}
{{- fail "tls.clientCaSecretName is only used with tls.clientAuth (required or optional); set it or unset tls.clientCaSecretName" }}
{{- end }}
{{- end }}
{{- with .Values.policy }}
{{- $sources := 0 }}
{{- range (list .existingSecret .existingConfigMap .content) }}{{ if . }}{{ $sources = add1 $sources }}{{ end }}{{ end }}
{{- if gt $sources 1 }}
{{- fail "set at most one of policy.existingSecret, policy.existingConfigMap and policy.content" }}
{{- end }}
{{- if regexMatch "idem_[0-9a-f]{64}" .content }}
{{- fail "policy.content holds what looks like a bearer token (idem_...): put only its hash in the policy (token_hashes = [\"sha256:...\"], printed by `idempotency-service token` or `idempotency-service token --hash`)" }}
{{- end }}
{{- end }}
{{- /* Each waiting Claim holds a call slot; the server lets at most half of them wait. */}}
{{- if ge (int64 .Values.config.maxWaiters) (int64 .Values.limits.maxConcurrentCalls) }}
{{- fail (printf "config.maxWaiters (%d) must be below limits.maxConcurrentCalls (%d): each waiting Claim is a call in flight (the server lets at most half of them wait)" (int64 .Values.config.maxWaiters) (int64 .Values.limits.maxConcurrentCalls)) }}
{{- end }}
{{- with .Values.gateway }}
{{- if .enabled }}
{{- if not .upstream }}
{{- fail "gateway.enabled needs gateway.upstream: the API behind the gateway, http://host:port" }}
{{- end }}
{{- if $.Values.tls.enabled }}
{{- fail "gateway.enabled with tls.enabled: the gateway does not speak TLS to the server yet; turn one off" }}
{{- end }}
{{- if and (include "idempotency-service.policyEnabled" $) (not .tokenSecret) }}
{{- fail "gateway.enabled with a policy needs gateway.tokenSecret: a Secret whose key `token` is the gateway's bearer token" }}
{{- end }}
{{- end }}
{{- if .sidecar.enabled }}
{{- if $.Values.tls.enabled }}
{{- fail "gateway.sidecar.enabled with tls.enabled: the gateway does not speak TLS to the server yet; turn one off" }}
{{- end }}
{{- if and (include "idempotency-service.policyEnabled" $) (not .tokenSecret) }}
{{- fail "gateway.sidecar.enabled with a policy needs gateway.tokenSecret: a Secret whose key `token` is the gateway's bearer token, in the API's namespace" }}
{{- end }}
{{- if has (int .sidecar.apiPort) (list (int .port) (int .adminPort)) }}
{{- fail (printf "gateway.sidecar.apiPort %d is the gateway's port or admin port: in one pod they must differ" (int .sidecar.apiPort)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $ports := list (int .Values.grpc.port) }}
{{- if .Values.metrics.enabled }}{{ $ports = append $ports (int .Values.metrics.port) }}{{ end }}
{{- if has (int .Values.healthPort) $ports }}
{{- fail (printf "healthPort %d is already the gRPC or the metrics port: pick another" (int .Values.healthPort)) }}
{{- end }}
{{- end }}

{{/*
idempotency-gateway's config file: where it listens, the API behind it
(`upstream`), this release's server as its store, its shutdown grace, then
the routes as given. Called with (dict "root" $ "upstream" URL).
*/}}
{{- define "idempotency-service.gatewayConfig" -}}
{{- $root := .root -}}
{{- $upstream := .upstream -}}
{{- $fullname := include "idempotency-service.fullname" $root -}}
{{- with $root.Values.gateway -}}
listen = {{ printf "%s:%d" $root.Values.bindHost (.port | int) | quote }}
admin_listen = {{ printf "%s:%d" $root.Values.bindHost (.adminPort | int) | quote }}
upstream = {{ $upstream | quote }}
service = {{ printf "http://%s.%s.svc:%d" $fullname $root.Release.Namespace ($root.Values.service.port | int) | quote }}
shutdown_timeout = {{ printf "%ds" (.shutdownTimeoutSeconds | int) | quote }}
{{- if .tokenSecret }}
service_token_file = "/etc/idempotency-gateway/token/token"
{{- end }}
{{- with .routes }}

{{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The gateway's container, as a list item: the Deployment's, and the one
NOTES.txt prints for an API's pods in sidecar mode. Its names (the
container, its ports, its volumes) start with "gateway" or
"idempotency-gateway", so that they do not collide with an API's.
*/}}
{{- define "idempotency-service.gatewayContainer" -}}
{{- with .Values.gateway -}}
- name: idempotency-gateway
  image: {{ include "idempotency-service.image" $ | quote }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: ["/usr/local/bin/idempotency-gateway"]
  args: ["--config", "/etc/idempotency-gateway/config/gateway.toml"]
  ports:
    - name: gateway
      containerPort: {{ .port }}
      protocol: TCP
    - name: gateway-admin
      containerPort: {{ .adminPort }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /readyz
      port: gateway-admin
    periodSeconds: 5
  livenessProbe:
    httpGet:
      path: /healthz
      port: gateway-admin
    periodSeconds: 10
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: idempotency-gateway-config
      mountPath: /etc/idempotency-gateway/config
      readOnly: true
    {{- if .tokenSecret }}
    - name: idempotency-gateway-token
      mountPath: /etc/idempotency-gateway/token
      readOnly: true
    {{- end }}
{{- end }}
{{- end }}

{{/* The gateway container's volumes; (dict "root" $ "configMap" NAME). */}}
{{- define "idempotency-service.gatewayVolumes" -}}
- name: idempotency-gateway-config
  configMap:
    name: {{ .configMap }}
{{- with .root.Values.gateway.tokenSecret }}
- name: idempotency-gateway-token
  secret:
    secretName: {{ . }}
    items:
      - key: token
        path: token
{{- end }}
{{- end }}

{{/* The sidecar's ConfigMap: the name NOTES.txt's volume refers to. */}}
{{- define "idempotency-service.gatewaySidecarName" -}}
{{- printf "%s-gateway-sidecar" (include "idempotency-service.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
