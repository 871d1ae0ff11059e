{{/*
Helpers of the kvrouter chart; every name starts with "kvrouter.".
*/}}

{{- define "kvrouter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or the release name when it holds the chart name; at most 40
characters so that "<fullname>-<pool>-<ordinal>" stays a valid pod and DNS name. */}}
{{- define "kvrouter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvrouter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "kvrouter.labels" -}}
helm.sh/chart: {{ include "kvrouter.chart" . }}
{{ include "kvrouter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvrouter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrouter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway"). */}}
{{- define "kvrouter.componentSelector" -}}
{{ include "kvrouter.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvrouter.componentLabels" -}}
{{ include "kvrouter.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvrouter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvrouter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvrouter.routerImage" -}}
{{ .Values.image.router.repository }}:{{ .Values.image.router.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "kvrouter.workerImage" -}}
{{ .Values.image.worker.repository }}:{{ .Values.image.worker.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The chart's own Secret (generated values). */}}
{{- define "kvrouter.secretName" -}}
{{ include "kvrouter.fullname" . }}
{{- end }}

{{/* The Secret holding `api-keys` and `internal-token`. */}}
{{- define "kvrouter.authSecretName" -}}
{{ .Values.auth.existingSecret | default (include "kvrouter.secretName" .) }}
{{- end }}

{{/* Whether the gateway asks clients for a key: "true" or "". */}}
{{- define "kvrouter.apiKeysOn" -}}
{{- if or .Values.auth.existingSecret .Values.auth.apiKeys .Values.auth.generateApiKey }}true{{ end }}
{{- end }}

{{- define "kvrouter.redisName" -}}
{{ include "kvrouter.fullname" . }}-redis
{{- end }}

{{/*
Environment that ends with "<PREFIX>REDIS_URL" (dict "root" $ "prefix" "KVROUTER_"). The
password comes from a Secret into REDIS_PASSWORD and Kubernetes expands $(REDIS_PASSWORD)
inside the URL, so it never appears in the rendered objects.
*/}}
{{- define "kvrouter.redisEnv" -}}
{{- $root := .root }}
{{- if $root.Values.redis.bundled.enabled }}
{{- $host := printf "%s.%s.svc.%s" (include "kvrouter.redisName" $root) $root.Release.Namespace $root.Values.clusterDomain }}
{{- if $root.Values.redis.bundled.auth }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrouter.secretName" $root }}
      key: redis-password
- name: {{ .prefix }}REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" $host | quote }}
{{- else }}
- name: {{ .prefix }}REDIS_URL
  value: {{ printf "redis://%s:6379/0" $host | quote }}
{{- end }}
{{- else }}
{{- $url := required "redis.external.url is required when redis.bundled.enabled is false" $root.Values.redis.external.url }}
{{- if $root.Values.redis.external.passwordSecret.name }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.redis.external.passwordSecret.name }}
      key: {{ $root.Values.redis.external.passwordSecret.key }}
{{- $userinfo := printf "%s:$(REDIS_PASSWORD)@" $root.Values.redis.external.username }}
- name: {{ .prefix }}REDIS_URL
  value: {{ regexReplaceAll "^(rediss?)://" $url (printf "${1}://%s" $userinfo) | quote }}
{{- else }}
- name: {{ .prefix }}REDIS_URL
  value: {{ $url | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* POD_NAME from the downward API. */}}
{{- define "kvrouter.podNameEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}

{{/*
A worker pool with the shared worker settings filled in: (dict "root" $ "pool" $pool) ->
YAML of the effective settings. A pool's key replaces the shared one; tiers and ssdVolume
merge key by key (so a pool may set only tiers.ssdBlocks).
*/}}
{{- define "kvrouter.workerPool" -}}
{{- $w := .root.Values.workers }}
{{- $cfg := dict "gpu" $w.gpu "resources" $w.resources "nodeSelector" $w.nodeSelector "tolerations" $w.tolerations "affinity" $w.affinity "tiers" (deepCopy $w.tiers) "ssdVolume" (deepCopy $w.ssdVolume) "profile" $w.profile }}
{{- range $key, $value := .pool }}
{{- if and (has $key (list "tiers" "ssdVolume")) (kindIs "map" $value) }}
{{- range $k, $v := $value }}
{{- $_ := set (get $cfg $key) $k $v }}
{{- end }}
{{- else }}
{{- $_ := set $cfg $key $value }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The headless Service (and StatefulSet) name of a pool: (dict "root" $ "pool" $pool). */}}
{{- define "kvrouter.workerName" -}}
{{ include "kvrouter.fullname" .root }}-{{ .pool.name }}
{{- end }}

{{/* The DNS name routers dial for one worker pod: (dict "root" $ "pool" $pool "pod" "$(POD_NAME)"). */}}
{{- define "kvrouter.workerHost" -}}
{{- $svc := include "kvrouter.workerName" . }}
{{- printf "%s.%s.%s.svc.%s" .pod $svc .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* The prefill/decode mode of the gateway. */}}
{{- define "kvrouter.pd" -}}
{{- if .Values.gateway.pd }}
{{- .Values.gateway.pd }}
{{- else }}
{{- $roles := list }}
{{- range .Values.workers.pools }}{{ $roles = append $roles .role }}{{ end }}
{{- if and (has "prefill" $roles) (has "decode" $roles) }}always{{ else }}never{{ end }}
{{- end }}
{{- end }}

{{/* Hosts the gateway may dial (a JSON array): every pod of every pool, plus allowedWorkers. */}}
{{- define "kvrouter.allowedWorkers" -}}
{{- $hosts := list }}
{{- if .Values.gateway.restrictWorkers }}
{{- range $pool := .Values.workers.pools }}
{{- range $i := until (int $pool.replicas) }}
{{- $pod := printf "%s-%d" (include "kvrouter.workerName" (dict "root" $ "pool" $pool)) $i }}
{{- $hosts = append $hosts (include "kvrouter.workerHost" (dict "root" $ "pool" $pool "pod" $pod)) }}
{{- end }}
{{- end }}
{{- end }}
{{- concat $hosts .Values.gateway.allowedWorkers | toJson }}
{{- end }}

{{/* Pod-level settings shared by every component. */}}
{{- define "kvrouter.podCommon" -}}
serviceAccountName: {{ include "kvrouter.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of (dict with those keys). */}}
{{- define "kvrouter.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The /tmp volume every container writes to (the root filesystem is read-only). */}}
{{- define "kvrouter.tmpVolume" -}}
- name: tmp
  emptyDir: {}
{{- end }}
