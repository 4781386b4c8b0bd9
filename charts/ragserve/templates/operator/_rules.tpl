{{/* What the operator reconciles: RAGServe resources and the stack's children. Only what it calls: it
writes with server-side apply and patches (no update), lists engine pods (no get or watch), posts core
Events (kopf), and reads HPAs / ScaledObjects / InferencePools / HTTPRoutes without watching them (tests/operator/test_rbac_coverage.py). */}}
{{- define "ragserve.operatorRules" -}}
- apiGroups: [ragserve.dev]
  resources: [ragserves, ragserves/status]
  verbs: [get, list, watch, patch]
- apiGroups: [ragserve.dev]
  resources: [ragserveenginepools, ragserveenginepools/status, ragserveenginepools/scale]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, create, patch, delete]
{{- end }}

{{- define "ragserve.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- .Values.operator.serviceAccount.name | default (include "ragserve.component" (list . "operator")) }}
{{- else }}
{{- .Values.operator.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}
