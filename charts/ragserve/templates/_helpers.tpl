{{/* Names, labels and images. */}}
{{- define "ragserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ragserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 35 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 35 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 35 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* ragserve.component: (list $ "router") -> "<fullname>-router" */}}
{{- define "ragserve.component" -}}
{{- printf "%s-%s" (include "ragserve.fullname" (index . 0)) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ragserve.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "ragserve.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* ragserve.labels: (list $ "component") */}}
{{- define "ragserve.labels" -}}
{{- $ := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $.Chart.Name $.Chart.Version | replace "+" "_" | trunc 63 }}
{{ include "ragserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/part-of: ragserve
{{- with $.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ragserve.poolLabels: (list $ pool) -> selector labels of one engine pool */}}
{{- define "ragserve.poolSelectorLabels" -}}
{{ include "ragserve.selectorLabels" (list (index . 0) "engine") }}
ragserve.dev/pool: {{ (index . 1).name }}
{{- end }}

{{/* ragserve.image: (list $ componentImage) -> repository:tag, falling back to .Values.image and appVersion */}}
{{- define "ragserve.image" -}}
{{- $ := index . 0 -}}
{{- $img := index . 1 -}}
{{- $repo := $img.repository | default $.Values.image.repository -}}
{{- $tag := $img.tag | default $.Values.image.tag | default $.Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{- define "ragserve.pullPolicy" -}}
{{- (index . 1).pullPolicy | default (index . 0).Values.image.pullPolicy }}
{{- end }}

{{/* enableServiceLinks: off, or a Service named ragserve-* would inject RAGSERVE_* variables, which set flags. */}}
{{- define "ragserve.podDefaults" -}}
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "ragserve.containerSecurityContext" -}}
securityContext:
  {{- toYaml .Values.containerSecurityContext | nindent 2 }}
{{- end }}

{{/* Writable scratch for a read-only root filesystem: /tmp and /cache. */}}
{{- define "ragserve.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: RAGSERVE_CACHE_DIR
  value: /cache/ragserve
- name: XDG_CACHE_HOME
  value: /cache
{{- end }}

{{- define "ragserve.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{- define "ragserve.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}

{{/* ragserve.arg: (list "--flag" value) -> "\n- --flag\n- value", or nothing when value is null or "". */}}
{{- define "ragserve.arg" -}}
{{- $v := index . 1 -}}
{{- if and (not (kindIs "invalid" $v)) (ne (toString $v) "") }}
- {{ index . 0 }}
- {{ include "ragserve.scalar" $v }}
{{- end }}
{{- end }}

{{/* A scalar as a quoted string; whole floats as integers (YAML numbers arrive as float64). */}}
{{- define "ragserve.scalar" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ . | int64 | quote }}{{ else }}{{ . | toString | quote }}{{ end }}
{{- end }}

{{/* TLS volume from a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt). */}}
{{- define "ragserve.tlsArgs" -}}
{{- if .enabled }}
- --tls-cert
- /etc/ragserve/tls/tls.crt
- --tls-key
- /etc/ragserve/tls/tls.key
{{- if .clientAuth }}
- --tls-client-ca
- /etc/ragserve/tls/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* A number as a Kubernetes quantity string: 4 -> "4", 0.8 -> "800m". */}}
{{- define "ragserve.quantity" -}}
{{- if eq (float64 .) (floor .) }}{{ . | int64 | quote }}{{ else }}{{ printf "%dm" (round (mulf . 1000) 0 | int64) | quote }}{{ end }}
{{- end }}

{{- define "ragserve.routerServiceAccount" -}}
{{- if .Values.router.serviceAccount.create }}
{{- .Values.router.serviceAccount.name | default (include "ragserve.component" (list . "router")) }}
{{- else }}
{{- .Values.router.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}

{{/* ragserve.engineApiKeyEnv: (list $ "ENV_NAME") -> the engines' API key from its Secret (engines check it, the router sends it). */}}
{{- define "ragserve.engineApiKeyEnv" -}}
{{- $k := (index . 0).Values.engineApiKey -}}
{{- if $k.existingSecret -}}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ $k.existingSecret }}
      key: {{ $k.key }}
{{- end }}
{{- end }}

{{/* ragserve.registryTokenSecret: the Secret holding the router registry's shared token (contract 3) */}}
{{- define "ragserve.registryTokenSecret" -}}
{{- .Values.router.registryAuth.existingSecret | default (printf "%s-registry-token" (include "ragserve.fullname" .)) -}}
{{- end }}

{{/* ragserve.registryTokenVolume: the token's volume, mounted at /etc/ragserve/registry-token by router and engines */}}
{{- define "ragserve.registryTokenVolume" -}}
- name: registry-token
  secret:
    secretName: {{ include "ragserve.registryTokenSecret" . }}
    items: [{key: {{ .Values.router.registryAuth.key }}, path: {{ .Values.router.registryAuth.key }}}]
    defaultMode: 0440
{{- end }}

{{/* ragserve.tracingEnv: RAGSERVE_OTLP_TRACES_ENDPOINT for router, engines and cachestore when tracing is on */}}
{{- define "ragserve.tracingEnv" -}}
{{- with .Values.monitoring.tracing.otlpEndpoint }}
- name: RAGSERVE_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/* ragserve.cachestoreClientArgs: how a cachestore client (engines; the router, for store-aware Lookup)
verifies the store and proves itself: the CA, the client certificate under mutual TLS, the shared token. */}}
{{- define "ragserve.cachestoreClientArgs" -}}
{{- $cs := .Values.cachestore -}}
{{- if $cs.tls.enabled }}
{{- include "ragserve.arg" (list "--cachestore-tls-ca" "/etc/ragserve/cachestore-ca/ca.crt") }}
{{- if $cs.tls.clientAuth }}
{{- include "ragserve.arg" (list "--cachestore-tls-cert" "/etc/ragserve/cachestore-client/tls.crt") }}
{{- include "ragserve.arg" (list "--cachestore-tls-key" "/etc/ragserve/cachestore-client/tls.key") }}
{{- end }}
{{- end }}
{{- if $cs.auth.existingSecret }}
{{- include "ragserve.arg" (list "--cachestore-token-file" (printf "/etc/ragserve/cachestore-token/%s" $cs.auth.key)) }}
{{- end }}
{{- end }}

{{/* ragserve.cachestoreClientMounts / ragserve.cachestoreClientVolumes: the files cachestoreClientArgs names */}}
{{- define "ragserve.cachestoreClientMounts" -}}
{{- $cs := .Values.cachestore -}}
{{- if $cs.tls.enabled }}
- name: cachestore-ca
  mountPath: /etc/ragserve/cachestore-ca
  readOnly: true
{{- if $cs.tls.clientAuth }}
- name: cachestore-client
  mountPath: /etc/ragserve/cachestore-client
  readOnly: true
{{- end }}
{{- end }}
{{- if $cs.auth.existingSecret }}
- name: cachestore-token
  mountPath: /etc/ragserve/cachestore-token
  readOnly: true
{{- end }}
{{- end }}

{{- define "ragserve.cachestoreClientVolumes" -}}
{{- $cs := .Values.cachestore -}}
{{- if $cs.tls.enabled }}
- name: cachestore-ca
  secret:
    secretName: {{ $cs.tls.secretName }}
    items: [{key: ca.crt, path: ca.crt}]
{{- if $cs.tls.clientAuth }}
- name: cachestore-client
  secret:
    secretName: {{ $cs.tls.engineClientSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- if $cs.auth.existingSecret }}
- name: cachestore-token
  secret:
    secretName: {{ $cs.auth.existingSecret }}
    items: [{key: {{ $cs.auth.key }}, path: {{ $cs.auth.key }}}]
    defaultMode: 0440
{{- end }}
{{- end }}
