{{/*
Names, labels and the role table. Every workload is rendered by "epd.workload"
(_workload.tpl) from a role name; what differs between roles is in "epd.roles" below and in
the role's values section, never in a copy of the YAML.
*/}}

{{- define "epd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* 40 characters at most: see fullnameOverride in values.yaml. */}}
{{- define "epd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of a role's objects: dict "root" $ "role" "prefill". */}}
{{- define "epd.componentName" -}}
{{- printf "%s-%s" (include "epd.fullname" .root) .role -}}
{{- end -}}

{{- define "epd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of a role: dict "root" $ "role" "prefill". Never change these: a
Deployment's selector is immutable. */}}
{{- define "epd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* Every object's labels. epd.io/role is on pods and Services alike: the router's discovery
selects EndpointSlices by app.kubernetes.io/instance and reads the role from this label, which
EndpointSlices copy from their Service. */}}
{{- define "epd.labels" -}}
{{ include "epd.selectorLabels" . }}
epd.io/role: {{ .role }}
app.kubernetes.io/part-of: epd
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "epd.chart" .root }}
{{- end -}}

{{/* The roles of the values file, in the order they are rendered. */}}
{{- define "epd.roleNames" -}}
[router, encoder, prefill, decode, kvstore]
{{- end -}}

{{/*
What differs between roles beyond their values:
  module       what `python -m` runs
  kind         Deployment, or StatefulSet for store nodes (stable names and disks)
  env          the service's variable prefix, EPD_<env>_
  probe        grpc (the standard grpc.health.v1 service, checked for `grpcService`, the names
               services/launcher.py's _SERVICES checks) or http (GET /health)
  engine       loads the model (EPD_<ROLE>_MODEL, the model volume, the cache dir)
  instanceId   has an instance_id field (the pod's name goes there)
  transfer     runs a KV data server: transfer_port, advertise_host, kv_transport
  kvClient     reads and writes the store nodes (--kvstore addresses)
  values       the values section its pod settings come from
*/}}
{{- define "epd.roles" -}}
router:  {module: services.router,  kind: Deployment,  env: ROUTER,  probe: http, values: router}
planner: {module: services.router,  kind: Deployment,  env: ROUTER,  probe: http, values: router}
encoder: {module: services.encoder, kind: Deployment,  env: ENCODER, probe: grpc, grpcService: epd.v1.Encoder, engine: true, transfer: true, values: encoder}
prefill: {module: services.prefill, kind: Deployment,  env: PREFILL, probe: grpc, grpcService: epd.v1.Prefill, engine: true, instanceId: true, transfer: true, kvClient: true, values: prefill}
decode:  {module: services.decode,  kind: Deployment,  env: DECODE,  probe: grpc, grpcService: epd.v1.Decode,  engine: true, instanceId: true, transfer: true, kvClient: true, values: decode}
kvstore: {module: services.kvstore, kind: StatefulSet, env: KVSTORE, probe: grpc, grpcService: epd.v1.KVStore, transfer: true, values: kvstore}
{{- end -}}

{{- define "epd.roleSpec" -}}
{{- index (include "epd.roles" .root | fromYaml) .role | toYaml -}}
{{- end -}}

{{/* A role's values: its section, or for the planner the router's with the planner's pod
settings over it (one replica, never autoscaled). */}}
{{- define "epd.roleValues" -}}
{{- if eq .role "planner" -}}
{{- $p := .root.Values.planner -}}
{{- $v := deepCopy .root.Values.router -}}
{{- $_ := set $v "replicas" 1 -}}
{{- $_ := set $v "resources" $p.resources -}}
{{- $_ := set $v "nodeSelector" $p.nodeSelector -}}
{{- $_ := set $v "tolerations" $p.tolerations -}}
{{- $_ := set $v "affinity" $p.affinity -}}
{{- $_ := set $v "topologySpreadConstraints" list -}}
{{- $_ := set $v "autoscaling" (dict "enabled" false) -}}
{{- $_ := set $v "pdb" (dict "enabled" false) -}}
{{- toYaml $v -}}
{{- else -}}
{{- index .root.Values .role | toYaml -}}
{{- end -}}
{{- end -}}

{{- define "epd.image" -}}
{{- $repo := default .root.Values.image.repository .image.repository -}}
{{- $tag := default (default .root.Chart.AppVersion .root.Values.image.tag) .image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* The ServiceAccount of the router or the planner: dict "root" $ "role" ROLE. */}}
{{- define "epd.serviceAccountName" -}}
{{- if .root.Values.rbac.create -}}
{{- include "epd.componentName" . -}}
{{- else -}}
{{- default "default" .root.Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Whether Redis is configured at all ("true" or ""). */}}
{{- define "epd.hasRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* One env entry NAME for the Redis URL (in-chart, external URL or a Secret). */}}
{{- define "epd.redisEnv" -}}
{{- $root := .root -}}
- name: {{ .name }}
{{- if $root.Values.redis.enabled }}
  value: {{ printf "redis://%s-redis:%d/0" (include "epd.fullname" $root) (int $root.Values.redis.port) | quote }}
{{- else if $root.Values.redis.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.redis.existingSecret }}
      key: {{ $root.Values.redis.existingSecretKey }}
{{- else }}
  value: {{ $root.Values.redis.url | quote }}
{{- end }}
{{- end -}}

{{/* The gRPC addresses of every store node, by the StatefulSet's stable DNS names. */}}
{{- define "epd.kvstoreAddresses" -}}
{{- $root := . -}}
{{- $name := include "epd.componentName" (dict "root" $root "role" "kvstore") -}}
{{- $addresses := list -}}
{{- range $i := until (int $root.Values.kvstore.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc.%s:%d" $name $i $name $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.kvstore.port)) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* A config value as its environment variable spells it. Helm reads every number as a
float, which would print 1048576 as 1.048576e+06. */}}
{{- define "epd.envValue" -}}
{{- $v := . -}}
{{- if kindIs "slice" $v -}}
{{- $items := list -}}
{{- range $v }}{{ $items = append $items (include "epd.envValue" .) }}{{ end -}}
{{- join "," $items -}}
{{- else if and (kindIs "float64" $v) (eq $v (floor $v)) -}}
{{- int64 $v -}}
{{- else if kindIs "invalid" $v -}}
none
{{- else -}}
{{- toString $v -}}
{{- end -}}
{{- end -}}

{{/* The roles with autoscaling on, as a YAML list. */}}
{{- define "epd.autoscaledRoles" -}}
{{- $roles := list -}}
{{- range $role := (include "epd.roleNames" . | fromYamlArray) -}}
{{- $v := index $.Values $role -}}
{{- if and $v.enabled $v.autoscaling.enabled -}}
{{- $roles = append $roles $role -}}
{{- end -}}
{{- end -}}
{{- toYaml $roles -}}
{{- end -}}
