{{/* ragserve.cachestoreArgs: the `ragserve cachestore` command line. */}}
{{- define "ragserve.cachestoreArgs" -}}
{{- $c := .Values.cachestore -}}
- cachestore
- --host
- 0.0.0.0
{{- include "ragserve.arg" (list "--port" $c.port) }}
{{- include "ragserve.arg" (list "--metrics-port" $c.metricsPort) }}
{{- include "ragserve.arg" (list "--memory" $c.memory) }}
{{- include "ragserve.arg" (list "--log-level" (upper .Values.logLevel)) }}
{{- if $c.disk.enabled }}
{{- include "ragserve.arg" (list "--disk-dir" "/var/lib/ragserve/cachestore") }}
{{- include "ragserve.arg" (list "--disk" $c.disk.budget) }}
{{- end }}
{{- if $c.redisTier }}
{{- include "ragserve.redisArgs" (list . 1) }}
{{- include "ragserve.arg" (list "--redis-capacity" $c.redisCapacity) }}
- --redis-prefix
- "ragserve-kv:$(POD_NAME):"
{{- end }}
{{- include "ragserve.tlsArgs" $c.tls }}
{{- if $c.auth.existingSecret }}
{{- include "ragserve.arg" (list "--auth-token-file" (printf "/etc/ragserve/auth/%s" $c.auth.key)) }}
{{- end }}
{{- include "ragserve.arg" (list "--max-message-bytes" $c.maxMessageBytes) }}
{{- range $c.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
