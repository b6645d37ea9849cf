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
  "engine_resources" ($p.engineResources | default dict)) }}
{{- $d := $s.deployment }}
{{- $a := $d.autoscaling }}
{{- $deployment := dict "replicas" $d.replicas "routing" $d.routing "imbalance_threshold" $d.imbalanceThreshold "autoscaling" nil }}
{{- if $a.enabled }}
{{- $_ := set $deployment "autoscaling" (dict
  "min_replicas" $a.minReplicas
  "max_replicas" $a.maxReplicas
  "target_ongoing_requests" $a.targetOngoingRequests
  "upscale_delay_s" $a.upscaleDelaySeconds
  "downscale_delay_s" $a.downscaleDelaySeconds) }}
{{- end }}
{{- $_ := set $overrides "deployment" $deployment -}}
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
    # A stopping replica gives in-flight requests the preStop drain period (docs/reliability.md):
    # the ingress's HTTP streams, and an engine replica's (scale-down drains it).
    deployments:
      - name: SpecrelayServer
        graceful_shutdown_timeout_s: {{ .Values.drain.gracePeriodSeconds }}
      - name: EngineReplica
        graceful_shutdown_timeout_s: {{ .Values.drain.gracePeriodSeconds }}
{{- end }}

{{/* GPUs one engine replica takes: one per TP rank (its placement group), plus one for the
draft actor when the draft is a model (it sits outside the placement group). */}}
{{- define "specrelay.gpusPerReplica" -}}
{{- $s := .Values.specrelay -}}
{{- add (int $s.tensorParallelSize) (ternary 1 0 (eq $s.draft.kind "model")) }}
{{- end }}

{{/* Worker pods (worker.gpus GPUs each) that hold n engine replicas; args (list $ n). 0 when the
workers have no GPUs (nothing to size by). PACK/SPREAD: the replicas' GPUs over the pods' GPUs,
rounded up. STRICT_PACK: each replica's ranks in one pod, so a pod holds worker.gpus / TP of them.
STRICT_SPREAD: each rank on its own pod, so at least TP pods. */}}
{{- define "specrelay.podsFor" -}}
{{- $ctx := index . 0 }}{{- $n := index . 1 | int }}
{{- $g := int $ctx.Values.worker.gpus }}
{{- $tp := int $ctx.Values.specrelay.tensorParallelSize }}
{{- $strategy := $ctx.Values.specrelay.placement.verifierStrategy }}
{{- $pods := 0 }}
{{- if and (gt $g 0) (gt $n 0) }}
{{- $gpus := mul $n (include "specrelay.gpusPerReplica" $ctx | int) }}
{{- $pods = div (sub (add $gpus $g) 1) $g }}
{{- if and (eq $strategy "STRICT_PACK") (ge $g $tp) }}
{{- $perPod := div $g $tp }}
{{- $pods = max $pods (div (sub (add $n $perPod) 1) $perPod) }}
{{- else if eq $strategy "STRICT_SPREAD" }}
{{- $pods = max $pods $tp }}
{{- end }}
{{- end }}
{{- $pods }}
{{- end }}

{{- define "specrelay.autoscaling" -}}
{{- if .Values.specrelay.deployment.autoscaling.enabled }}true{{ end }}
{{- end }}

{{/* Worker group bounds. Autoscaling off: unset means "equal to replicas". Autoscaling on: unset
means the pods min (at least 1: Serve's proxy for the Service runs on a worker) and max engine
replicas need. */}}
{{- define "specrelay.minReplicas" -}}
{{- $w := .Values.worker }}
{{- if not (kindIs "invalid" $w.minReplicas) }}{{ $w.minReplicas | int }}
{{- else if include "specrelay.autoscaling" . }}
{{- max 1 (include "specrelay.podsFor" (list . .Values.specrelay.deployment.autoscaling.minReplicas) | int) }}
{{- else }}{{ $w.replicas | int }}
{{- end }}
{{- end }}

{{- define "specrelay.maxReplicas" -}}
{{- $w := .Values.worker }}
{{- if not (kindIs "invalid" $w.maxReplicas) }}{{ $w.maxReplicas | int }}
{{- else if include "specrelay.autoscaling" . }}
{{- max 1 (include "specrelay.podsFor" (list . .Values.specrelay.deployment.autoscaling.maxReplicas) | int) }}
{{- else }}{{ $w.replicas | int }}
{{- end }}
{{- end }}

{{/* Worker pods at start: worker.replicas, or with autoscaling the minimum (the autoscaler owns
the count from then on). */}}
{{- define "specrelay.workerReplicas" -}}
{{- if include "specrelay.autoscaling" . }}{{ include "specrelay.minReplicas" . }}
{{- else }}{{ .Values.worker.replicas | int }}
{{- end }}
{{- end }}

{{/* "N engine replica(s) x G GPUs (TP t + a draft GPU)" for error messages; args (list $ n). */}}
{{- define "specrelay.replicaGpusText" -}}
{{- $ctx := index . 0 }}{{- $n := index . 1 | int }}
{{- $s := $ctx.Values.specrelay }}
{{- printf "%d engine replica(s) x %s GPU(s) (tensorParallelSize %d%s)" $n (include "specrelay.gpusPerReplica" $ctx) (int $s.tensorParallelSize) (ternary " + 1 for the model draft" "" (eq $s.draft.kind "model")) }}
{{- end }}

{{/* Checks values.schema.json cannot express. */}}
{{- define "specrelay.validate" -}}
{{- $w := .Values.worker -}}
{{- $min := include "specrelay.minReplicas" . | int }}
{{- $max := include "specrelay.maxReplicas" . | int }}
{{- $a := .Values.specrelay.deployment.autoscaling }}
{{- if include "specrelay.autoscaling" . }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "specrelay.deployment.autoscaling.minReplicas (%d) must not exceed maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- if gt $min $max }}
{{- fail (printf "worker.minReplicas (%d) must not exceed worker.maxReplicas (%d)" $min $max) }}
{{- end }}
{{- $need := include "specrelay.podsFor" (list . $a.maxReplicas) | int }}
{{- if gt $need $max }}
{{- fail (printf "specrelay.deployment.autoscaling.maxReplicas: %s need %d worker pod(s) of worker.gpus %d (placement %s); worker.maxReplicas (%d) x worker.gpus (%d) cannot hold them (raise worker.maxReplicas or worker.gpus, or lower maxReplicas)" (include "specrelay.replicaGpusText" (list . $a.maxReplicas)) $need (int $w.gpus) .Values.specrelay.placement.verifierStrategy $max (int $w.gpus)) }}
{{- end }}
{{- else }}
{{- if gt $min (int $w.replicas) }}
{{- fail (printf "worker.minReplicas (%d) must not exceed worker.replicas (%d)" $min (int $w.replicas)) }}
{{- end }}
{{- if lt $max (int $w.replicas) }}
{{- fail (printf "worker.maxReplicas (%d) must be at least worker.replicas (%d)" $max (int $w.replicas)) }}
{{- end }}
{{- end }}
{{- $gpus := mul (int $w.gpus) (int $w.replicas) }}
{{- if and (eq .Values.specrelay.placement.verifierStrategy "STRICT_PACK") (gt (int $w.gpus) 0) (gt (int .Values.specrelay.tensorParallelSize) (int $w.gpus)) }}
{{- fail (printf "specrelay.placement.verifierStrategy STRICT_PACK puts all %d ranks on one node; a worker has %d GPUs (use PACK or raise worker.gpus)" (int .Values.specrelay.tensorParallelSize) (int $w.gpus)) }}
{{- end }}
{{- if and (gt (int $w.gpus) 0) (gt (int .Values.specrelay.tensorParallelSize) (int $gpus)) (not (include "specrelay.autoscaling" .)) }}
{{- fail (printf "specrelay.tensorParallelSize (%d) needs one GPU per rank; the worker group has %d (worker.gpus x worker.replicas)" (int .Values.specrelay.tensorParallelSize) (int $gpus)) }}
{{- end }}
{{- $n := .Values.specrelay.deployment.replicas | int }}
{{- $need := include "specrelay.podsFor" (list . $n) | int }}
{{- if and (not (include "specrelay.autoscaling" .)) (gt $need (int $w.replicas)) }}
{{- fail (printf "specrelay.deployment.replicas: %s need %d worker pod(s) of worker.gpus %d (placement %s); worker.replicas is %d" (include "specrelay.replicaGpusText" (list . $n)) $need (int $w.gpus) .Values.specrelay.placement.verifierStrategy (int $w.replicas)) }}
{{- end }}
{{- end }}
