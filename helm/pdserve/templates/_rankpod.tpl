{{/* The pod of one rank of a prefill or decode instance. */}}
{{- define "pdserve.rankPod" -}}
{{- $root := .root }}
{{- $spec := .spec }}
{{- $multi := gt (int .world) 1 }}
metadata:
  labels:
    {{- include "pdserve.selector" $root | nindent 4 }}
    {{- toYaml .labels | nindent 4 }}
spec:
  {{- include "pdserve.initContainers" $root | nindent 2 }}
  containers:
    - name: {{ .role }}
      image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag }}"
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["python", "-m", "{{ .role }}_service"]
      args:
        {{- include "pdserve.engineArgs" $root | nindent 8 }}
        - --port
        - {{ $spec.port | quote }}
        - --kv-cache-tokens
        - {{ $spec.kvCacheTokens | quote }}
        - --tp
        - {{ $spec.tp | quote }}
        - --ep
        - {{ $spec.ep | quote }}
        {{- if $spec.layerSharding }}
        - --layer-sharding
        - {{ $spec.layerSharding }}
        {{- end }}
        {{- if eq .role "prefill" }}
        - --cp
        - {{ $spec.cp | quote }}
        - --max-prefill-tokens
        - {{ $spec.maxPrefillTokens | quote }}
        - --kv-stall-seconds
        - {{ $spec.kvStallSeconds | quote }}
        {{- if $spec.noPrefixCache }}
        - --no-prefix-cache
        {{- end }}
        {{- if $spec.noKvFetch }}
        - --no-kv-fetch
        {{- end }}
        {{- else }}
        - --dp
        - {{ $spec.dp | quote }}
        - --kv-port
        - {{ $spec.kvPort | quote }}
        - --lease-seconds
        - {{ $spec.leaseSeconds | quote }}
        - --max-num-seqs
        - {{ $spec.maxNumSeqs | quote }}
        - --kv-stall-seconds
        - {{ $spec.kvStallSeconds | quote }}
        - --reserve-wait-seconds
        - {{ $spec.reserveWaitSeconds | quote }}
        {{- if $spec.noPrefixCache }}
        - --no-prefix-cache
        {{- end }}
        {{- if $spec.enforceEager }}
        - --enforce-eager
        {{- end }}
        {{- if $root.Values.engine.speculative }}
        - --speculative-max-draft-tokens
        - {{ $spec.speculativeMaxDraftTokens | quote }}
        {{- end }}
        {{- end }}
      env:
        {{- include "pdserve.env" $root | nindent 8 }}
        {{- if $multi }}
        - name: RANK
          valueFrom:
            fieldRef:
              {{- if $root.Values.lws.enabled }}
              fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
              {{- else }}
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
              {{- end }}
        - name: WORLD_SIZE
          value: {{ .world | quote }}
        - name: MASTER_ADDR
          value: {{ if $root.Values.lws.enabled }}"$(LWS_LEADER_ADDRESS)"{{ else }}{{ .master | quote }}{{ end }}
        - name: MASTER_PORT
          value: {{ $root.Values.masterPort | quote }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $spec.port }}
        - name: metrics
          containerPort: {{ $root.Values.metrics.port }}
        {{- if $multi }}
        - name: master
          containerPort: {{ $root.Values.masterPort }}
        {{- end }}
        {{- if eq .role "decode" }}
        - name: kv
          containerPort: {{ $spec.kvPort }}
        {{- end }}
      {{- include "pdserve.probes" (dict "root" $root "port" $spec.port) | nindent 6 }}
      volumeMounts:
        {{- include "pdserve.mounts" $root | nindent 8 }}
        {{- if $root.Values.engine.shareWeights }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
      {{- $rdma := eq (include "pdserve.rdma" $root) "true" }}
      {{- $resources := deepCopy ($spec.resources | default dict) }}
      {{- if and $rdma $root.Values.engine.mooncake.rdmaResource }}
      {{- $limits := merge (dict $root.Values.engine.mooncake.rdmaResource 1) ($resources.limits | default dict) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $rdma }}
      securityContext:  # RDMA memory registration pins the KV pool: CAP_IPC_LOCK, effective only for root
        runAsUser: 0
        capabilities:
          add: ["IPC_LOCK"]
      {{- end }}
  {{- if and $rdma $root.Values.engine.mooncake.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  terminationGracePeriodSeconds: {{ add (int $root.Values.engine.drainSeconds) 15 }}
  volumes:
    {{- include "pdserve.volumes" $root | nindent 4 }}
    {{- if $root.Values.engine.shareWeights }}
    - name: shm  # engine.shareWeights: tmpfs shared by the pod's processes (counts toward its memory)
      emptyDir:
        medium: Memory
    {{- end }}
  {{- include "pdserve.scheduling" $spec | nindent 2 }}
{{- end -}}
