{{/* ragserve.engineArgs: (list $ pool) -> the `ragserve engine` command line: ragserve.engine_command.engine_command()
renders the same (tests/charts/test_engine_command.py); the engine flags are ragserve/engine_args.py fields. */}}
{{- define "ragserve.engineArgs" -}}
{{- $ := index . 0 -}}
{{- $p := index . 1 -}}
{{- $e := $p.engine -}}
- engine
- --host
- 0.0.0.0
{{- include "ragserve.arg" (list "--port" $p.port) }}
{{- include "ragserve.arg" (list "--model" (include "ragserve.modelPath" $p)) }}
{{- include "ragserve.arg" (list "--served-model-name" $p.servedModelName) }}
{{- if and $p.task (ne $p.task "generate") }}
{{- include "ragserve.arg" (list "--task" $p.task) }}
{{- end }}
{{- if and $p.role (ne $p.role "both") }}
{{- include "ragserve.arg" (list "--role" $p.role) }}
{{- end }}
{{- range $p.prefiller.allow }}
{{- include "ragserve.arg" (list "--prefiller-allow" .) }}
{{- end }}
{{- include "ragserve.arg" (list "--prefiller-timeout" $p.prefiller.timeout) }}
{{- include "ragserve.arg" (list "--dtype" $e.dtype) }}
{{- include "ragserve.arg" (list "--device" $e.device) }}
{{- include "ragserve.arg" (list "--block-size" $e.blockSize) }}
{{- include "ragserve.arg" (list "--num-gpu-blocks" $e.numGpuBlocks) }}
{{- include "ragserve.arg" (list "--kv-cache-memory" $e.kvCacheMemory) }}
{{- include "ragserve.arg" (list "--gpu-memory-utilization" $e.gpuMemoryUtilization) }}
{{- include "ragserve.arg" (list "--kv-cache-dtype" $e.kvCacheDtype) }}
{{- include "ragserve.arg" (list "--attention-backend" $e.attentionBackend) }}
- {{ ternary "--enable-prefix-caching" "--no-enable-prefix-caching" $e.enablePrefixCaching }}
{{- include "ragserve.arg" (list "--max-model-len" $e.maxModelLen) }}
{{- include "ragserve.arg" (list "--max-num-seqs" $e.maxNumSeqs) }}
{{- include "ragserve.arg" (list "--max-num-batched-tokens" $e.maxNumBatchedTokens) }}
{{- include "ragserve.arg" (list "--long-prefill-token-threshold" $e.longPrefillTokenThreshold) }}
{{- include "ragserve.arg" (list "--max-long-partial-prefills" $e.maxLongPartialPrefills) }}
{{- include "ragserve.arg" (list "--preemption-mode" $e.preemptionMode) }}
{{- include "ragserve.arg" (list "--swap-space" $e.swapSpace) }}
{{- include "ragserve.arg" (list "--scheduling-policy" $e.schedulingPolicy) }}
{{- if $p.httpTls.enabled }}
{{- include "ragserve.arg" (list "--tls-cert-file" "/etc/ragserve/http-tls/tls.crt") }}
{{- include "ragserve.arg" (list "--tls-key-file" "/etc/ragserve/http-tls/tls.key") }}
{{- if $p.httpTls.clientAuth }}
{{- include "ragserve.arg" (list "--tls-client-ca-file" "/etc/ragserve/http-tls/ca.crt") }}
{{- end }}
{{- end }}
{{- if and $.Values.router.enabled $p.registerWithRouter }}
{{- include "ragserve.arg" (list "--router" (include "ragserve.routerRegistry" $)) }}
- --advertise-url
- {{ printf "%s://$(POD_IP):%d" (ternary "https" "http" $p.httpTls.enabled) (int $p.port) | quote }}
{{- if $.Values.router.registryAuth.enabled }}
{{- include "ragserve.arg" (list "--registry-token-file" (printf "/etc/ragserve/registry-token/%s" $.Values.router.registryAuth.key)) }}
{{- end }}
{{- if $.Values.router.tls.enabled }}
{{- include "ragserve.arg" (list "--router-tls-ca" "/etc/ragserve/router-ca/ca.crt") }}
{{- if $.Values.router.tls.clientAuth }}
{{- include "ragserve.arg" (list "--router-tls-cert" "/etc/ragserve/router-client/tls.crt") }}
{{- include "ragserve.arg" (list "--router-tls-key" "/etc/ragserve/router-client/tls.key") }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $.Values.cachestore.enabled $p.useCachestore (ne $p.task "embed") }}
{{- include "ragserve.arg" (list "--cachestore" (include "ragserve.cachestoreAddresses" $)) }}
{{- include "ragserve.cachestoreClientArgs" $ }}
{{- end }}
{{- include "ragserve.arg" (list "--max-body-bytes" $p.maxBodyBytes) }}
{{- include "ragserve.arg" (list "--log-level" $.Values.logLevel) }}
{{- include "ragserve.arg" (list "--drain-timeout" (max 0 (sub (sub (int $p.terminationGracePeriodSeconds) (int $p.preStopSleepSeconds)) 5))) }}
{{- range $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* A relative model path with a mounted model source lives under mountPath; anything else is passed as is. */}}
{{- define "ragserve.modelPath" -}}
{{- if and (ne .modelSource.type "none") (not (hasPrefix "/" .model)) }}
{{- printf "%s/%s" (trimSuffix "/" .modelSource.mountPath) .model }}
{{- else }}
{{- .model }}
{{- end }}
{{- end }}

{{/* Pool checks the schema cannot express (they need engineDefaults merged in). */}}
{{- define "ragserve.validatePool" -}}
{{- $src := .modelSource -}}
{{- if and (eq $src.type "pvc") (not $src.pvc.claimName) -}}
{{- fail (printf "engines[%s].modelSource.type=pvc needs modelSource.pvc.claimName" .name) -}}
{{- end -}}
{{- if and (eq $src.type "hostPath") (not $src.hostPath.path) -}}
{{- fail (printf "engines[%s].modelSource.type=hostPath needs modelSource.hostPath.path" .name) -}}
{{- end -}}
{{- if and (eq $src.type "image") (not $src.image.repository) -}}
{{- fail (printf "engines[%s].modelSource.type=image needs modelSource.image.repository" .name) -}}
{{- end -}}
{{- $a := .autoscaling -}}
{{- $role := default "both" .role -}}
{{- if and (ne $role "decode") (or .prefiller.allow (not (kindIs "invalid" .prefiller.timeout))) -}}
{{- fail (printf "engines[%s].prefiller is for role: decode pools (the prefill leg a decode engine runs on the prefill engine the endpoint picker names); this pool's role is %s" .name $role) -}}
{{- end -}}
{{- $kv := and (ne $role "prefill") $a.targetKVCacheUsage -}}
{{- $queued := and (ne $role "decode") $a.targetQueuedPrefillTokens -}}
{{- if and (ne $a.mode "none") (not (or $a.targetWaitingRequests $kv $queued $a.targetGPUUtilization)) -}}
{{- fail (printf "engines[%s].autoscaling needs a target for a %s pool: targetWaitingRequests, targetGPUUtilization, %s" .name $role (ternary "targetQueuedPrefillTokens" (ternary "targetKVCacheUsage" "targetKVCacheUsage or targetQueuedPrefillTokens" (eq $role "decode")) (eq $role "prefill"))) -}}
{{- end -}}
{{- if and (ne $a.mode "none") (gt (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- fail (printf "engines[%s].autoscaling: minReplicas (%d) > maxReplicas (%d)" .name (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- end }}

{{/* engines[].httpTls checks (list $ pool): a Secret, and a router client certificate for engines requiring one. */}}
{{- define "ragserve.validateHttpTls" -}}
{{- $ := index . 0 -}}
{{- $p := index . 1 -}}
{{- $t := $p.httpTls -}}
{{- if $t.enabled -}}
{{- if eq $p.runtime "vllm" -}}
{{- fail (printf "engines[%s].httpTls is for runtime ragserve pools (a vllm pool: pass vLLM's --ssl-* flags in vllm.extraArgs)" $p.name) -}}
{{- end -}}
{{- if not $t.secretName -}}
{{- fail (printf "engines[%s].httpTls.enabled needs httpTls.secretName (a kubernetes.io/tls Secret with tls.crt and tls.key)" $p.name) -}}
{{- end -}}
{{- if and $t.clientAuth $.Values.router.enabled (not $.Values.router.engineTls.clientSecret) -}}
{{- fail (printf "engines[%s].httpTls.clientAuth needs router.engineTls.clientSecret (the client certificate the router presents to engines, a kubernetes.io/tls Secret)" $p.name) -}}
{{- end -}}
{{- if include "ragserve.inferencePoolOn" $ -}}
{{- fail (printf "engines[%s].httpTls: gateway.inferencePool sends the gateway's traffic to engine pods over plain HTTP; turn one of them off" $p.name) -}}
{{- end -}}
{{- else if $t.clientAuth -}}
{{- fail (printf "engines[%s].httpTls.clientAuth needs httpTls.enabled (client certificates are checked in the TLS handshake)" $p.name) -}}
{{- end -}}
{{- end }}

{{/* An engine probe's handler (list pool path): HTTP(S) GET of path, or the port under httpTls.clientAuth. */}}
{{- define "ragserve.engineProbe" -}}
{{- $p := index . 0 -}}
{{- if and $p.httpTls.enabled $p.httpTls.clientAuth -}}
tcpSocket: {port: http}
{{- else -}}
httpGet: {path: {{ index . 1 }}, port: http{{ if $p.httpTls.enabled }}, scheme: HTTPS{{ end }}}
{{- end -}}
{{- end }}
