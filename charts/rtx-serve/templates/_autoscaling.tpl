{{/* The latency histogram autoscaling reads: all lanes, or one lane's. */}}
{{- define "rtx-serve.ttftSeries" -}}
{{- if .Values.autoscaling.latencyLane }}rtx_lane_time_to_first_token_seconds_bucket{{ else }}rtx_time_to_first_token_seconds_bucket{{ end }}
{{- end }}

{{- define "rtx-serve.laneMatcher" -}}
{{- with .Values.autoscaling.latencyLane }}lane="{{ . }}"{{ end }}
{{- end }}

{{/* Stabilization windows: scale out after a short time above target, in only after a long time below it. */}}
{{- define "rtx-serve.scalingBehavior" -}}
scaleUp:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleUpStabilizationSeconds }}
  policies:
    - type: Pods
      value: 2
      periodSeconds: 60
  selectPolicy: Max
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDownStabilizationSeconds }}
  policies:
    - type: Pods
      value: 1
      periodSeconds: 120
  selectPolicy: Min
{{- end }}
