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

{{/* repository:tag, or repository:tag@digest when image.digest is set. */}}
{{- define "fairlimit.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- if .Values.image.digest }}{{ printf "%s@%s" $ref .Values.image.digest }}{{ else }}{{ $ref }}{{ end }}
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

{{/* The gateway's namespace: istio.gatewayNamespace, else the one of istio.gatewayInstall. */}}
{{- define "fairlimit.gatewayNamespace" -}}
{{- if .Values.istio.gatewayNamespace }}{{ .Values.istio.gatewayNamespace }}
{{- else if eq .Values.istio.gatewayInstall "helm" }}istio-ingress
{{- else }}istio-system
{{- end }}
{{- end }}

{{/* The gateway pods' labels, as YAML: istio.gatewaySelector, else those of gatewayInstall. */}}
{{- define "fairlimit.gatewaySelector" -}}
{{- if .Values.istio.gatewaySelector -}}
{{- toYaml .Values.istio.gatewaySelector -}}
{{- else if eq .Values.istio.gatewayInstall "helm" -}}
istio: ingress
{{- else -}}
istio: ingressgateway
{{- end -}}
{{- end }}

{{/* True (non-empty) when liveness asks gRPC health: not under TLS (the kubelet's gRPC probe
speaks plaintext only). */}}
{{- define "fairlimit.grpcLiveness" -}}
{{- if and (eq .Values.probes.liveness.type "grpc") (not .Values.tls.enabled) }}true{{ end }}
{{- end }}

{{/* True (non-empty) when the Service carries the admin port. */}}
{{- define "fairlimit.exposeAdmin" -}}
{{- if or .Values.service.exposeAdmin .Values.serviceMonitor.enabled }}true{{ end }}
{{- end }}

{{/*
Rules across several values, refused at render time with the reason (the schema checks each
value alone; its messages cannot say why).
*/}}
{{- define "fairlimit.validate" -}}
{{- $memory := and (not .Values.backend.existingSecret) (hasPrefix "memory://" .Values.backend.url) }}
{{- if $memory }}
{{- $why := "the memory:// backend keeps its counters inside one process, so each extra process would enforce its own separate limits (N processes admit N times the limit). Use a redis:// backend (backend.url or backend.existingSecret) for more" }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- fail (printf "replicaCount is %d with backend.url memory://: %s replicas." (int .Values.replicaCount) $why) }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- fail (printf "autoscaling.enabled with backend.url memory://: %s replicas." $why) }}
{{- end }}
{{- if gt (int .Values.server.workers) 1 }}
{{- fail (printf "server.workers is %d with backend.url memory://: %s workers." (int .Values.server.workers) $why) }}
{{- end }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: the kubernetes.io/tls Secret holding tls.crt and tls.key." }}
{{- end }}
{{- if and .Values.istio.enabled (not .Values.config.existingConfigMap) }}
{{- $domains := list }}
{{- range $file, $content := .Values.config.descriptors }}
{{- if $content }}{{ $domains = append $domains (toString $content.domain) }}{{ end }}
{{- end }}
{{- if not (has .Values.istio.domain $domains) }}
{{- fail (printf "istio.domain is %q, but no file of config.descriptors has that domain (theirs: %s): the gateway would ask about a domain fairlimit does not know, and every request would pass unlimited. Set istio.domain to the domain of your descriptors." .Values.istio.domain (join ", " (sortAlpha $domains) | default "none")) }}
{{- end }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.grpcFrom) (not .Values.istio.enabled) }}
{{- fail "networkPolicy.enabled with an empty networkPolicy.grpcFrom and istio.enabled false: no client could reach the gRPC port, and Envoy (failing open) would let every request through unlimited. List the pods that call fairlimit in networkPolicy.grpcFrom." }}
{{- end }}
{{- end }}
