{{/* ragserve.routerArgs: the `ragserve router` command line, in ragserve.router_command's order
(tests/charts/test_router_command.py requires the same arguments). */}}
{{- define "ragserve.routerArgs" -}}
{{- $r := .Values.router -}}
- router
- --host
- 0.0.0.0
{{- include "ragserve.arg" (list "--port" $r.port) }}
{{- include "ragserve.arg" (list "--grpc-port" $r.grpcPort) }}
{{- include "ragserve.arg" (list "--policy" $r.policy) }}
{{- include "ragserve.arg" (list "--log-level" .Values.logLevel) }}
{{- include "ragserve.redisArgs" (list . 0) }}
{{- include "ragserve.arg" (list "--static-engines" (join "," $r.staticEngines)) }}
{{- $ext := include "ragserve.externalEngines" . | fromYaml }}
{{- range $ext.engines }}
{{- include "ragserve.arg" (list "--external-engine" .) }}
{{- end }}
{{- if $ext.engines }}
{{- include "ragserve.arg" (list "--tokenizer" $r.tokenizer.path) }}
{{- include "ragserve.arg" (list "--external-block-size" $ext.blockSize) }}
{{- end }}
{{- if $r.kubernetesDiscovery.enabled }}
{{- include "ragserve.arg" (list "--k8s-selector" (printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=engine" .Release.Name)) }}
{{- include "ragserve.arg" (list "--k8s-namespace" .Release.Namespace) }}
{{- end }}
{{- with $r.engineTls }}
{{- if .caSecret }}
{{- include "ragserve.arg" (list "--engine-ca-file" "/etc/ragserve/engine-ca/ca.crt") }}
{{- end }}
{{- if .clientSecret }}
{{- include "ragserve.arg" (list "--engine-client-cert-file" "/etc/ragserve/engine-client/tls.crt") }}
{{- include "ragserve.arg" (list "--engine-client-key-file" "/etc/ragserve/engine-client/tls.key") }}
{{- end }}
{{- end }}
{{- include "ragserve.arg" (list "--max-body-bytes" $r.maxBodyBytes) }}
{{- include "ragserve.arg" (list "--drain-delay" $r.drainDelaySeconds) }}
{{- include "ragserve.arg" (list "--drain-timeout" (max 0 (sub (sub (int $r.terminationGracePeriodSeconds) (int $r.drainDelaySeconds)) 5))) }}
{{- include "ragserve.tlsArgs" $r.tls }}
{{- if $r.httpTls.enabled }}
{{- include "ragserve.arg" (list "--tls-cert-file" "/etc/ragserve/http-tls/tls.crt") }}
{{- include "ragserve.arg" (list "--tls-key-file" "/etc/ragserve/http-tls/tls.key") }}
{{- end }}
{{- if $r.registryAuth.enabled }}
{{- include "ragserve.arg" (list "--registry-token-file" (printf "/etc/ragserve/registry-token/%s" $r.registryAuth.key)) }}
{{- else if $r.registryAuth.allowUnauthenticated }}
- --registry-allow-unauthenticated
{{- end }}
{{- if .Values.cachestore.enabled }}
{{- include "ragserve.cachestoreClientArgs" . }}
{{- end }}
{{- if $r.apiKeys.existingSecret }}
{{- include "ragserve.arg" (list "--api-keys-file" (printf "/etc/ragserve/api-keys/%s" $r.apiKeys.key)) }}
{{- end }}
{{- if $r.tenantQuotasFile.existingSecret }}
{{- include "ragserve.arg" (list "--tenant-quotas-file" (printf "/etc/ragserve/tenant-quotas/%s" $r.tenantQuotasFile.key)) }}
{{- end }}
{{- if $r.adminApiKey.existingSecret }}
{{- include "ragserve.arg" (list "--admin-api-key-file" (printf "/etc/ragserve/admin-key/%s" $r.adminApiKey.key)) }}
{{- end }}
{{- include "ragserve.eppArgs" . }}
{{- /* router_args.SETTING_GROUPS, in its order (ragserve.router_command: RouterLaunch.settings) */}}
{{- with $r.flowControl }}
{{- include "ragserve.arg" (list "--max-inflight-per-engine" .maxInflightPerEngine) }}
{{- include "ragserve.arg" (list "--queue-size" .queueSize) }}
{{- include "ragserve.arg" (list "--queue-timeout" .queueTimeout) }}
{{- include "ragserve.arg" (list "--saturation-queue-depth" .saturationQueueDepth) }}
{{- include "ragserve.arg" (list "--saturation-kv-usage" .saturationKvUsage) }}
{{- include "ragserve.arg" (list "--critical-reserve-per-engine" .criticalReservePerEngine) }}
{{- if .enginePriority }}
- --engine-priority
{{- end }}
{{- end }}
{{- with $r.tenantQuotas }}
{{- include "ragserve.arg" (list "--tenant-header" .header) }}
{{- include "ragserve.arg" (list "--tenant-tokens-per-minute" .tokensPerMinute) }}
{{- include "ragserve.arg" (list "--tenant-max-concurrent" .maxConcurrent) }}
{{- if .fairShare }}
- --tenant-fair-share
{{- end }}
{{- end }}
{{- with $r.breaker }}
{{- include "ragserve.arg" (list "--breaker-failures" .failures) }}
{{- include "ragserve.arg" (list "--breaker-cooldown" .cooldown) }}
{{- include "ragserve.arg" (list "--breaker-probes" .probes) }}
{{- end }}
{{- with $r.retry }}
{{- include "ragserve.arg" (list "--max-attempts" .maxAttempts) }}
{{- include "ragserve.arg" (list "--retry-backoff" .backoff) }}
{{- include "ragserve.arg" (list "--retry-backoff-max" .backoffMax) }}
{{- include "ragserve.arg" (list "--retry-jitter" .jitter) }}
{{- end }}
{{- with $r.health }}
{{- include "ragserve.arg" (list "--probe-interval" .probeInterval) }}
{{- include "ragserve.arg" (list "--health-failure-threshold" .failureThreshold) }}
{{- include "ragserve.arg" (list "--health-success-threshold" .successThreshold) }}
{{- end }}
{{- range $r.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
