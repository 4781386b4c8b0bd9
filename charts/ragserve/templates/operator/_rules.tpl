{{/* What the operator reconciles: RAGServe resources and the stack's children. */}}
{{- define "ragserve.operatorRules" -}}
- apiGroups: [ragserve.dev]
  resources: [ragserves, ragserves/status]
  verbs: [get, list, watch, patch, update]
- apiGroups: [ragserve.dev]
  resources: [ragserveenginepools, ragserveenginepools/status, ragserveenginepools/scale]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, update, patch, delete]
{{- end }}

{{- define "ragserve.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- .Values.operator.serviceAccount.name | default (include "ragserve.component" (list . "operator")) }}
{{- else }}
{{- .Values.operator.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}
