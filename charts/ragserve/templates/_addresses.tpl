{{/* In-cluster addresses the components give each other, and value checks that fail early. */}}

{{- define "ragserve.svcHost" -}}
{{- $ := index . 0 -}}
{{- printf "%s.%s.svc.%s" (index . 1) $.Release.Namespace $.Values.clusterDomain }}
{{- end }}

{{/* The router's gRPC registry, HOST:PORT, for `ragserve engine --router`. */}}
{{- define "ragserve.routerRegistry" -}}
{{- printf "%s:%d" (include "ragserve.svcHost" (list . (include "ragserve.component" (list . "router-registry")))) (int .Values.router.grpcPort) }}
{{- end }}

{{/* Every cachestore pod by its stable DNS name, comma-separated, for `ragserve engine --cachestore`. */}}
{{- define "ragserve.cachestoreAddresses" -}}
{{- $name := include "ragserve.component" (list . "cachestore") -}}
{{- $headless := include "ragserve.svcHost" (list . (printf "%s-headless" $name)) -}}
{{- $out := list -}}
{{- range $i := until (int .Values.cachestore.replicas) -}}
{{- $out = append $out (printf "%s-%d.%s:%d" $name $i $headless (int $.Values.cachestore.port)) -}}
{{- end -}}
{{- join "," $out }}
{{- end }}

{{- define "ragserve.hasRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.external.url .Values.redis.external.existingSecret }}true{{ end }}
{{- end }}

{{/* ragserve.redisArgs: (list $ db) -> `--redis URL` for the in-chart or external URL (a Secret goes through env). */}}
{{- define "ragserve.redisArgs" -}}
{{- $ := index . 0 -}}
{{- if $.Values.redis.enabled -}}
{{- $host := include "ragserve.svcHost" (list $ (include "ragserve.component" (list $ "redis"))) -}}
{{- include "ragserve.arg" (list "--redis" (printf "redis://%s:6379/%d" $host (int (index . 1)))) }}
{{- else if $.Values.redis.external.url -}}
{{- include "ragserve.arg" (list "--redis" $.Values.redis.external.url) }}
{{- end }}
{{- end }}

{{/* ragserve.redisUserEnv: (list $ useRedis) -> scratch dirs, and the Redis URL when it comes from a Secret. */}}
{{- define "ragserve.redisUserEnv" -}}
{{- $ := index . 0 -}}
{{ include "ragserve.scratchEnv" $ }}
{{- with and (index . 1) $.Values.redis.external.existingSecret }}
- name: RAGSERVE_REDIS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.external.key }}
{{- end }}
{{- end }}

{{/* Value combinations the schema cannot express. */}}
{{- define "ragserve.validate" -}}
{{- $redis := .Values.redis -}}
{{- if and $redis.enabled (or $redis.external.url $redis.external.existingSecret) -}}
{{- fail "redis: set either redis.enabled (in-chart Redis) or redis.external, not both" -}}
{{- end -}}
{{- if and $redis.external.url $redis.external.existingSecret -}}
{{- fail "redis.external: set either url or existingSecret, not both" -}}
{{- end -}}
{{- $routerMax := ternary .Values.router.autoscaling.maxReplicas .Values.router.replicas .Values.router.autoscaling.enabled -}}
{{- if and .Values.router.enabled (gt (int $routerMax) 1) (not (include "ragserve.hasRedis" .)) -}}
{{- fail "router: more than one router replica needs shared state: set redis.enabled=true or redis.external.url" -}}
{{- end -}}
{{- $ra := .Values.router.autoscaling -}}
{{- if and .Values.router.enabled $ra.enabled (not (or $ra.targetCPUUtilizationPercentage $ra.targetRequestsPerSecond)) -}}
{{- fail "router.autoscaling needs targetCPUUtilizationPercentage or targetRequestsPerSecond" -}}
{{- end -}}
{{- if and .Values.cachestore.redisTier (not (include "ragserve.hasRedis" .)) -}}
{{- fail "cachestore.redisTier needs a Redis: set redis.enabled=true or redis.external.url" -}}
{{- end -}}
{{- range $t := list "router" "cachestore" -}}
{{- $tls := (index $.Values $t).tls -}}
{{- if and $tls.enabled (not $tls.secretName) -}}
{{- fail (printf "%s.tls.enabled needs %s.tls.secretName (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt)" $t $t) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.router.httpTls.enabled (not .Values.router.httpTls.secretName) -}}
{{- fail "router.httpTls.enabled needs router.httpTls.secretName (a kubernetes.io/tls Secret with tls.crt and tls.key)" -}}
{{- end -}}
{{- if and .Values.cachestore.tls.enabled .Values.cachestore.tls.clientAuth (not .Values.cachestore.tls.engineClientSecret) -}}
{{- fail "cachestore.tls.clientAuth needs cachestore.tls.engineClientSecret (the engines' client certificate, a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if and .Values.router.tls.enabled .Values.router.tls.clientAuth (not .Values.router.tls.engineClientSecret) -}}
{{- fail "router.tls.clientAuth needs router.tls.engineClientSecret (the engines' client certificate, a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- $names := dict -}}
{{- range $p := .Values.engines -}}
{{- if hasKey $names $p.name -}}
{{- fail (printf "engines: pool name %q is used twice" $p.name) -}}
{{- end -}}
{{- $_ := set $names $p.name true -}}
{{- end -}}
{{- include "ragserve.validateVllm" . -}}
{{- include "ragserve.validateInferencePool" . -}}
{{- end }}

{{/* runtime: vllm pools: the runtime is known, each has GPUs and a fixed replica count, the router has their
tokenizer, and they share one block size (the router's one --external-block-size). */}}
{{- define "ragserve.validateVllm" -}}
{{- $sizes := dict -}}
{{- range $p := (include "ragserve.pools" . | fromYaml).pools -}}
{{- if not (has $p.runtime (list "ragserve" "vllm")) -}}
{{- fail (printf "engines[%s].runtime must be ragserve or vllm, got %q" $p.name (toString $p.runtime)) -}}
{{- end -}}
{{- if eq $p.runtime "vllm" -}}
{{- if lt (int $p.gpus) 1 -}}
{{- fail (printf "engines[%s]: runtime vllm needs gpus >= 1 (the vllm/vllm-openai image is CUDA)" $p.name) -}}
{{- end -}}
{{- if ne $p.autoscaling.mode "none" -}}
{{- fail (printf "engines[%s]: runtime vllm pools cannot autoscale (the router names every replica): set autoscaling.mode=none and scale with replicas" $p.name) -}}
{{- end -}}
{{- if eq $p.modelSource.type "image" -}}
{{- fail (printf "engines[%s]: runtime vllm takes modelSource none, pvc or hostPath, not image" $p.name) -}}
{{- end -}}
{{- if and $.Values.router.enabled (not $.Values.router.tokenizer.path) -}}
{{- fail (printf "engines[%s]: runtime vllm needs router.tokenizer.path (the model's tokenizer.json dir or .gguf, for the router's --tokenizer)" $p.name) -}}
{{- end -}}
{{- $_ := set $sizes (toString (int $p.vllm.blockSize)) $p.name -}}
{{- end -}}
{{- end -}}
{{- if gt (len $sizes) 1 -}}
{{- fail (printf "engines: runtime vllm pools need one vllm.blockSize (the router has one --external-block-size), got %s" (keys $sizes | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end }}

{{/* "true" when some pool has runtime ragserve (the engine NetworkPolicy and PodMonitor select those pods). */}}
{{- define "ragserve.hasRagservePool" -}}
{{- range (include "ragserve.pools" . | fromYaml).pools }}{{ if ne .runtime "vllm" }}true{{ end }}{{ end }}
{{- end }}

{{- define "ragserve.vllmName" -}}
{{- include "ragserve.component" (list (index . 0) (printf "vllm-%s" (index . 1).name)) }}
{{- end }}

{{- define "ragserve.vllmSelectorLabels" -}}
{{ include "ragserve.selectorLabels" (list (index . 0) "vllm") }}
ragserve.dev/pool: {{ (index . 1).name }}
{{- end }}

{{/* ragserve.externalEngines: `--external-engine` values, one per replica of every runtime: vllm pool, by the
StatefulSet pods' DNS names (URL,events=tcp://HOST:PORT,replay=tcp://HOST:PORT), as a YAML list under "engines";
"blockSize" is the pools' vllm.blockSize (null when there is none). */}}
{{- define "ragserve.externalEngines" -}}
{{- $out := list -}}
{{- $block := "" -}}
{{- range $p := (include "ragserve.pools" . | fromYaml).pools -}}
{{- if eq $p.runtime "vllm" -}}
{{- $name := include "ragserve.vllmName" (list $ $p) -}}
{{- $svc := include "ragserve.svcHost" (list $ $name) -}}
{{- $block = int $p.vllm.blockSize -}}
{{- range $i := until (int $p.replicas) -}}
{{- $host := printf "%s-%d.%s" $name $i $svc -}}
{{- $out = append $out (printf "http://%s:%d,events=tcp://%s:%d,replay=tcp://%s:%d" $host (int $p.vllm.port) $host (int $p.vllm.eventsPort) $host (int $p.vllm.replayPort)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "engines" $out "blockSize" $block) }}
{{- end }}

{{/* ragserve.pools: the engine pools with engineDefaults merged in, as a YAML list. */}}
{{- define "ragserve.pools" -}}
{{- $pools := list -}}
{{- range $p := .Values.engines -}}
{{- $pools = append $pools (include "ragserve.merge" (list $.Values.engineDefaults $p) | fromYaml) -}}
{{- end -}}
{{- toYaml (dict "pools" $pools) }}
{{- end }}

{{/* ragserve.merge: (list base override) -> YAML of base with override applied; maps merge, everything else
replaces (unlike mergeOverwrite, false / 0 / "" in the override win). */}}
{{- define "ragserve.merge" -}}
{{- $base := deepCopy (index . 0) -}}
{{- range $k, $v := index . 1 -}}
{{- if and (kindIs "map" $v) (kindIs "map" (index $base $k)) -}}
{{- $_ := set $base $k (include "ragserve.merge" (list (index $base $k) $v) | fromYaml) -}}
{{- else -}}
{{- $_ := set $base $k $v -}}
{{- end -}}
{{- end -}}
{{- toYaml $base }}
{{- end }}
