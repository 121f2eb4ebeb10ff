{{/*
The one workload template: a role's Deployment (StatefulSet for store nodes), called per role
with dict "root" $ "role" ROLE. Everything role-specific comes from the role table
("epd.roles") and the role's values section.
*/}}
{{- define "epd.workload" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $spec := include "epd.roleSpec" . | fromYaml -}}
{{- $v := include "epd.roleValues" . | fromYaml -}}
{{- $ctx := dict "root" $root "role" $role "spec" $spec "values" $v -}}
{{- $name := include "epd.componentName" . -}}
apiVersion: apps/v1
kind: {{ $spec.kind }}
metadata:
  name: {{ $name }}
  labels:
    {{- include "epd.labels" . | nindent 4 }}
spec:
  {{- /* An HPA or the planner owns the count of an autoscaled role: rendering it here would
  reset it on every helm upgrade. */}}
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "epd.selectorLabels" . | nindent 6 }}
  {{- if eq $spec.kind "StatefulSet" }}
  serviceName: {{ $name }}
  {{- /* Nodes are independent peers: start and replace them all at once. */}}
  podManagementPolicy: Parallel
  {{- else if eq $role "planner" }}
  {{- /* Never two planners at once, not even during a rollout. */}}
  strategy:
    type: Recreate
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "epd.selectorLabels" . | nindent 8 }}
        epd.io/role: {{ $role }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $annotations := deepCopy (default dict $v.podAnnotations) }}
      {{- if eq $role "planner" }}
      {{- $_ := set $annotations "checksum/planner-config" (include "epd.plannerConfig" $root | sha256sum) }}
      {{- end }}
      {{- if and (eq $spec.values "router") (include "epd.authSecretData" $root | trim) }}
      {{- /* The keys reach the process by env: a changed Secret needs new pods. */}}
      {{- $_ := set $annotations "checksum/auth" (include "epd.authSecretData" $root | sha256sum) }}
      {{- end }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- if eq $spec.values "router" }}
      serviceAccountName: {{ include "epd.serviceAccountName" (dict "root" $root "role" $role) }}
      {{- else }}
      {{- /* Only the router and the planner talk to the Kubernetes API. */}}
      automountServiceAccountToken: false
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if and $spec.engine $root.Values.model.initContainer.enabled }}
      initContainers:
        {{- include "epd.modelInitContainer" $root | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "epd.image" (dict "root" $root "image" $v.image) }}
          imagePullPolicy: {{ default $root.Values.image.pullPolicy $v.image.pullPolicy }}
          {{- /* The image's entrypoint is `python -m`: the module picks the service. */}}
          args:
            - {{ $spec.module }}
            {{- range $v.args }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "epd.env" $ctx | trim | nindent 12 }}
          ports:
            {{- if eq $spec.probe "http" }}
            - name: http
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- else }}
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
            {{- end }}
            {{- if $spec.transfer }}
            - name: transfer
              containerPort: {{ $v.transferPort }}
              protocol: TCP
            {{- end }}
          {{- with include "epd.probes" $ctx | trim }}
          {{- . | nindent 10 }}
          {{- end }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          {{- with include "epd.volumeMounts" $ctx | trim }}
          volumeMounts:
            {{- . | nindent 12 }}
          {{- end }}
      {{- with include "epd.volumes" $ctx | trim }}
      volumes:
        {{- . | nindent 8 }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- /* A constraint without a labelSelector spreads the role's own pods. */}}
        {{- range . }}
        {{- $tsc := deepCopy . }}
        {{- if not (hasKey $tsc "labelSelector") }}
        {{- $_ := set $tsc "labelSelector" (dict "matchLabels" (include "epd.selectorLabels" (dict "root" $root "role" $role) | fromYaml)) }}
        {{- end }}
        - {{ toYaml $tsc | indent 10 | trim }}
        {{- end }}
      {{- end }}
  {{- if and (eq $spec.kind "StatefulSet") $root.Values.kv.disk.enabled }}
  volumeClaimTemplates:
    - metadata:
        name: data
        labels:
          {{- include "epd.selectorLabels" . | nindent 10 }}
          epd.io/role: {{ $role }}
      spec:
        accessModes:
          {{- toYaml $root.Values.kv.disk.accessModes | nindent 10 }}
        {{- with $root.Values.kv.disk.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $root.Values.kv.disk.size }}
  {{- end }}
{{- end -}}

{{/*
The container's environment: EPD_<ROLE>_<FIELD> variables only. What the chart decides
(bind address, ports, store node addresses, discovery...) and the role's `config:` map are
one dict of fields, the user's entries winning; pod facts (name, IP, namespace) come from the
downward API and are listed first, so later values can refer to them as $(NAME).
*/}}
{{- define "epd.env" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $spec := .spec -}}
{{- $v := .values -}}
{{- $prefix := printf "EPD_%s_" $spec.env -}}
{{- $fromPod := dict -}}
{{- $managed := dict "host" "0.0.0.0" "port" $v.port -}}
{{- if eq $spec.probe "grpc" -}}
{{- $_ := set $managed "metrics_port" $v.metricsPort -}}
{{- end -}}
{{- if $spec.instanceId -}}
{{- $_ := set $fromPod "instance_id" "metadata.name" -}}
{{- end -}}
{{- if $spec.transfer -}}
{{- $_ := set $managed "transfer_port" $v.transferPort -}}
{{- /* The encoder lends rows over shm / TCP only (auto picks): not over NIXL. */ -}}
{{- $transport := $root.Values.kv.transport -}}
{{- if and (eq $role "encoder") (eq $transport "nixl") -}}{{- $transport = "auto" -}}{{- end -}}
{{- $_ := set $managed "kv_transport" $transport -}}
{{- if eq $role "kvstore" -}}
{{- /* Store nodes are reached by their stable DNS names, which survive a restart (the pod IP
does not); the headless Service publishes them before the node is ready. */ -}}
{{- $_ := set $fromPod "node_id" "metadata.name" -}}
{{- $svc := include "epd.componentName" (dict "root" $root "role" "kvstore") -}}
{{- $_ := set $managed "advertise_host" (printf "$(EPD_KVSTORE_NODE_ID).%s.%s.svc.%s" $svc $root.Release.Namespace $root.Values.clusterDomain) -}}
{{- if $root.Values.kv.disk.enabled -}}
{{- $_ := set $managed "disk_dir" $root.Values.kv.disk.mountPath -}}
{{- end -}}
{{- else -}}
{{- $_ := set $fromPod "advertise_host" "status.podIP" -}}
{{- end -}}
{{- end -}}
{{- if and $spec.kvClient $root.Values.kvstore.enabled (gt (int $root.Values.kvstore.replicas) 0) -}}
{{- $_ := set $managed "kvstore" (include "epd.kvstoreAddresses" $root) -}}
{{- $_ := set $managed "kvstore_replicas" $root.Values.kv.blockReplicas -}}
{{- end -}}
{{- if $spec.engine -}}
{{- with include "epd.modelPath" $root -}}
{{- $_ := set $managed "model" . -}}
{{- end -}}
{{- end -}}
{{- if eq $spec.values "router" -}}
{{- $_ := set $fromPod "k8s_namespace" "metadata.namespace" -}}
{{- $_ := set $managed "discovery" "kubernetes" -}}
{{- $_ := set $managed "k8s_label_selector" (printf "app.kubernetes.io/instance=%s" $root.Release.Name) -}}
{{- if eq $role "planner" -}}
{{- $_ := set $managed "planner" $root.Values.planner.mode -}}
{{- $_ := set $managed "planner_config" "/etc/epd/planner/planner.json" -}}
{{- else -}}
{{- $_ := set $managed "planner" "off" -}}
{{- end -}}
{{- if $root.Values.auth.allowUnauthenticated -}}
{{- $_ := set $managed "allow_unauthenticated" true -}}
{{- end -}}
{{- end -}}
{{- $config := merge (deepCopy $v.config) $managed -}}
{{- range $field := keys $fromPod | sortAlpha }}
{{- if not (hasKey $v.config $field) }}
- name: {{ printf "%s%s" $prefix (upper $field) }}
  valueFrom:
    fieldRef:
      fieldPath: {{ index $fromPod $field }}
{{- end }}
{{- end }}
{{- range $field := keys $config | sortAlpha }}
- name: {{ printf "%s%s" $prefix (upper $field) }}
  value: {{ include "epd.envValue" (index $config $field) | quote }}
{{- end }}
{{- if and (or (eq $spec.values "router") (eq $role "kvstore")) (include "epd.hasRedis" $root) (not (hasKey $v.config "redis_url")) }}
{{ include "epd.redisEnv" (dict "root" $root "name" (printf "%sREDIS_URL" $prefix)) }}
{{- end }}
{{- if eq $spec.values "router" }}
{{- include "epd.authEnv" . }}
{{- end }}
{{- if $spec.engine }}
{{- /* Not a service setting: the engines' cache of converted models and compiled kernels. */}}
- name: EPD_CACHE_DIR
  value: /var/cache/epd
{{- end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* EPD_ROUTER_API_KEYS and EPD_ROUTER_ADMIN_TOKEN from a Secret, when configured. */}}
{{- define "epd.authEnv" -}}
{{- $a := .root.Values.auth -}}
{{- $own := printf "%s-auth" (include "epd.fullname" .root) -}}
{{- if and (or $a.apiKeys.values $a.apiKeys.existingSecret) (not (hasKey .values.config "api_keys")) }}
- name: EPD_ROUTER_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ default $own $a.apiKeys.existingSecret }}
      key: {{ $a.apiKeys.secretKey }}
{{- end }}
{{- if and (or $a.adminToken.value $a.adminToken.existingSecret) (not (hasKey .values.config "admin_token")) }}
- name: EPD_ROUTER_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ default $own $a.adminToken.existingSecret }}
      key: {{ $a.adminToken.secretKey }}
{{- end }}
{{- end -}}

{{/* EPD_<ROLE>_MODEL, or "" for the model baked into the image. */}}
{{- define "epd.modelPath" -}}
{{- $m := .Values.model -}}
{{- if and (or $m.pvc.claimName $m.initContainer.enabled) (not (isAbs $m.path)) -}}
{{- $m.mountPath }}{{ with $m.path }}/{{ . }}{{ end -}}
{{- else -}}
{{- $m.path -}}
{{- end -}}
{{- end -}}

{{- define "epd.modelInitContainer" -}}
{{- $m := .Values.model -}}
- name: model-download
  image: {{ include "epd.image" (dict "root" . "image" $m.initContainer.image) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- with $m.initContainer.command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $m.initContainer.args }}
  args:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: EPD_MODEL_DIR
      value: {{ $m.mountPath }}
    {{- with $m.initContainer.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml $m.initContainer.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end -}}

{{/*
Probes. gRPC roles: Kubernetes' native gRPC probe against the standard grpc.health.v1 service,
for the role's own service name (SERVING once the model is loaded, NOT_SERVING while draining).
Router and planner: GET /health (200 while a prefill and a decode instance take requests) for
startup and readiness; liveness only checks that the port answers, so that an outage of the
engines does not restart every router as well.
*/}}
{{- define "epd.probes" -}}
{{- $v := .values -}}
{{- $spec := .spec -}}
{{- range $kind := list "startup" "liveness" "readiness" }}
{{- $p := index $v.probes $kind }}
{{- if $p.enabled }}
{{ $kind }}Probe:
  {{- if eq $spec.probe "grpc" }}
  grpc:
    port: {{ $v.port }}
    service: {{ $spec.grpcService }}
  {{- else if eq $kind "liveness" }}
  tcpSocket:
    port: http
  {{- else }}
  httpGet:
    path: /health
    port: http
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "epd.volumeMounts" -}}
{{- $root := .root -}}
{{- $m := $root.Values.model -}}
{{- if .values.shm.enabled }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- if .spec.engine }}
- name: cache
  mountPath: /var/cache/epd
{{- if or $m.pvc.claimName $m.initContainer.enabled }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and $m.pvc.claimName $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}
{{- if and (eq .role "kvstore") $root.Values.kv.disk.enabled }}
- name: data
  mountPath: {{ $root.Values.kv.disk.mountPath }}
{{- end }}
{{- if eq .role "planner" }}
- name: planner-config
  mountPath: /etc/epd/planner
  readOnly: true
{{- end }}
{{- with .values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "epd.volumes" -}}
{{- $root := .root -}}
{{- $m := $root.Values.model -}}
{{- if .values.shm.enabled }}
{{- /* Memory-backed: the KV pools live in /dev/shm, and count against the memory limit. */}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .values.shm.sizeLimit }}
{{- end }}
{{- if .spec.engine }}
- name: cache
  emptyDir:
    sizeLimit: {{ $root.Values.cache.sizeLimit }}
{{- if $m.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if $m.initContainer.enabled }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.initContainer.sizeLimit }}
{{- end }}
{{- end }}
{{- if eq .role "planner" }}
- name: planner-config
  configMap:
    name: {{ include "epd.fullname" $root }}-planner
{{- end }}
{{- with .values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
