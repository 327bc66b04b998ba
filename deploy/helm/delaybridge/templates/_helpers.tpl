{{/* Chart name, truncated to the 63 characters DNS labels allow. */}}
{{- define "delaybridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, truncated to 52 characters: it names the
StatefulSet, whose pods get a controller-revision-hash label of the name
plus 11 characters (at most 63), and the headless Service (name plus
"-headless").
*/}}
{{- define "delaybridge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "delaybridge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "delaybridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "delaybridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "delaybridge.labels" -}}
helm.sh/chart: {{ include "delaybridge.chart" . }}
{{ include "delaybridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: broker
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "delaybridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "delaybridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "delaybridge.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Where each credential is mounted. The keys are the names under
.Values.secrets; the paths are relative to /etc/delaybridge/secrets.
*/}}
{{- define "delaybridge.secretPaths" -}}
adminToken: admin/token
metricsToken: admin/metrics-token
kafkaSaslPassword: kafka/sasl-password
kafkaTlsCa: kafka/tls/ca.crt
kafkaTlsCert: kafka/tls/tls.crt
kafkaTlsKey: kafka/tls/tls.key
natsPassword: nats/password
natsToken: nats/token
natsCreds: nats/nats.creds
natsTlsCa: nats/tls/ca.crt
natsTlsCert: nats/tls/tls.crt
natsTlsKey: nats/tls/tls.key
{{- end }}

{{/*
Absolute path of a mounted credential, or "" when its Secret is not set.
Call with (list $ "natsCreds").
*/}}
{{- define "delaybridge.secretFile" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $ref := index $root.Values.secrets $name }}
{{- if $ref.secretName }}
{{- $paths := include "delaybridge.secretPaths" $root | fromYaml }}
{{- printf "/etc/delaybridge/secrets/%s" (index $paths $name) }}
{{- end }}
{{- end }}

{{/*
Checks that need more than the JSON schema. The admin decision comes first:
it is the one a default install always hits.
*/}}
{{- define "delaybridge.validate" -}}
{{- $c := .Values.config }}
{{- if and (not .Values.secrets.adminToken.secretName) (not $c.admin.allow_insecure_listen) }}
{{- fail (printf "delaybridge: the admin API listens on every interface of the pod (:%d) and needs an explicit auth decision: set secrets.adminToken.secretName (an existing Secret holding the bearer token, key secrets.adminToken.key), or set config.admin.allow_insecure_listen=true to serve it without a token" (int .Values.service.port)) }}
{{- end }}
{{- if and .Values.secrets.metricsToken.secretName (not .Values.secrets.adminToken.secretName) }}
{{- fail "delaybridge: secrets.metricsToken needs secrets.adminToken: without an admin token /metrics (and /v1/...) need no token at all" }}
{{- end }}
{{- if and (not $c.kafka.enabled) (not $c.nats.enabled) }}
{{- fail "delaybridge: enable at least one transport: config.kafka.enabled or config.nats.enabled" }}
{{- end }}
{{- if $c.kafka.enabled }}
{{- if not $c.kafka.brokers }}
{{- fail "delaybridge: config.kafka.brokers is empty" }}
{{- end }}
{{- if not $c.kafka.sources }}
{{- fail "delaybridge: config.kafka.sources is empty" }}
{{- end }}
{{- if and $c.kafka.sasl.mechanism (not .Values.secrets.kafkaSaslPassword.secretName) }}
{{- fail "delaybridge: config.kafka.sasl.mechanism is set but secrets.kafkaSaslPassword.secretName is empty" }}
{{- end }}
{{- if and $c.kafka.sasl.mechanism (not $c.kafka.sasl.username) }}
{{- fail "delaybridge: config.kafka.sasl.mechanism is set but config.kafka.sasl.username is empty" }}
{{- end }}
{{- if and $c.kafka.sasl.username (not $c.kafka.sasl.mechanism) }}
{{- fail "delaybridge: config.kafka.sasl.username is set but config.kafka.sasl.mechanism is empty" }}
{{- end }}
{{- if and .Values.secrets.kafkaSaslPassword.secretName (not $c.kafka.sasl.mechanism) }}
{{- fail "delaybridge: secrets.kafkaSaslPassword is set but config.kafka.sasl.mechanism is empty" }}
{{- end }}
{{- if and (or .Values.secrets.kafkaTlsCa.secretName .Values.secrets.kafkaTlsCert.secretName .Values.secrets.kafkaTlsKey.secretName) (not $c.kafka.tls.enabled) }}
{{- fail "delaybridge: secrets.kafkaTls* are set but config.kafka.tls.enabled is false" }}
{{- end }}
{{- if ne (empty .Values.secrets.kafkaTlsCert.secretName) (empty .Values.secrets.kafkaTlsKey.secretName) }}
{{- fail "delaybridge: secrets.kafkaTlsCert and secrets.kafkaTlsKey go together (client certificate and its key)" }}
{{- end }}
{{- end }}
{{- if $c.nats.enabled }}
{{- if not $c.nats.url }}
{{- fail "delaybridge: config.nats.url is empty" }}
{{- end }}
{{- if not $c.nats.sources }}
{{- fail "delaybridge: config.nats.sources is empty" }}
{{- end }}
{{- if and $c.nats.replicas (not $c.nats.create) }}
{{- fail "delaybridge: config.nats.replicas is set but config.nats.create is false: the bridge sets the stream's replicas only when it creates (or updates) the stream" }}
{{- end }}
{{- if and $c.nats.user (not .Values.secrets.natsPassword.secretName) }}
{{- fail "delaybridge: config.nats.user is set but secrets.natsPassword.secretName is empty" }}
{{- end }}
{{- if and .Values.secrets.natsPassword.secretName (not $c.nats.user) }}
{{- fail "delaybridge: secrets.natsPassword is set but config.nats.user is empty" }}
{{- end }}
{{- $auth := 0 }}
{{- if .Values.secrets.natsPassword.secretName }}{{ $auth = add1 $auth }}{{ end }}
{{- if .Values.secrets.natsToken.secretName }}{{ $auth = add1 $auth }}{{ end }}
{{- if .Values.secrets.natsCreds.secretName }}{{ $auth = add1 $auth }}{{ end }}
{{- if gt $auth 1 }}
{{- fail "delaybridge: choose one NATS auth method: secrets.natsPassword, secrets.natsToken or secrets.natsCreds" }}
{{- end }}
{{- if and (or .Values.secrets.natsTlsCa.secretName .Values.secrets.natsTlsCert.secretName .Values.secrets.natsTlsKey.secretName) (not $c.nats.tls.enabled) }}
{{- fail "delaybridge: secrets.natsTls* are set but config.nats.tls.enabled is false" }}
{{- end }}
{{- if ne (empty .Values.secrets.natsTlsCert.secretName) (empty .Values.secrets.natsTlsKey.secretName) }}
{{- fail "delaybridge: secrets.natsTlsCert and secrets.natsTlsKey go together (client certificate and its key)" }}
{{- end }}
{{- end }}
{{- if and $c.nats.enabled (contains "@" (toString (default "" $c.nats.url))) }}
{{- fail "delaybridge: config.nats.url carries credentials (user:password@ or token@), which would be in the ConfigMap: use secrets.natsPassword, secrets.natsToken or secrets.natsCreds" }}
{{- end }}
{{- range $name, $ref := .Values.secrets }}
{{- if and $ref.secretName (hasPrefix "kafka" $name) (not $c.kafka.enabled) }}
{{- fail (printf "delaybridge: secrets.%s is set but config.kafka.enabled is false" $name) }}
{{- end }}
{{- if and $ref.secretName (hasPrefix "nats" $name) (not $c.nats.enabled) }}
{{- fail (printf "delaybridge: secrets.%s is set but config.nats.enabled is false" $name) }}
{{- end }}
{{- end }}
{{- /* The bounds config.Validate puts on durations and the store, so that a
value the bridge refuses fails the render, not the pod (the binary's
defaults where a value is not set). */}}
{{- if hasKey $c "horizon" }}
{{- if lt (include "delaybridge.durationSeconds" (toString $c.horizon) | float64) 1.0 }}
{{- fail (printf "delaybridge: config.horizon (%v) must be at least 1s" $c.horizon) }}
{{- end }}
{{- end }}
{{- if and (hasKey $c "shutdown_timeout") (le (include "delaybridge.durationSeconds" (toString $c.shutdown_timeout) | float64) 0.0) }}
{{- fail (printf "delaybridge: config.shutdown_timeout (%v) must be positive" $c.shutdown_timeout) }}
{{- end }}
{{- $retry := default dict $c.retry }}
{{- $ri := include "delaybridge.durationSeconds" (toString (ternary $retry.initial "500ms" (hasKey $retry "initial"))) | float64 }}
{{- $rm := include "delaybridge.durationSeconds" (toString (ternary $retry.max "5m" (hasKey $retry "max"))) | float64 }}
{{- if le $ri 0.0 }}
{{- fail (printf "delaybridge: config.retry.initial (%v) must be positive" $retry.initial) }}
{{- end }}
{{- if lt $rm $ri }}
{{- fail (printf "delaybridge: config.retry.max (%v) must be at least config.retry.initial (%v; the defaults are 500ms and 5m)" (ternary $retry.max "5m" (hasKey $retry "max")) (ternary $retry.initial "500ms" (hasKey $retry "initial"))) }}
{{- end }}
{{- if gt $rm 31536000.0 }}
{{- fail (printf "delaybridge: config.retry.max (%v) must be at most 365d" $retry.max) }}
{{- end }}
{{- $store := default dict $c.store }}
{{- if hasKey $store "memtable_mb" }}
{{- $half := div (int64 (default 768 $store.cache_mb)) 2 }}
{{- if gt (int64 $store.memtable_mb) $half }}
{{- fail (printf "delaybridge: config.store.memtable_mb (%v) must be at most config.store.cache_mb/2 (%d)" $store.memtable_mb $half) }}
{{- end }}
{{- end }}
{{- $st := toString (default "" $c.shutdown_timeout) }}
{{- $what := $st }}
{{- if not $st }}{{ $st = "10s" }}{{ $what = "10s, the default" }}{{ end }}
{{- $secs := include "delaybridge.durationSeconds" $st | float64 }}
{{- if ge $secs (float64 .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "delaybridge: config.shutdown_timeout (%s) must be below terminationGracePeriodSeconds (%d), with a margin, or Kubernetes kills the bridge mid-shutdown" $what (int .Values.terminationGracePeriodSeconds)) }}
{{- end }}
{{- end }}

{{/*
Seconds in a duration as the bridge reads it (config.ParseDuration): a Go
duration ("90s", "1m30s", "1.5h", "500ms") optionally led by whole days
("2d12h"). The schema has checked the syntax.
*/}}
{{- define "delaybridge.durationSeconds" -}}
{{- $unit := dict "ns" 0.000000001 "us" 0.000001 "µs" 0.000001 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 "d" 86400.0 }}
{{- $total := 0.0 }}
{{- range regexFindAll "[0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h|d)" . -1 }}
{{- $u := regexFind "(ns|us|µs|ms|s|m|h|d)$" . }}
{{- $total = addf $total (mulf (float64 (trimSuffix $u .)) (index $unit $u)) }}
{{- end }}
{{- $total }}
{{- end }}

{{/*
The bridge's config.yaml: the user's config with the chart-only keys
(enabled flags) removed and the chart-owned keys (data_dir, admin.listen,
*_file paths) filled in. Never holds a secret value.
*/}}
{{- define "delaybridge.config" -}}
{{- $c := deepCopy .Values.config }}
{{- $_ := set $c "data_dir" "/var/lib/delaybridge" }}
{{- /* ":PORT": every interface, IPv6 included; 0.0.0.0 would be IPv4 only. */}}
{{- $admin := dict "listen" (printf ":%d" (int .Values.service.port)) }}
{{- with include "delaybridge.secretFile" (list . "adminToken") }}
{{- $_ := set $admin "token_file" . }}
{{- end }}
{{- with include "delaybridge.secretFile" (list . "metricsToken") }}
{{- $_ := set $admin "metrics_token_file" . }}
{{- end }}
{{- if $c.admin.allow_insecure_listen }}
{{- $_ := set $admin "allow_insecure_listen" true }}
{{- end }}
{{- if $c.admin.pprof }}
{{- $_ := set $admin "pprof" true }}
{{- end }}
{{- $_ := set $c "admin" $admin }}
{{- if $c.kafka.enabled }}
{{- $k := omit $c.kafka "enabled" "tls" "sasl" }}
{{- if not $k.client_id }}{{ $k = omit $k "client_id" }}{{ end }}
{{- if $c.kafka.tls.enabled }}
{{- $tls := dict "enabled" true }}
{{- with $c.kafka.tls.server_name }}{{ $_ := set $tls "server_name" . }}{{ end }}
{{- if $c.kafka.tls.insecure_skip_verify }}{{ $_ := set $tls "insecure_skip_verify" true }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "kafkaTlsCa") }}{{ $_ := set $tls "ca_file" . }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "kafkaTlsCert") }}{{ $_ := set $tls "cert_file" . }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "kafkaTlsKey") }}{{ $_ := set $tls "key_file" . }}{{ end }}
{{- $_ := set $k "tls" $tls }}
{{- end }}
{{- if $c.kafka.sasl.mechanism }}
{{- $sasl := dict "mechanism" $c.kafka.sasl.mechanism "username" $c.kafka.sasl.username }}
{{- $_ := set $sasl "password_file" (include "delaybridge.secretFile" (list . "kafkaSaslPassword")) }}
{{- $_ := set $k "sasl" $sasl }}
{{- end }}
{{- $_ := set $c "kafka" $k }}
{{- else }}
{{- $c = omit $c "kafka" }}
{{- end }}
{{- if $c.nats.enabled }}
{{- $n := omit $c.nats "enabled" "tls" "user" "create" "replicas" }}
{{- if $c.nats.create }}{{ $_ := set $n "create" true }}{{ end }}
{{- if $c.nats.replicas }}{{ $_ := set $n "replicas" $c.nats.replicas }}{{ end }}
{{- if $c.nats.tls.enabled }}
{{- $tls := dict "enabled" true }}
{{- with $c.nats.tls.server_name }}{{ $_ := set $tls "server_name" . }}{{ end }}
{{- if $c.nats.tls.insecure_skip_verify }}{{ $_ := set $tls "insecure_skip_verify" true }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "natsTlsCa") }}{{ $_ := set $tls "ca_file" . }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "natsTlsCert") }}{{ $_ := set $tls "cert_file" . }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "natsTlsKey") }}{{ $_ := set $tls "key_file" . }}{{ end }}
{{- $_ := set $n "tls" $tls }}
{{- end }}
{{- if $c.nats.user }}
{{- $_ := set $n "user" $c.nats.user }}
{{- $_ := set $n "password_file" (include "delaybridge.secretFile" (list . "natsPassword")) }}
{{- end }}
{{- with include "delaybridge.secretFile" (list . "natsToken") }}{{ $_ := set $n "token_file" . }}{{ end }}
{{- with include "delaybridge.secretFile" (list . "natsCreds") }}{{ $_ := set $n "creds_file" . }}{{ end }}
{{- $_ := set $c "nats" $n }}
{{- else }}
{{- $c = omit $c "nats" }}
{{- end }}
{{- toYaml $c }}
{{- end }}

{{/*
90% of resources.limits.memory, in bytes, for GOMEMLIMIT: the Go GC starts
working hard before the kernel's OOM killer does. The image is built with
CGO_ENABLED=0, so the store's cache and memtables (config.store.cache_mb,
default 768 MiB) are Go heap too: a limit of what the cache leaves would sit
below the heap's live size once the cache fills, and the GC would run back
to back (measured: 2 100 collections in a 10 M task load, 40 a second once
the cache passed the limit).

The limit is read as a Kubernetes quantity: a number, whole or decimal, with
an optional leading +, and either a binary suffix (Ki Mi Gi Ti Pi Ei), a
decimal one (m k M G T P E) or a decimal exponent (e9, E+09); plain bytes as
a string or as a YAML number (which Helm holds as a float and prints as
1.610612736e+09). Fractional bytes round up, as Kubernetes rounds them.
Anything else fails the render rather than render no limit: without one
the GC lets the heap, the cache in it, grow to twice its live size. Fails
too when that 90% does not leave 128 MiB beside the cache.
*/}}
{{- define "delaybridge.goMemLimit" -}}
{{- $m := toString .Values.resources.limits.memory }}
{{- if not (regexMatch "^\\+?([0-9]+(\\.[0-9]*)?|\\.[0-9]+)([eE][-+]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$" $m) }}
{{- fail (printf "resources.limits.memory %q is not a Kubernetes quantity the chart can read (e.g. 1536Mi, 1.5Gi, 2G, 1610612736): write it in Mi or Gi, or set goMemLimitFromResources: false and GOMEMLIMIT yourself through extraEnv (about 90%% of the limit, at least config.store.cache_mb + 128Mi: the cache is Go heap in this image)" $m) }}
{{- end }}
{{- $parts := regexSplit "(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)$" (trimPrefix "+" $m) -1 }}
{{- $num := index $parts 0 }}
{{- $unit := trimPrefix $num (trimPrefix "+" $m) }}
{{- $units := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- $bytes := ceil (mulf (float64 $num) (index $units $unit)) }}
{{- if ge $bytes (float64 "9e18") }}
{{- fail (printf "resources.limits.memory %s is too large for GOMEMLIMIT" $m) }}
{{- end }}
{{- $cacheMB := 768 }}
{{- with .Values.config }}{{- with .store }}{{- with .cache_mb }}{{- $cacheMB = int64 . }}{{- end }}{{- end }}{{- end }}
{{- /* floor(9*bytes/10) without the product overflowing int64 */}}
{{- $limit := sub (int64 $bytes) (div (add (int64 $bytes) 9) 10) }}
{{- if lt (sub $limit (mul $cacheMB 1048576)) 134217728 }}
{{- fail (printf "resources.limits.memory %s gives a GOMEMLIMIT (90%% of it) that leaves less than 128Mi beside config.store.cache_mb (%d MiB), which is Go heap in this image: the GC would run back to back once the cache fills; raise the limit or lower the cache" $m $cacheMB) }}
{{- end }}
{{- $limit }}
{{- end }}
