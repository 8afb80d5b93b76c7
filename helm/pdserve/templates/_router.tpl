{{/* The router process's arguments, shared by the routers (router.yaml) and the endpoint picker, which is a
     router in that role (gateway.yaml): the same model, pools, policy and SLA targets. */}}
{{- define "pdserve.routerArgs" -}}
{{- $fullname := include "pdserve.fullname" . -}}
- --model
- {{ .Values.model.path | quote }}
- --host
- $(POD_IP)
- --port
- {{ .Values.router.port | quote }}
- --metrics-port
- {{ .Values.metrics.port | quote }}
{{- if .Values.autoscaling.enabled }}
- --prefill
- dns:{{ $fullname }}-prefill-leaders:{{ .Values.prefill.port }}
- --decode
- dns:{{ $fullname }}-decode-leaders:{{ .Values.decode.port }}
{{- else }}
- --prefill
- {{ range $i, $_ := until (int .Values.prefill.instances) }}{{ if $i }},{{ end }}{{ $fullname }}-prefill-{{ $i }}:{{ $.Values.prefill.port }}{{ end }}
- --decode
- {{ range $i, $_ := until (int .Values.decode.instances) }}{{ if $i }},{{ end }}{{ $fullname }}-decode-{{ $i }}:{{ $.Values.decode.port }}{{ end }}
{{- end }}
- --request-timeout
- {{ .Values.router.requestTimeout | quote }}
- --instance-wait
- {{ include "pdserve.nonNegative" (list "router.instanceWait" .Values.router.instanceWait) | quote }}
- --max-prompt-bytes
- {{ .Values.router.maxPromptBytes | quote }}
- --max-concurrent-requests
- {{ .Values.router.maxConcurrentRequests | quote }}
- --drain-seconds
- {{ .Values.router.drainSeconds | quote }}
- --policy
- {{ .Values.router.policy | quote }}
- --ttft-slo-ms
- {{ .Values.router.ttftSloMs | quote }}
- --tpot-slo-ms
- {{ .Values.router.tpotSloMs | quote }}
- --admission-wait-ms
- {{ .Values.router.admissionWaitMs | quote }}
- --local-prefill-tokens
- {{ include "pdserve.nonNegative" (list "router.localPrefillTokens" .Values.router.localPrefillTokens) | quote }}
- --overflow-prefill-tokens
- {{ include "pdserve.nonNegative" (list "router.overflowPrefillTokens" .Values.router.overflowPrefillTokens) | quote }}
- --migration-limit
- {{ include "pdserve.nonNegative" (list "router.migrationLimit" .Values.router.migrationLimit) | quote }}
- --chat-max-tokens
- {{ include "pdserve.positive" (list "router.chatMaxTokens" .Values.router.chatMaxTokens) | quote }}
- --http-max-body-bytes
- {{ include "pdserve.positive" (list "router.httpMaxBodyBytes" .Values.router.httpMaxBodyBytes) | quote }}
- --http-max-prompts
- {{ include "pdserve.positive" (list "router.httpMaxPrompts" .Values.router.httpMaxPrompts) | quote }}
- --decode-dp
- {{ include "pdserve.positive" (list "decode.dp" .Values.decode.dp) | quote }}
{{- if .Values.router.noKvFetch }}
- --no-kv-fetch
{{- end }}
{{- if .Values.router.noTokenBus }}
- --no-token-bus
{{- end }}
{{- if not (kindIs "invalid" .Values.router.servedModelName) }}
- --served-model-name
- {{ .Values.router.servedModelName | quote }}
{{- end }}
{{- include "pdserve.tlsArgs" . | nindent 0 }}
{{- end }}
