{{/* Gateway API Inference Extension (gateway.inferencePool): the router as the InferencePool's Endpoint Picker. */}}

{{- define "ragserve.inferencePoolOn" -}}
{{- if and .Values.router.enabled .Values.gateway.inferencePool.enabled }}true{{ end }}
{{- end }}

{{/* The router's --epp-* flags (ragserve.router_command's order): TLS from a Secret, h2c, or a certificate the
router makes at start (no flag). */}}
{{- define "ragserve.eppArgs" -}}
{{- if include "ragserve.inferencePoolOn" . }}
{{- $ip := .Values.gateway.inferencePool }}
{{- include "ragserve.arg" (list "--epp-port" $ip.eppPort) }}
{{- if eq $ip.tls.mode "plaintext" }}
- --epp-plaintext
{{- else if eq $ip.tls.mode "secret" }}
- --epp-cert-file
- /etc/ragserve/epp-tls/tls.crt
- --epp-key-file
- /etc/ragserve/epp-tls/tls.key
{{- end }}
{{- end }}
{{- end }}

{{- define "ragserve.eppSecretOn" -}}
{{- if and (include "ragserve.inferencePoolOn" .) (eq .Values.gateway.inferencePool.tls.mode "secret") }}true{{ end }}
{{- end }}

{{/* The pool's members are exactly this release's ragserve engine pods, on their one HTTP port: the EPP may only
pick pool members, so vllm pools (component vllm, another port) and static engines are refused. */}}
{{- define "ragserve.validateInferencePool" -}}
{{- if include "ragserve.inferencePoolOn" . -}}
{{- $ip := .Values.gateway.inferencePool -}}
{{- $ports := dict -}}
{{- range $p := (include "ragserve.pools" . | fromYaml).pools -}}
{{- if eq $p.runtime "vllm" -}}
{{- fail (printf "gateway.inferencePool: engines[%s] has runtime vllm; the InferencePool's members are the ragserve engine pods (the EPP may only pick members): serve vllm pools through the router's own API" $p.name) -}}
{{- end -}}
{{- $_ := set $ports (toString (int $p.port)) $p.name -}}
{{- end -}}
{{- if not $ports -}}
{{- fail "gateway.inferencePool needs a runtime ragserve engine pool (the InferencePool's members)" -}}
{{- end -}}
{{- if gt (len $ports) 1 -}}
{{- fail (printf "gateway.inferencePool: the ragserve pools need one port (the InferencePool's targetPorts), got %s" (keys $ports | sortAlpha | join ", ")) -}}
{{- end -}}
{{- if .Values.router.staticEngines -}}
{{- fail "gateway.inferencePool: router.staticEngines are not InferencePool members (the EPP may only pick members)" -}}
{{- end -}}
{{- if and (eq $ip.tls.mode "secret") (not $ip.tls.secretName) -}}
{{- fail "gateway.inferencePool.tls.mode secret needs tls.secretName (a kubernetes.io/tls Secret with tls.crt and tls.key)" -}}
{{- end -}}
{{- if and $ip.httpRoute.enabled (not $ip.httpRoute.parentRefs) -}}
{{- fail "gateway.inferencePool.httpRoute needs parentRefs (the Gateway to attach to)" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The engine HTTP port every pool shares (validated above). */}}
{{- define "ragserve.inferencePoolPort" -}}
{{- (first (include "ragserve.pools" . | fromYaml).pools).port | int }}
{{- end }}
