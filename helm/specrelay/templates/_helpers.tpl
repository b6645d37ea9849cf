{{/* Names and labels. */}}
{{- define "specrelay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specrelay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "specrelay.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "specrelay.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "specrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specrelay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specrelay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels every Ray pod (head and workers) carries; the NetworkPolicy selects by them. */}}
{{- define "specrelay.rayPodLabels" -}}
{{ include "specrelay.selectorLabels" . }}
app.kubernetes.io/component: ray
{{- end }}

{{- define "specrelay.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "specrelay.rayAuthSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "specrelay.fullname" .)) }}
{{- end }}

{{- define "specrelay.apiKeySecret" -}}
{{- .Values.specrelay.apiKey.existingSecret | default (printf "%s-api-key" (include "specrelay.fullname" .)) }}
{{- end }}

{{/*
A Secret value: the given one, else the one already in the cluster (so upgrades keep it),
else a fresh random one. Args: (list $ secretName key given).
*/}}
{{- define "specrelay.secretValue" -}}
{{- $ctx := index . 0 }}{{- $name := index . 1 }}{{- $key := index . 2 }}{{- $given := index . 3 }}
{{- if $given }}
{{- $given | b64enc }}
{{- else }}
{{- $old := lookup "v1" "Secret" $ctx.Release.Namespace $name }}
{{- if and $old $old.data (hasKey $old.data $key) }}
{{- index $old.data $key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}
{{- end }}

{{/* Env shared by every Ray container: tracing, API key, Serve proxy guard, Ray token auth,
extras. The Serve proxy (one per node) runs pipeline.frontend.proxy_guard's middleware, which
keys its own /-/routes and /-/healthz with SPECRELAY_API_KEY (docs/reliability.md). */}}
{{- define "specrelay.env" -}}
- name: OTEL_SERVICE_NAME
  value: {{ .Values.otel.serviceName | quote }}
- name: SPECRELAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "specrelay.apiKeySecret" . }}
      key: {{ .Values.specrelay.apiKey.secretKey }}
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: "pipeline.frontend.proxy_guard:proxy_middlewares"
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "specrelay.rayAuthSecret" . }}
      key: auth_token
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Ray ports every node pins (the defaults of some are random). */}}
{{- define "specrelay.nodeStartParams" -}}
{{- $p := .Values.ray.ports -}}
metrics-export-port: {{ $p.metrics | quote }}
dashboard-agent-listen-port: {{ $p.dashboardAgentListen | quote }}
dashboard-agent-grpc-port: {{ $p.dashboardAgentGrpc | quote }}
runtime-env-agent-port: {{ $p.runtimeEnvAgent | quote }}
node-manager-port: {{ $p.nodeManager | quote }}
object-manager-port: {{ $p.objectManager | quote }}
min-worker-port: {{ $p.minWorker | quote }}
max-worker-port: {{ $p.maxWorker | quote }}
{{- end }}

{{/* Drain on termination: stay up while in-flight requests finish. */}}
{{- define "specrelay.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["/bin/sh", "-c", "sleep {{ .Values.drain.gracePeriodSeconds }}"]
{{- end }}

{{- define "specrelay.terminationGracePeriodSeconds" -}}
{{ add .Values.drain.gracePeriodSeconds .Values.drain.shutdownSeconds }}
{{- end }}

{{- define "specrelay.volumeMounts" -}}
{{- with .Values.extraVolumeMounts }}
volumeMounts:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "specrelay.volumes" -}}
{{- with .Values.extraVolumes }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The Serve config KubeRay deploys (serveConfigV2), as YAML. */}}
{{- define "specrelay.serveConfig" -}}
{{- $s := .Values.specrelay -}}
{{- $overrides := dict
  "target_model" $s.model
  "draft_kind" $s.draft.kind
  "num_speculative_tokens" $s.draft.numSpeculativeTokens
  "tensor_parallel_size" $s.tensorParallelSize -}}
{{- if eq $s.draft.kind "model" }}
{{- $_ := set $overrides "draft_model" $s.draft.model }}
{{- end }}
{{- /* The config's tracing section: the chart's otel values decide (config beats OTEL_* env). */}}
{{- if .Values.otel.endpoint }}
{{- $_ := set $overrides "tracing" (dict "exporter" "otlp" "otlp_protocol" .Values.otel.protocol "otlp_endpoint" .Values.otel.endpoint) }}
{{- else }}
{{- $_ := set $overrides "tracing" (dict "exporter" "none") }}
{{- end }}
{{- $p := $s.placement }}
{{- $_ := set $overrides "placement" (dict
  "verifier_strategy" $p.verifierStrategy
  "verifier_resources" ($p.verifierResources | default dict)
  "draft_resources" ($p.draftResources | default dict)
  "output_resources" ($p.outputResources | default dict)
  "engine_resources" ($p.engineResources | default dict)) -}}
http_options:
  host: 0.0.0.0
  port: {{ .Values.service.port }}
applications:
  - name: specrelay
    route_prefix: /
    import_path: actors.serve_app:build_app
    args:
      config: {{ $s.config | quote }}
      max_choices_per_request: {{ $s.maxChoicesPerRequest }}
      overrides:
        {{- toYaml $overrides | nindent 8 }}
    # A stopping replica gives in-flight requests the preStop drain period (docs/reliability.md).
    deployments:
      - name: SpecrelayServer
        graceful_shutdown_timeout_s: {{ .Values.drain.gracePeriodSeconds }}
{{- end }}

{{/* Worker group bounds; unset means "equal to replicas" (no autoscaling). */}}
{{- define "specrelay.minReplicas" -}}
{{- ternary .Values.worker.replicas .Values.worker.minReplicas (kindIs "invalid" .Values.worker.minReplicas) | int }}
{{- end }}

{{- define "specrelay.maxReplicas" -}}
{{- ternary .Values.worker.replicas .Values.worker.maxReplicas (kindIs "invalid" .Values.worker.maxReplicas) | int }}
{{- end }}

{{/* Checks values.schema.json cannot express. */}}
{{- define "specrelay.validate" -}}
{{- $w := .Values.worker -}}
{{- $min := include "specrelay.minReplicas" . | int }}
{{- $max := include "specrelay.maxReplicas" . | int }}
{{- if gt $min (int $w.replicas) }}
{{- fail (printf "worker.minReplicas (%d) must not exceed worker.replicas (%d)" $min (int $w.replicas)) }}
{{- end }}
{{- if lt $max (int $w.replicas) }}
{{- fail (printf "worker.maxReplicas (%d) must be at least worker.replicas (%d)" $max (int $w.replicas)) }}
{{- end }}
{{- $gpus := mul (int $w.gpus) (int $w.replicas) }}
{{- if and (eq .Values.specrelay.placement.verifierStrategy "STRICT_PACK") (gt (int $w.gpus) 0) (gt (int .Values.specrelay.tensorParallelSize) (int $w.gpus)) }}
{{- fail (printf "specrelay.placement.verifierStrategy STRICT_PACK puts all %d ranks on one node; a worker has %d GPUs (use PACK or raise worker.gpus)" (int .Values.specrelay.tensorParallelSize) (int $w.gpus)) }}
{{- end }}
{{- if and (gt (int $w.gpus) 0) (gt (int .Values.specrelay.tensorParallelSize) (int $gpus)) }}
{{- fail (printf "specrelay.tensorParallelSize (%d) needs one GPU per rank; the worker group has %d (worker.gpus x worker.replicas)" (int .Values.specrelay.tensorParallelSize) (int $gpus)) }}
{{- end }}
{{- end }}
