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
