{{- define "rtx-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rtx-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "rtx-serve.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "rtx-serve.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "rtx-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rtx-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rtx-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rtx-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "rtx-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rtx-serve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rtx-serve.apiKeysSecret" -}}
{{- if .Values.apiKeys.externalSecret.enabled }}
{{- printf "%s-api-keys" (include "rtx-serve.fullname" .) }}
{{- else }}
{{- .Values.apiKeys.existingSecret }}
{{- end }}
{{- end }}

{{/*
What autoscaling and the PodDisruptionBudget act on: the Rollout in canary mode, the active colour's Deployment in
blue/green mode, else the Deployment.
*/}}
{{- define "rtx-serve.scaleTargetRef" -}}
{{- if eq .Values.strategy "canary" }}
apiVersion: argoproj.io/v1alpha1
kind: Rollout
name: {{ include "rtx-serve.fullname" . }}
{{- else if eq .Values.strategy "blueGreen" }}
apiVersion: apps/v1
kind: Deployment
name: {{ include "rtx-serve.fullname" . }}-{{ .Values.blueGreen.activeColor }}
{{- else }}
apiVersion: apps/v1
kind: Deployment
name: {{ include "rtx-serve.fullname" . }}
{{- end }}
{{- end }}

{{/*
terminationGracePeriodSeconds: the preStop sleep, then `--shutdown-grace` for streams to finish, plus a margin for
stopping the servers, so the kubelet's SIGKILL never cuts a drain short.
*/}}
{{- define "rtx-serve.terminationGrace" -}}
{{- add .Values.server.preStopSleepSeconds .Values.server.shutdownGraceSeconds 15 }}
{{- end }}

{{/*
The pod template. Called with a dict: root (the chart context), color (blue/green or ""), tag (image tag override).
*/}}
{{- define "rtx-serve.podTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $tag := default (default $root.Chart.AppVersion $v.image.tag) .tag }}
metadata:
  labels:
    {{- include "rtx-serve.selectorLabels" $root | nindent 4 }}
    {{- with .color }}
    color: {{ . }}
    {{- end }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # A changed serving config rolls the pods (the file is read once at start-up).
    checksum/serve-config: {{ $v.serveConfig | sha256sum }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "rtx-serve.serviceAccountName" $root }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ include "rtx-serve.terminationGrace" $root }}
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  affinity:
    {{- with $v.affinity.nodeAffinity }}
    nodeAffinity:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    podAntiAffinity:
      {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (fromYaml (include "rtx-serve.selectorLabels" $root))) }}
      {{- if eq $v.podAntiAffinity "hard" }}
      requiredDuringSchedulingIgnoredDuringExecution:
        - {{- toYaml $term | nindent 10 }}
      {{- else }}
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            {{- toYaml $term | nindent 12 }}
      {{- end }}
  containers:
    - name: rtx-serve
      image: "{{ $v.image.repository }}:{{ $tag }}"
      imagePullPolicy: {{ $v.image.pullPolicy }}
      args:
        - serve
        - --host=0.0.0.0
        - --port={{ $v.server.httpPort }}
        {{- if $v.server.grpc }}
        - --grpc-port={{ $v.server.grpcPort }}
        {{- else }}
        - --no-grpc
        {{- end }}
        - --model={{ $v.model.name }}
        {{- with $v.model.servedName }}
        - --served-model-name={{ . }}
        {{- end }}
        - --backend={{ $v.server.backend }}
        - --scheduler={{ $v.server.scheduler }}
        - --config=/etc/rtx-serve/config/serve.toml
        - --shutdown-grace={{ $v.server.shutdownGraceSeconds }}
        - --request-timeout={{ $v.server.requestTimeoutSeconds }}
        - --max-active-requests={{ $v.server.maxActiveRequests }}
        - --log-level={{ $v.server.logLevel }}
        {{- with $v.server.forwardedAllowIps }}
        - --forwarded-allow-ips={{ join "," . }}
        {{- end }}
        - --eviction-policy={{ $v.kvCache.evictionPolicy }}
        - --kv-host-bytes={{ $v.kvCache.hostBytes }}
        {{- if $v.state.enabled }}
        - --state-dir={{ $v.state.mountPath }}
        - --kv-disk-bytes={{ $v.kvCache.diskBytes }}
        - --kv-snapshot-interval={{ $v.kvCache.snapshotIntervalSeconds }}
        {{- end }}
        {{- if $v.signing.publicKeySecret }}
        - --signing-public-key=/etc/rtx-serve/signing/{{ $v.signing.publicKeySecretKey }}
        {{- end }}
        {{- if $v.signing.requireSignedModels }}
        - --require-signed-models
        {{- end }}
        {{- if $v.tls.secretName }}
        - --ssl-certfile=/etc/rtx-serve/tls/tls.crt
        - --ssl-keyfile=/etc/rtx-serve/tls/tls.key
        {{- if eq $v.tls.clientCertificates "required" }}
        - --ssl-ca-certs=/etc/rtx-serve/tls/ca.crt
        - --ssl-cert-reqs=required
        {{- end }}
        {{- end }}
        {{- if $v.autoscaling.enabled }}
        {{- /* The dashboard's replicas panel: the peers the autoscaler counts, read as it reads them. */}}
        - --fleet-peers={{ include "rtx-serve.fullname" $root | trunc 57 | trimSuffix "-" }}-peers
        - --autoscale-mode={{ $v.autoscaling.mode }}
        - --autoscale-queue-depth={{ $v.autoscaling.targetQueueDepth }}
        - --autoscale-ttft-p95={{ $v.autoscaling.targetTTFTP95Seconds }}
        - --autoscale-replicas={{ $v.autoscaling.minReplicas }}:{{ $v.autoscaling.maxReplicas }}
        {{- with $v.autoscaling.latencyLane }}
        - --autoscale-lane={{ . }}
        {{- end }}
        {{- end }}
        {{- range $v.server.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ $v.server.httpPort }}
          protocol: TCP
        {{- if $v.server.grpc }}
        - name: grpc
          containerPort: {{ $v.server.grpcPort }}
          protocol: TCP
        {{- end }}
      {{- if or (include "rtx-serve.apiKeysSecret" $root) $v.server.extraEnv }}
      env:
        {{- if include "rtx-serve.apiKeysSecret" $root }}
        - name: RTX_API_KEYS
          valueFrom:
            secretKeyRef:
              name: {{ include "rtx-serve.apiKeysSecret" $root }}
              key: {{ $v.apiKeys.secretKey }}
        {{- end }}
        {{- with $v.server.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- if and $v.tls.secretName (eq $v.tls.clientCertificates "required") }}
      # Mutual TLS: the kubelet has no client certificate, so the probes can only see the port accept connections.
      readinessProbe:
        tcpSocket:
          port: http
        periodSeconds: {{ $v.probes.readiness.periodSeconds }}
        failureThreshold: {{ $v.probes.readiness.failureThreshold }}
      livenessProbe:
        tcpSocket:
          port: http
        initialDelaySeconds: {{ $v.probes.liveness.initialDelaySeconds }}
        periodSeconds: {{ $v.probes.liveness.periodSeconds }}
        failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      {{- else }}
      # /ready answers 503 until the model is loaded and again while draining, so traffic stops before shutdown.
      readinessProbe:
        httpGet:
          path: /ready
          port: http
          {{- if $v.tls.secretName }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: {{ $v.probes.readiness.periodSeconds }}
        failureThreshold: {{ $v.probes.readiness.failureThreshold }}
      # /health answers as soon as the process listens, even while a large model loads.
      livenessProbe:
        httpGet:
          path: /health
          port: http
          {{- if $v.tls.secretName }}
          scheme: HTTPS
          {{- end }}
        initialDelaySeconds: {{ $v.probes.liveness.initialDelaySeconds }}
        periodSeconds: {{ $v.probes.liveness.periodSeconds }}
        failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      {{- end }}
      lifecycle:
        preStop:
          sleep:
            seconds: {{ $v.server.preStopSleepSeconds }}
      resources:
        {{- toYaml $v.resources | nindent 8 }}
      {{- with $v.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: serve-config
          mountPath: /etc/rtx-serve/config
          readOnly: true
        {{- if $v.signing.publicKeySecret }}
        - name: signing-key
          mountPath: /etc/rtx-serve/signing
          readOnly: true
        {{- end }}
        {{- if $v.model.volume }}
        - name: models
          mountPath: {{ $v.model.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $v.state.enabled }}
        - name: state
          mountPath: {{ $v.state.mountPath }}
        {{- end }}
        {{- if $v.tls.secretName }}
        - name: tls
          mountPath: /etc/rtx-serve/tls
          readOnly: true
        {{- end }}
        {{- if $v.authFiles.configMap }}
        - name: auth-files
          mountPath: /etc/rtx-serve/auth
          readOnly: true
        {{- end }}
  volumes:
    - name: serve-config
      configMap:
        name: {{ include "rtx-serve.fullname" $root }}-config
    {{- if $v.signing.publicKeySecret }}
    - name: signing-key
      secret:
        secretName: {{ $v.signing.publicKeySecret }}
        items:
          - key: {{ $v.signing.publicKeySecretKey }}
            path: {{ $v.signing.publicKeySecretKey }}
    {{- end }}
    {{- if $v.model.volume }}
    - name: models
      {{- toYaml $v.model.volume | nindent 6 }}
    {{- end }}
    {{- if $v.state.enabled }}
    - name: state
      {{- toYaml $v.state.volume | nindent 6 }}
    {{- end }}
    {{- if $v.tls.secretName }}
    - name: tls
      secret:
        secretName: {{ $v.tls.secretName }}
    {{- end }}
    {{- if $v.authFiles.configMap }}
    - name: auth-files
      configMap:
        name: {{ $v.authFiles.configMap }}
    {{- end }}
{{- end }}
