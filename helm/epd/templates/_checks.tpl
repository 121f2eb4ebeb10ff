{{/*
Checks across values that the schema cannot express; each failure names the values to change.
*/}}
{{- define "epd.checks" -}}
{{- $v := .Values -}}
{{- range $role := list "router" "kvstore" }}
{{- if (index $v $role).autoscaling.enabled }}
{{- if eq $role "kvstore" }}
{{- fail "kvstore.autoscaling.enabled: store nodes are listed by index in every engine's EPD_*_KVSTORE; change kvstore.replicas instead" }}
{{- else }}
{{- fail "router.autoscaling.enabled: the planner sizes encoder, prefill and decode only; set router.replicas" }}
{{- end }}
{{- end }}
{{- end }}
{{- range $role := include "epd.roleNames" . | fromYamlArray }}
{{- range $field := list "host" "port" "metrics_port" "transfer_port" }}
{{- if hasKey (index $v $role).config $field }}
{{- fail (printf "%s.config.%s: the chart sets it (the pod's ports and probes follow %s.port / metricsPort / transferPort); set those instead" $role $field $role) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $role := include "epd.autoscaledRoles" . | fromYamlArray }}
{{- $a := (index $v $role).autoscaling }}
{{- if and (eq $a.mode "planner") (ne $v.planner.mode "kubernetes") }}
{{- fail (printf "%s.autoscaling.mode=planner needs planner.mode=kubernetes (the planner scales the Deployment itself); got planner.mode=%s" $role $v.planner.mode) }}
{{- end }}
{{- if and (eq $a.mode "hpa") (ne $v.planner.mode "external") }}
{{- fail (printf "%s.autoscaling.mode=hpa needs planner.mode=external (the planner publishes the metric the HPA follows); got planner.mode=%s" $role $v.planner.mode) }}
{{- end }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s.autoscaling: minReplicas (%d) is above maxReplicas (%d)" $role (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if and $v.kvstore.enabled (gt (int $v.kvstore.replicas) 0) (gt (int $v.kv.blockReplicas) (int $v.kvstore.replicas)) }}
{{- fail (printf "kv.blockReplicas (%d) is above kvstore.replicas (%d): a block cannot go to more store nodes than there are" (int $v.kv.blockReplicas) (int $v.kvstore.replicas)) }}
{{- end }}
{{- if and $v.model.pvc.claimName $v.model.initContainer.enabled }}
{{- fail "model: set model.pvc.claimName or model.initContainer.enabled, not both" }}
{{- end }}
{{- if and $v.model.initContainer.enabled (not $v.model.initContainer.command) (not $v.model.initContainer.args) }}
{{- fail "model.initContainer: give the command (or args) that downloads the model into $(EPD_MODEL_DIR)" }}
{{- end }}
{{- if and $v.router.enabled (not (or $v.auth.apiKeys.values $v.auth.apiKeys.existingSecret (include "epd.hasRedis" .) $v.auth.allowUnauthenticated)) }}
{{- fail "auth: the router listens beyond its pod and would have no API keys: set auth.apiKeys.values or auth.apiKeys.existingSecret, or a Redis (redis.enabled / redis.url) to keep keys in, or auth.allowUnauthenticated=true for a private test cluster" }}
{{- end }}
{{- if and $v.rbac.create (ne $v.planner.mode "off") (not $v.router.enabled) }}
{{- fail "planner.mode: the planner runs with the router's image and settings; enable the router" }}
{{- end }}
{{- end -}}

{{/* planner.json (services/router/planner/config.py reads it): planner.config plus the
replica limits of each autoscaled role; a role left out is never scaled. The kubernetes
actuator finds a role's Deployment by its labels (EPD_ROUTER_K8S_LABEL_SELECTOR, epd.io/role). */}}
{{- define "epd.plannerConfig" -}}
{{- $cfg := deepCopy .Values.planner.config -}}
{{- $roles := dict -}}
{{- range $role := include "epd.autoscaledRoles" . | fromYamlArray -}}
{{- $a := (index $.Values $role).autoscaling -}}
{{- $entry := dict "min_replicas" (int $a.minReplicas) "max_replicas" (int $a.maxReplicas) -}}
{{- $_ := set $roles $role $entry -}}
{{- end -}}
{{- $_ := set $cfg "roles" $roles -}}
{{- toPrettyJson $cfg -}}
{{- end -}}

{{/* The data of the chart's own auth Secret (empty: no Secret needed). */}}
{{- define "epd.authSecretData" -}}
{{- $a := .Values.auth -}}
{{- if and $a.apiKeys.values (not $a.apiKeys.existingSecret) }}
{{ $a.apiKeys.secretKey }}: {{ join "," $a.apiKeys.values | quote }}
{{- end }}
{{- if and $a.adminToken.value (not $a.adminToken.existingSecret) }}
{{ $a.adminToken.secretKey }}: {{ $a.adminToken.value | quote }}
{{- end }}
{{- end -}}
