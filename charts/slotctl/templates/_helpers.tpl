{{- define "slotctl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slotctl.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "slotctl.labels" -}}
{{ include "slotctl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: slotctl
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* What the operator does with Model and Slot objects (and their Events): exactly the
     requests it sends (tests/k8s/test_operator.py records them). */}}
{{- define "slotctl.resourceRules" -}}
- apiGroups: ["slotctl.io"]
  resources: ["models", "slots", "aliases", "adapters"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["slotctl.io"]
  resources: ["models/status", "slots/status", "aliases/status", "adapters/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* The models dir in the operator's pod: `models.dir`; with the docker runtime a
     hostPath cache's own path, since the servers' containers mount the host's path. */}}
{{- define "slotctl.modelsDir" -}}
{{- if and (eq .Values.runtime "docker") (not .Values.models.cache.persistentVolumeClaim) -}}
{{- .Values.models.cache.hostPath -}}
{{- else -}}
{{- .Values.models.dir -}}
{{- end -}}
{{- end -}}
