{{/* Names, labels and the image reference shared by the templates. */}}

{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: "<release>-kvfleet", or the release name when it already says kvfleet. */}}
{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: the operator runs as that ServiceAccount" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvfleet.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* host:port of the endpoints in a URL (an IPv6 address gets brackets). */}}
{{- define "kvfleet.urlHost" -}}
{{- if contains ":" .Values.listenAddress }}[{{ .Values.listenAddress }}]{{ else }}{{ .Values.listenAddress }}{{ end }}
{{- end }}

{{/* The names the operator's code fixes: the headroom PriorityClass (operator/kvfleet/operator/
     resources.py HEADROOM_PRIORITY_CLASS) and the Lease (leader.py LeaderElector's name). */}}
{{- define "kvfleet.headroomPriorityClass" -}}kvfleet-headroom{{- end }}
{{- define "kvfleet.leaseName" -}}kvfleet-operator{{- end }}
