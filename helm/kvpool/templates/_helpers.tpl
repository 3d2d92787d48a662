{{/*
Names. The full name is kept to 40 characters: KubeRay and StatefulSets append their own suffixes
(`-head-svc`, `-gpu-worker-abcde`, `-redis-0`) and pod names stop at 63.
*/}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ include "kvpool.chart" . }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- end }}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Addresses (in-cluster DNS names). */}}
{{- define "kvpool.headService" -}}
{{- printf "%s-head" (include "kvpool.fullname" .) }}
{{- end }}

{{- define "kvpool.headHost" -}}
{{- printf "%s.%s.svc.%s" (include "kvpool.headService" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "kvpool.rayClientAddress" -}}
{{- printf "ray://%s:%d" (include "kvpool.headHost" .) (int .Values.ray.clientPort) }}
{{- end }}

{{- define "kvpool.dashboardService" -}}
{{- printf "%s-dashboard" (include "kvpool.fullname" .) }}
{{- end }}

{{- define "kvpool.redisName" -}}
{{- printf "%s-redis" (include "kvpool.fullname" .) }}
{{- end }}

{{- define "kvpool.redisHost" -}}
{{- printf "%s.%s.svc.%s" (include "kvpool.redisName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "kvpool.redisSecretName" -}}
{{- default (include "kvpool.redisName" .) .Values.redis.auth.existingSecret }}
{{- end }}

{{/*
The index URL as it appears to people (NOTES.txt): the password is never printed.
*/}}
{{- define "kvpool.redisUrlShown" -}}
{{- if eq .Values.redis.mode "internal" -}}
{{- printf "redis://%s:<password>@%s:%d/0" (ternary "<user>" "" .Values.redis.acl.enabled) (include "kvpool.redisHost" .) (int .Values.redis.port) }}
{{- else if .Values.redis.external.existingSecret -}}
{{- printf "<the URL in Secret %s, key %s>" .Values.redis.external.existingSecret .Values.redis.external.existingSecretKey }}
{{- else -}}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/*
The Redis user of a role (kvpool.index.redis_acl.USERS) when redis.acl.enabled.
*/}}
{{- define "kvpool.redisUser" -}}
{{- printf "kvpool-%s" . }}
{{- end }}

{{/*
Environment that gives a container the index URL of a role (operator, shard, engine) in the
variable named: the password from the Secret, never in the manifest. Kubernetes expands
$(REDIS_<ROLE>_PASSWORD) because it is defined first. Arg: (list root role variable).
*/}}
{{- define "kvpool.redisEnv" -}}
{{- $role := index . 1 }}
{{- $var := index . 2 }}
{{- with index . 0 }}
{{- $r := .Values.redis }}
{{- if eq $r.mode "internal" }}
{{- $pw := printf "REDIS_%s_PASSWORD" (upper $role) }}
{{- $user := ternary (include "kvpool.redisUser" $role) "" $r.acl.enabled }}
- name: {{ $pw }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvpool.redisSecretName" . }}
      key: {{ ternary (printf "%s-password" $role) $r.auth.existingSecretKey $r.acl.enabled }}
- name: {{ $var }}
  value: {{ printf "redis://%s:$(%s)@%s:%d/0" $user $pw (include "kvpool.redisHost" .) (int $r.port) | quote }}
{{- else if $r.external.existingSecret }}
- name: {{ $var }}
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret }}
      key: {{ include "kvpool.externalRedisKey" (list . $role) }}
{{- else }}
- name: {{ $var }}
  value: {{ $r.external.url | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The key of redis.external.existingSecret holding a role's URL. Arg: (list root role). */}}
{{- define "kvpool.externalRedisKey" -}}
{{- $ext := (index . 0).Values.redis.external }}
{{- $role := index . 1 }}
{{- if and (eq $role "shard") $ext.shardSecretKey }}{{ $ext.shardSecretKey }}
{{- else if and (eq $role "engine") $ext.engineSecretKey }}{{ $ext.engineSecretKey }}
{{- else }}{{ $ext.existingSecretKey }}
{{- end }}
{{- end }}

{{/*
Secrets: Ray's token (key auth_token, KubeRay's name) and the pool secret (kvpool.auth).
*/}}
{{- define "kvpool.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "kvpool.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{- define "kvpool.poolSecretName" -}}
{{- default (printf "%s-pool-secret" (include "kvpool.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "kvpool.poolSecretDir" -}}
/var/run/secrets/kvpool
{{- end }}

{{/*
A generated Secret value, base64: the one already in the cluster (an upgrade keeps it), else a
new random one. Arg: (list root secretName key length).
*/}}
{{- define "kvpool.keepOrGenerate" -}}
{{- $root := index . 0 }}
{{- $old := lookup "v1" "Secret" $root.Release.Namespace (index . 1) }}
{{- if and $old $old.data (hasKey $old.data (index . 2)) }}
{{- index $old.data (index . 2) }}
{{- else }}
{{- randAlphaNum (int (index . 3)) | b64enc }}
{{- end }}
{{- end }}

{{/*
Environment of every kvpool container that talks to Ray and holds the pool secret: Ray's token
authentication (RAY_AUTH_MODE, RAY_AUTH_TOKEN from its Secret; set here as well as by KubeRay's
authOptions, so an operator without authOptions still gets it) and KVPOOL_SECRET_FILE.
*/}}
{{- define "kvpool.authEnv" -}}
- name: RAY_AUTH_MODE
  value: {{ .Values.ray.auth.mode | quote }}
{{- if eq .Values.ray.auth.mode "token" }}
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvpool.rayTokenSecretName" . }}
      key: auth_token
{{- end }}
- name: KVPOOL_SECRET_FILE
  value: {{ printf "%s/%s" (include "kvpool.poolSecretDir" .) .Values.auth.existingSecretKey | quote }}
{{- end }}

{{- define "kvpool.poolSecretVolume" -}}
- name: pool-secret
  secret:
    secretName: {{ include "kvpool.poolSecretName" . }}
    {{- /* kvpool refuses a secret file others can read: the owner's alone (the pods' fsGroup reads it) */}}
    defaultMode: 256  # 0400 (decimal: every YAML parser reads it alike)
    items:
      - key: {{ .Values.auth.existingSecretKey }}
        path: {{ .Values.auth.existingSecretKey }}
{{- end }}

{{- define "kvpool.poolSecretMount" -}}
- name: pool-secret
  mountPath: {{ include "kvpool.poolSecretDir" . }}
  readOnly: true
{{- end }}

{{/* Sizes, MiB. */}}
{{- define "kvpool.slabMiB" -}}
{{- mul (int .Values.pool.pageMiB) (include "kvpool.dramPages" . | int) }}
{{- end }}

{{/* DRAM pages per shard: pool.dramMiB / pool.pageMiB when the size is given in MiB, else pool.dramPages. */}}
{{- define "kvpool.dramPages" -}}
{{- include "kvpool.pagesOf" (list .Values.pool.dramMiB .Values.pool.dramPages "pool.dramMiB" .Values.pool.pageMiB) }}
{{- end }}

{{/* Disk pages per shard: pool.disk.sizeMiB / pool.pageMiB when given, else pool.disk.pages. */}}
{{- define "kvpool.diskPages" -}}
{{- include "kvpool.pagesOf" (list .Values.pool.disk.sizeMiB .Values.pool.disk.pages "pool.disk.sizeMiB" .Values.pool.pageMiB) }}
{{- end }}

{{/* Whole pages of pageMiB in a tier of MiB, else the tier's page count. Arg: (list mib pages name pageMiB). */}}
{{- define "kvpool.pagesOf" -}}
{{- $mib := index . 0 }}{{- $name := index . 2 }}{{- $page := int64 (index . 3) }}
{{- if $mib }}
{{- $n := div (int64 $mib) $page }}
{{- if lt $n 1 }}
{{- fail (printf "%s %d holds no page of pool.pageMiB %d MiB: raise %s to %d or more, or lower pool.pageMiB" $name (int $mib) (int $page) $name (int $page)) }}
{{- end }}
{{- $n }}
{{- else }}
{{- int (index . 1) }}
{{- end }}
{{- end }}

{{/*
/dev/shm of a Ray pod: its object store + headroom, + the DRAM slab of its shard when there is no
run dir (node.enabled: the slab is a file in the run dir, the node's tmpfs). Arg: (list root objectStoreMiB).
*/}}
{{- define "kvpool.shmMiB" -}}
{{- $root := index . 0 }}
{{- $slab := ternary 0 (int (include "kvpool.slabMiB" $root)) $root.Values.node.enabled }}
{{- add (int (index . 1)) $slab (int $root.Values.shm.headroomMiB) }}
{{- end }}

{{/*
Shared memory a Ray pod's memory limit must exceed: object store + slab + headroom, wherever the
slab lives. The emptyDir's pages count against the limit; so does a slab in the run dir, since the
shard allocates it whole at start (posix_fallocate) and Linux charges tmpfs pages to the memory
cgroup of the process that allocates them (a hostPath tmpfs included). Arg: (list root objectStoreMiB).
*/}}
{{- define "kvpool.sharedMiB" -}}
{{- $root := index . 0 }}
{{- add (int (index . 1)) (int (include "kvpool.slabMiB" $root)) (int $root.Values.shm.headroomMiB) }}
{{- end }}

{{/* The node directory behind the run dir (node.hostPath, else one per release on the host's /dev/shm). */}}
{{- define "kvpool.runHostPath" -}}
{{- default (printf "/dev/shm/kvpool-%s-%s" .Release.Namespace (include "kvpool.fullname" .)) .Values.node.hostPath }}
{{- end }}

{{/*
A memory quantity in MiB when written with a Mi, Gi or Ti suffix (or plain bytes); "" otherwise
(then the render-time check below is skipped).
*/}}
{{- define "kvpool.quantityMiB" -}}
{{- $q := toString . }}
{{- if regexMatch "^[0-9]+Mi$" $q }}{{ trimSuffix "Mi" $q }}
{{- else if regexMatch "^[0-9]+Gi$" $q }}{{ mul (int (trimSuffix "Gi" $q)) 1024 }}
{{- else if regexMatch "^[0-9]+Ti$" $q }}{{ mul (int (trimSuffix "Ti" $q)) 1048576 }}
{{- else if regexMatch "^[0-9]+$" $q }}{{ div (int64 $q) 1048576 }}
{{- end }}
{{- end }}

{{/*
Checks across values that the JSON schema cannot express; each failure names the values to change.
*/}}
{{- define "kvpool.checks" -}}
{{- $w := .Values.worker }}
{{- if or (gt (int $w.minReplicas) (int $w.replicas)) (gt (int $w.replicas) (int $w.maxReplicas)) }}
{{- fail (printf "worker: need minReplicas <= replicas <= maxReplicas, got %d <= %d <= %d" (int $w.minReplicas) (int $w.replicas) (int $w.maxReplicas)) }}
{{- end }}
{{- range $group := list "head" "worker" }}
{{- $g := index $.Values $group }}
{{- $limit := dig "limits" "memory" "" ($g.resources | default dict) }}
{{- $limitMiB := include "kvpool.quantityMiB" $limit }}
{{- $shm := int (include "kvpool.sharedMiB" (list $ $g.objectStoreMiB)) }}
{{- if and $limitMiB (le (int64 $limitMiB) (int64 $shm)) }}
{{- fail (printf "%s.resources.limits.memory %s does not exceed its shared memory of %d MiB (%s.objectStoreMiB %d + pool.pageMiB x pool.dramPages = %s + shm.headroomMiB %d): /dev/shm and the DRAM slab (%s) count against the memory limit; raise the limit or shrink the object store or the slab" $group (toString $limit) $shm $group (int $g.objectStoreMiB) (include "kvpool.slabMiB" $) (int $.Values.shm.headroomMiB) (ternary "in node.runDir, charged to the pod that allocates it" "in /dev/shm" $.Values.node.enabled)) }}
{{- end }}
{{- end }}
{{- if and .Values.node.enabled (not (dig "runAsUser" nil (.Values.ray.podSecurityContext | default dict))) }}
{{- fail "node.enabled needs ray.podSecurityContext.runAsUser: the run dir's files are the Ray pods' user's (mode 0600) and engine pods must run as that same user" }}
{{- end }}
{{- if and .Values.node.enabled .Values.pool.disk.enabled (eq (clean .Values.node.runDir) (clean .Values.pool.disk.path)) }}
{{- fail "node.runDir and pool.disk.path are the same directory: give the disk tier its own" }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}
{{- fail "redis.mode=external needs redis.external.url (redis://host:6379/0) or redis.external.existingSecret (a Secret holding the URL)" }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.existingSecret) (or .Values.redis.external.shardSecretKey .Values.redis.external.engineSecretKey) }}
{{- fail "redis.external.shardSecretKey and engineSecretKey name keys of redis.external.existingSecret: set it (a Secret holding each user's URL)" }}
{{- end }}
{{- if and (eq .Values.pool.policy "tiered-memory") (not .Values.pool.disk.enabled) }}
{{- fail "pool.policy=tiered-memory demotes DRAM -> disk before dropping: set pool.disk.enabled=true (and pool.disk.pages), or pick a one-tier policy such as lru" }}
{{- end }}
{{- $ids := list }}
{{- range .Values.pool.tenants }}
{{- if has .id $ids }}
{{- fail (printf "pool.tenants: tenant %q is listed twice" .id) }}
{{- end }}
{{- $ids = append $ids .id }}
{{- end }}
{{- if not (has .Values.engineTenant $ids) }}
{{- fail (printf "engineTenant %q is not among pool.tenants %v" .Values.engineTenant $ids) }}
{{- end }}
{{- if .Values.warmup.enabled }}
{{- range .Values.warmup.entries }}
{{- if not (has .tenant $ids) }}
{{- fail (printf "warmup.entries: tenant %q is not among pool.tenants %v" .tenant $ids) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes every Ray pod has: /dev/shm, the pool config, the run dir, the disk tier. Arg: (list root objectStoreMiB). */}}
{{- define "kvpool.rayVolumes" -}}
{{- $root := index . 0 }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ printf "%sMi" (include "kvpool.shmMiB" .) }}
- name: config
  configMap:
    name: {{ include "kvpool.fullname" $root }}-config
{{ include "kvpool.poolSecretVolume" $root }}
{{- if $root.Values.node.enabled }}
- name: run-dir
  hostPath:
    path: {{ include "kvpool.runHostPath" $root }}
    type: DirectoryOrCreate
{{- end }}
{{- if $root.Values.pool.disk.enabled }}
- name: disk
{{- if $root.Values.pool.disk.hostPath }}
  hostPath:
    path: {{ $root.Values.pool.disk.hostPath }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
    sizeLimit: {{ printf "%dMi" (mul (int $root.Values.pool.pageMiB) (include "kvpool.diskPages" $root | int)) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvpool.rayVolumeMounts" -}}
- name: shm
  mountPath: /dev/shm
- name: config
  mountPath: /etc/kvpool
  readOnly: true
{{ include "kvpool.poolSecretMount" . }}
{{- if .Values.node.enabled }}
- name: run-dir
  mountPath: {{ .Values.node.runDir }}
{{- end }}
{{- if .Values.pool.disk.enabled }}
- name: disk
  mountPath: {{ .Values.pool.disk.path }}
{{- end }}
{{- end }}

{{/* $KVPOOL_RUN_DIR of a Ray container: where its shard puts its socket, node file, page table and slab. */}}
{{- define "kvpool.nodeEnv" -}}
{{- if .Values.node.enabled }}
- name: KVPOOL_RUN_DIR
  value: {{ .Values.node.runDir | quote }}
{{- end }}
{{- end }}

{{/*
The Ray pods' securityContext, and their init container that hands the node directories (run dir,
a hostPath disk tier) to the pods' user: the kubelet creates a DirectoryOrCreate hostPath as root,
0755, where the shard (runAsUser) could not create its files.
*/}}
{{- define "kvpool.raySecurityContext" -}}
{{- with .Values.ray.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "kvpool.prepareDirs" -}}
{{- $sc := .Values.ray.podSecurityContext | default dict }}
{{- $dirs := list }}
{{- if .Values.node.enabled }}{{ $dirs = append $dirs .Values.node.runDir }}{{ end }}
{{- if and .Values.pool.disk.enabled .Values.pool.disk.hostPath }}{{ $dirs = append $dirs .Values.pool.disk.path }}{{ end }}
{{- if and .Values.node.prepare $dirs (hasKey $sc "runAsUser") }}
{{- $owner := toString (int64 $sc.runAsUser) }}
{{- if hasKey $sc "runAsGroup" }}{{ $owner = printf "%s:%d" $owner (int64 $sc.runAsGroup) }}{{ end }}
initContainers:
  - name: prepare-node-dirs
    image: {{ include "kvpool.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["/bin/sh", "-c", {{ printf "chown %s %s && chmod 0700 %s" $owner (join " " $dirs) (join " " $dirs) | quote }}]
    securityContext:
      runAsUser: 0
      runAsGroup: 0
      runAsNonRoot: false
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {cpu: 100m, memory: 64Mi}
    volumeMounts:
      {{- if .Values.node.enabled }}
      - name: run-dir
        mountPath: {{ .Values.node.runDir }}
      {{- end }}
      {{- if and .Values.pool.disk.enabled .Values.pool.disk.hostPath }}
      - name: disk
        mountPath: {{ .Values.pool.disk.path }}
      {{- end }}
{{- end }}
{{- end }}
