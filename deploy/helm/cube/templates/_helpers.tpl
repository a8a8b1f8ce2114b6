{{/* Names and labels. */}}
{{- define "cube.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "cube.labels" -}}
app.kubernetes.io/name: cube
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cube.selector" -}}
app.kubernetes.io/name: cube
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* An image reference: repository@digest when pinned, else repository:tag. */}}
{{- define "cube.image" -}}
{{- if .digest -}}{{ .repository }}@{{ .digest }}{{- else -}}{{ .repository }}:{{ .tag }}{{- end -}}
{{- end -}}

{{/* The Secret holding ca.crt, ca.key and admin-token. */}}
{{- define "cube.pkiSecret" -}}
{{- .Values.pki.existingSecret | default (printf "%s-pki" (include "cube.fullname" .)) -}}
{{- end -}}

{{- define "cube.masterHost" -}}{{ include "cube.fullname" . }}-master.{{ .Release.Namespace }}.svc{{- end -}}
{{- define "cube.proxyHost" -}}{{ include "cube.fullname" . }}-proxy.{{ .Release.Namespace }}.svc{{- end -}}

{{/* The object store's keys of a TOML table ([templates.object_store],
[store]); the credentials are files of the credentialsSecret mount. */}}
{{- define "cube.objectStore" -}}
{{- $o := .Values.objectStore -}}
endpoint = {{ $o.endpoint | quote }}
bucket = {{ $o.bucket | quote }}
prefix = {{ $o.prefix | quote }}
region = {{ $o.region | quote }}
secure = {{ $o.secure }}
{{- if $o.credentialsSecret }}
access_key_file = "/etc/cube/objstore/access-key"
secret_key_file = "/etc/cube/objstore/secret-key"
{{- end }}
{{- end -}}

{{/* Refusals the schema cannot express. */}}
{{- define "cube.validate" -}}
{{- if and (eq .Values.mode "full") (eq .Values.catalog.type "sqlite") (gt (int .Values.master.replicas) 1) -}}
{{- fail "catalog.type sqlite holds one replica's catalog: with master.replicas > 1 use catalog.type mariadb or mysql" -}}
{{- end -}}
{{- if and (eq .Values.mode "full") (eq .Values.catalog.type "mysql") (or (not .Values.catalog.mysql.host) (not .Values.catalog.mysql.passwordSecret)) -}}
{{- fail "catalog.type mysql needs catalog.mysql.host and catalog.mysql.passwordSecret" -}}
{{- end -}}
{{- if and (eq .Values.mode "compute-only") (or (not .Values.join.masterAddr) (not .Values.join.joinAddr) (not .Values.join.tokenSecret)) -}}
{{- fail "mode compute-only needs join.masterAddr, join.joinAddr and join.tokenSecret (a Secret with key token: cubecli node join-token on the master)" -}}
{{- end -}}
{{- if and .Values.objectStore.endpoint (not .Values.objectStore.bucket) -}}
{{- fail "objectStore.endpoint needs objectStore.bucket" -}}
{{- end -}}
{{- if and (eq .Values.proxy.tls.mode "secret") (not .Values.proxy.tls.secretName) -}}
{{- fail "proxy.tls.mode secret needs proxy.tls.secretName" -}}
{{- end -}}
{{- if and (eq .Values.proxy.tls.mode "certManager") (not .Values.proxy.tls.issuer.name) -}}
{{- fail "proxy.tls.mode certManager needs proxy.tls.issuer.name" -}}
{{- end -}}
{{- range $k, $v := .Values.images -}}
{{- if and (kindIs "map" $v) (eq (toString $v.tag) "latest") (not $v.digest) -}}
{{- fail (printf "images.%s: tag latest is refused (pin a version or a digest)" $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The uninstall hook's drain pod: every sandbox of the node's cubelet
destroyed through its API (cubelet releases their mounts, loop devices,
cgroups and network slots). */}}
{{- define "cube.drainScript" -}}
sock={{ .Values.node.runDir }}/cubelet.sock
if [ ! -S "$sock" ]; then echo "no cubelet socket at $sock: no sandbox to destroy"; exit 0; fi
for id in $(cubecli --addr "$sock" sandbox ls | awk 'NR > 1 && $1 != "" {print $1}'); do
  cubecli --addr "$sock" sandbox rm "$id" && echo "destroyed sandbox $id"
done
left=$(cubecli --addr "$sock" sandbox ls | awk 'NR > 1 && $1 != ""' | wc -l)
echo "sandboxes left: $left"
[ "$left" -eq 0 ]
{{- end -}}

{{/* The uninstall hook's purge pod (after network-agent --purge): every
mount under the node's paths (the pool's XFS image first of all), the loop
devices backed by files there, and cubelet's empty cgroups. */}}
{{- define "cube.purgeScript" -}}
for root in {{ .Values.node.dataDir }} {{ .Values.node.runDir }}; do
  awk -v r="$root" '$5 != r && index($5, r "/") == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
    umount "$m" && echo "unmounted $m"
  done
done
for f in /sys/block/loop*/loop/backing_file; do
  [ -e "$f" ] || continue
  case "$(cat "$f")" in
    {{ .Values.node.dataDir }}/*) d=/dev/$(basename "$(dirname "$(dirname "$f")")"); losetup -d "$d" && echo "detached $d ($(cat "$f" 2>/dev/null || echo released))" ;;
  esac
done
for d in $(find /sys/fs/cgroup -maxdepth 2 -type d -name {{ .Values.node.cgroupParent | quote }}); do
  find "$d" -depth -type d -exec rmdir {} \; && echo "removed cgroup $d"
done
left=$(awk -v r1={{ .Values.node.dataDir | quote }} -v r2={{ .Values.node.runDir | quote }} '($5 != r1 && index($5, r1 "/") == 1) || ($5 != r2 && index($5, r2 "/") == 1)' /proc/self/mountinfo | wc -l)
echo "mounts left: $left"
[ "$left" -eq 0 ]
{{- end -}}
