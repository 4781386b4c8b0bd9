{{/* ragserve.operatorArgs: the `ragserve operator` command line. */}}
{{- define "ragserve.operatorArgs" -}}
{{- $o := .Values.operator -}}
- operator
{{- if $o.watchNamespace }}
{{- include "ragserve.arg" (list "--namespace" $o.watchNamespace) }}
{{- else }}
- --all-namespaces
{{- end }}
{{- include "ragserve.arg" (list "--liveness" (printf "http://0.0.0.0:%d/healthz" (int $o.healthPort))) }}
{{- range $o.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
