{{/* The release's objects are named after it: <release>-tollgate, or the release's own name when it already says tollgate. */}}
{{- define "tollgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* On every pod the chart runs: the injector webhook leaves them alone (they carry tollgate
already, or need none), whatever their namespace's label says. */}}
{{- define "tollgate.podLabels" -}}
{{ include "tollgate.labels" . }}
tollgate.io/inject: disabled
{{- end -}}

{{- define "tollgate.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tollgate
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component (inference, redis, ledger, injector). */}}
{{- define "tollgate.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The Redis tollgate uses with store: redis: the URL given, else the release's own. */}}
{{- define "tollgate.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.deploy -}}
{{- printf "redis://%s-redis:6379" (include "tollgate.fullname" .) -}}
{{- else -}}
{{- fail "store: redis with redis.deploy: false needs redis.url (the Redis you run, redis://host:6379)" -}}
{{- end -}}
{{- end -}}

{{/* The policy the pods mount: the values' policy or the example, with the store and ledger the
values choose. */}}
{{- define "tollgate.policy" -}}
{{- $policy := deepCopy .Values.policy -}}
{{- if not $policy -}}
{{- $policy = .Files.Get "files/policy.yaml" | fromYaml -}}
{{- end -}}
{{/* The addresses the pod spec relies on: Envoy's bootstrap calls 127.0.0.1:50051, the probes
50052, Prometheus 9090. A policy that leaves them out gets them; one that names others is refused. */}}
{{- $server := default dict $policy.server -}}
{{- range $field, $address := dict "listen" "127.0.0.1:50051" "health_listen" "0.0.0.0:50052" "admin_listen" "0.0.0.0:9090" -}}
{{- if not (hasKey $server $field) -}}
{{- $_ := set $server $field $address -}}
{{- else if ne (index $server $field) $address -}}
{{- fail (printf "policy.server.%s must be %s (or left out): the pod's Envoy, probes and scrape rely on it" $field $address) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $policy "server" $server -}}
{{- if eq .Values.store "redis" -}}
{{- if not (hasKey $policy "store") -}}
{{- $_ := set $policy "store" (dict "redis_url" (include "tollgate.redisUrl" .) "command_timeout_ms" 250) -}}
{{- end -}}
{{- if and .Values.ledger.enabled (not (hasKey $policy "ledger")) -}}
{{- $_ := set $policy "ledger" (dict "max_len" .Values.ledger.maxLen "retention_ms" .Values.ledger.retentionMs) -}}
{{- end -}}
{{- else if and (hasKey $policy "store") (or (hasKey $policy.store "redis_url") (hasKey $policy.store "redis_cluster")) -}}
{{- fail "store: embedded, but the policy names a Redis: remove it from policy.store, or set store: redis" -}}
{{- end -}}
{{- toYaml $policy -}}
{{- end -}}
