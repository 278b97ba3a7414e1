{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "fairlimit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release fullname: the release name when it already contains the chart name. */}}
{{- define "fairlimit.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fairlimit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fairlimit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fairlimit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fairlimit.labels" -}}
helm.sh/chart: {{ include "fairlimit.chart" . }}
{{ include "fairlimit.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "fairlimit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fairlimit.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fairlimit.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* ConfigMap holding the descriptor files: the user's own, or the chart's. */}}
{{- define "fairlimit.configMapName" -}}
{{- default (include "fairlimit.fullname" .) .Values.config.existingConfigMap }}
{{- end }}

{{/* True (non-empty) when the backend URL goes through the chart's own Secret. */}}
{{- define "fairlimit.createSecret" -}}
{{- if and (not .Values.backend.existingSecret) (not (hasPrefix "memory://" .Values.backend.url)) }}true{{ end }}
{{- end }}

{{/* The Service's cluster-local DNS name. */}}
{{- define "fairlimit.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "fairlimit.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* The name Istio gives the Envoy cluster of this Service's gRPC port. */}}
{{- define "fairlimit.istioClusterName" -}}
{{- printf "outbound|%d||%s" (int .Values.service.grpcPort) (include "fairlimit.serviceFQDN" .) }}
{{- end }}

{{/* Where the descriptor files are mounted; the image's FAIRLIMIT_CONFIG points here too. */}}
{{- define "fairlimit.configDir" -}}
/etc/fairlimit/descriptors
{{- end }}
