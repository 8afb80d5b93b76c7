{{/* Names and labels */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdserve.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* PromQL label matchers of this release's routers: autoscaling.routerSelector, else their namespace and
     pod names (the labels the PodMonitor's targets carry). The KEDA query and the routers' fleet load
     (--autoscale-routers) select the same routers. */}}
{{- define "pdserve.routerSelector" -}}
{{- .Values.autoscaling.routerSelector | default (printf "namespace=%q,pod=~%q" .Release.Namespace (printf "%s-router-.+" (include "pdserve.fullname" .))) -}}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-token" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Flags every service takes for credentials (token from the environment, TLS from the secret). */}}
{{- define "pdserve.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert
- /etc/pdserve/tls/tls.crt
- --tls-key
- /etc/pdserve/tls/tls.key
- --tls-ca
- /etc/pdserve/tls/ca.crt
{{- end }}
{{- end -}}

{{/* Flags of the engine services (prefill and decode). */}}
{{- define "pdserve.engineArgs" -}}
- --model
- {{ .Values.model.path | quote }}
- --host
- $(POD_IP)
- --advertise-host
- $(POD_IP)
- --metrics-port
- {{ .Values.metrics.port | quote }}
- --kv-transport
- {{ include "pdserve.choice" (list "engine.kvTransport" .Values.engine.kvTransport (list "tcp" "mooncake")) | quote }}
{{- if eq .Values.engine.kvTransport "mooncake" }}
- --mooncake-protocol
- {{ include "pdserve.choice" (list "engine.mooncake.protocol" .Values.engine.mooncake.protocol (list "tcp" "rdma")) | quote }}
- --mooncake-devices
- {{ .Values.engine.mooncake.devices | quote }}
{{- else if eq (toString .Values.engine.mooncake.protocol) "rdma" }}
{{- fail "engine.mooncake.protocol: rdma needs engine.kvTransport: mooncake" }}
{{- end }}
- --dtype
- {{ .Values.engine.dtype }}
- --indexer-numerics
- {{ .Values.engine.indexerNumerics }}
- --quantization
- {{ include "pdserve.choice" (list "engine.quantization" .Values.engine.quantization (list "auto" "none" "w8a8" "fp8")) | quote }}
- --kv-cache-dtype
- {{ include "pdserve.choice" (list "engine.kvCacheDtype" .Values.engine.kvCacheDtype (list "auto" "int8")) | quote }}
- --block-size
- {{ .Values.engine.blockSize | quote }}
- --drain-seconds
- {{ .Values.engine.drainSeconds | quote }}
{{- with .Values.engine.offloadLayers | toString | trim }}
{{- if not (regexMatch "^(?i:all)$|^[0-9]+(-[0-9]+)?( *, *[0-9]+(-[0-9]+)?)*$" .) }}
{{- fail (printf "engine.offloadLayers: %q is not a layer list (use e.g. '3,5,7', '2-10', 'all')" .) }}
{{- end }}
- --offload-layers
- {{ . | quote }}
- --offload-buffers
- {{ include "pdserve.positive" (list "engine.offloadBuffers" $.Values.engine.offloadBuffers) | quote }}
{{- end }}
{{- with include "pdserve.shareWeightsDir" . }}
- --share-weights-dir
- {{ . | quote }}
{{- end }}
{{- with .Values.engine.speculative }}
- --speculative
- {{ include "pdserve.choice" (list "engine.speculative" . (list "mtp")) | quote }}
- --num-speculative-tokens
- {{ include "pdserve.speculativeTokens" $.Values.engine.numSpeculativeTokens | quote }}
{{- end }}
{{- if and .Values.engine.kvStoreMaster (not .Values.engine.kvTierTokens) }}
{{- fail "engine.kvStoreMaster: the store holds the second tier: set engine.kvTierTokens too" }}
{{- end }}
{{- with .Values.engine.kvTierTokens }}
- --kv-tier-tokens
- {{ include "pdserve.positive" (list "engine.kvTierTokens" .) | quote }}
{{- with $.Values.engine.kvTierDir }}
- --kv-tier-dir
- {{ . | quote }}
{{- end }}
{{- with $.Values.engine.kvStoreMaster }}
- --kv-store-master
- {{ . | quote }}
{{- end }}
{{- end }}
{{- include "pdserve.tlsArgs" . }}
{{- end -}}

{{/* engine.numSpeculativeTokens: 1..3 drafts per step, else a failed render naming the key. */}}
{{- define "pdserve.speculativeTokens" -}}
{{- if or (lt (int .) 1) (gt (int .) 3) (ne (int . | toString) (toString .)) }}
{{- fail (printf "engine.numSpeculativeTokens: expected 1..3, got %v" .) }}
{{- end }}
{{- . | int }}
{{- end -}}

{{/* A value from a fixed set, else a failed render naming the key: (list "key" value (list choices...)). */}}
{{- define "pdserve.choice" -}}
{{- $key := index . 0 }}{{- $value := index . 1 | toString }}{{- $choices := index . 2 }}
{{- if not (has $value $choices) }}
{{- fail (printf "%s: expected one of %s, got %q" $key (join ", " $choices) $value) }}
{{- end }}
{{- $value }}
{{- end -}}

{{- define "pdserve.positive" -}}
{{- $key := index . 0 }}{{- $value := index . 1 }}
{{- if or (lt (int $value) 1) (ne (int $value | float64) (float64 $value)) }}
{{- fail (printf "%s: expected a positive integer, got %v" $key $value) }}
{{- end }}
{{- $value | int }}
{{- end -}}

{{/* --share-weights-dir of the engine services ("": none). engine.shareWeights maps the weights from
     /dev/shm/pdserve, on the memory emptyDir the rank pods then mount at /dev/shm. */}}
{{- define "pdserve.shareWeightsDir" -}}
{{- .Values.engine.shareWeightsDir | default (ternary "/dev/shm/pdserve" "" (.Values.engine.shareWeights | default false)) -}}
{{- end -}}

{{- define "pdserve.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PDSERVE_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" . }}
      key: token
{{- end -}}

{{- define "pdserve.volumes" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir: {}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required with tls.enabled" .Values.tls.secretName }}
{{- end }}
{{- end -}}

{{- define "pdserve.mounts" -}}
- name: model
  mountPath: {{ if eq .Values.model.source "uri" }}{{ dir .Values.model.path }}{{ else }}{{ .Values.model.path }}{{ end }}
  readOnly: {{ ne .Values.model.source "uri" }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.initContainers" -}}
{{- if eq .Values.model.source "uri" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.uri.image }}
    command: {{ toJson .Values.model.uri.command }}
    env:
      - name: MODEL_URI
        value: {{ required "model.uri.url is required with model.source=uri" .Values.model.uri.url | quote }}
    volumeMounts:
      - name: model
        mountPath: {{ dir .Values.model.path }}
{{- end }}
{{- end -}}

{{/* gRPC health probes: the kubelet's native gRPC probe, or (mutual TLS, which it cannot speak)
     the package's own probe command. Startup allows a long model load. Readiness is the server's health
     (a router that reaches no instance, or drains, takes no traffic); liveness asks pdserve.liveness, SERVING
     while the process can serve: a router waiting for its pools is not restarted in a loop. */}}
{{- define "pdserve.probes" -}}
{{- $port := .port -}}
{{- $root := .root -}}
{{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{- $service := ternary "pdserve.liveness" "" (eq $kind "livenessProbe") }}
{{ $kind }}:
{{- if $root.Values.tls.enabled }}
  exec:
    command: ["sh", "-c", "exec python -m shared.rpc.probe \"$POD_IP:{{ $port }}\" --tls-cert /etc/pdserve/tls/tls.crt --tls-key /etc/pdserve/tls/tls.key --tls-ca /etc/pdserve/tls/ca.crt{{ if $service }} --service {{ $service }}{{ end }}"]
{{- else }}
  grpc:
    port: {{ $port }}
    {{- if $service }}
    service: {{ $service }}
    {{- end }}
{{- end }}
{{- if eq $kind "startupProbe" }}
  periodSeconds: 10
  failureThreshold: 180
{{- else }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}


{{/* engine.mooncake.protocol rdma: the pod requests the RDMA device and may lock (register) memory. */}}
{{- define "pdserve.rdma" -}}
{{- and (eq .Values.engine.kvTransport "mooncake") (eq (toString .Values.engine.mooncake.protocol) "rdma") -}}
{{- end -}}

{{/* A whole number >= 0, else a failed render naming the key: (list "key" value). */}}
{{- define "pdserve.nonNegative" -}}
{{- $key := index . 0 }}{{- $value := index . 1 }}
{{- if or (lt (int $value) 0) (ne (int $value | float64) (float64 $value)) }}
{{- fail (printf "%s: expected a whole number >= 0, got %v" $key $value) }}
{{- end }}
{{- $value | int }}
{{- end -}}
