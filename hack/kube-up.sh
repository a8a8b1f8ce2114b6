#!/usr/bin/env bash
# A single-node Kubernetes cluster on this machine, the chart installed on
# it and its helm test run, then everything torn down (docs/kubernetes.md).
#
#   bash hack/kube-up.sh            build, start, install, test, tear down
#   CUBE_KUBE_KEEP=1 bash hack/kube-up.sh   leave the cluster running (KUBECONFIG printed)
#   CUBE_KUBE_IMAGES=DIR bash hack/kube-up.sh   use images built before (DIR/layout, DIR/values.yaml)
#   CUBE_KUBE_NODES=2 bash hack/kube-up.sh  add a second kubelet node in a network namespace
#   CUBE_KUBE_SDK=0 bash hack/kube-up.sh    skip the E2B SDK suite
#
# Kubernetes v1.34 is built from the Go module proxy (hack/kube/build.sh,
# cached in /var/cache/cube/kube), etcd and containerd are Debian's, the
# images are built here (hack/images) and imported with ctr: nothing is
# pulled. The control plane listens on loopback only; the node's pods use
# Debian's CNI bridge plugin on a private bridge.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
log() { echo "== kube-up: $*" >&2; }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0))s"; }

# Debian's etcd, containerd and CNI plugins (installed when missing).
pkgs=(etcd-server containerd containernetworking-plugins openssl iptables)
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

log "building Kubernetes and helm (cached)"
KBIN=$(bash hack/kube/build.sh)
log "binaries in $KBIN ($(elapsed))"

W=$(mktemp -d /tmp/cube-kube.XXXXXX)
NS=cube-system
REL=cube
# The optional second node (CUBE_KUBE_NODES=2): a kubelet and containerd in
# a network namespace, on the same bridge at .254 (node 1's pods take
# addresses up to .200), its pods in a /24 of their own routed through it.
N2_NETNS=cube-kube-n2 N2_IP=172.30.0.254 N2_POD_CIDR=172.30.1.0/24
pids=()
ctl=() kubelets=() # controllers and kubelets: stopped first in the teardown
cleanup() {
  local rc=$?
  set +e # every step of the teardown runs, whatever one of them says
  if [ "${CUBE_KUBE_KEEP:-0}" = 1 ]; then
    log "kept: export KUBECONFIG=$W/admin.kubeconfig; tear down with: kill ${pids[*]}"
    return
  fi
  log "tearing down"
  if [ -S "$W/containerd.sock" ]; then
    # The chart's uninstall (no sandbox may outlive it), then every pod.
    [ -f "$W/installed" ] && "$KBIN/helm" --kubeconfig "$W/admin.kubeconfig" uninstall "$REL" -n "$NS" --wait --timeout 2m >&2 || true
    # No controller recreates a pod from here on (a Job's, a failed
    # install's), then pods deleted through the kubelets, so that their
    # sandboxes and network namespaces are released (CNI DEL), then the
    # kubelets stopped before what is left is killed (none starts another).
    for p in "${ctl[@]}"; do kill "$p" 2>/dev/null; done
    "$KBIN/kubectl" --kubeconfig "$W/admin.kubeconfig" delete pods --all -A --grace-period=0 --force --wait=false >/dev/null 2>&1
    for _ in $(seq 30); do
      [ -z "$("$KBIN/kubectl" --kubeconfig "$W/admin.kubeconfig" get pods -A -o name 2>/dev/null)" ] && break
      sleep 1
    done
    for p in "${kubelets[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${kubelets[@]}"; do for _ in $(seq 10); do kill -0 "$p" 2>/dev/null || break; sleep 1; done; done
    for sock in "$W/containerd.sock" "$W/n2/containerd.sock"; do
      [ -S "$sock" ] || continue
      for c in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
        ctr -a "$sock" -n k8s.io tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true
      done
      sleep 1
      for c in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
        ctr -a "$sock" -n k8s.io tasks rm -f "$c" >/dev/null 2>&1 || true
      done
    done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done
  # The API server may take a minute to shut down gracefully: 10 s, then KILL.
  for _ in $(seq 10); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 1
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null || true; done
  # The node's host rules and slots (network-agent --purge with the
  # chart's settings of ci/kube-up.yaml), then every mount under the work
  # directory and the node's paths, their loop devices, the cgroups.
  printf 'node_cidr = "10.213.0.0/16"\nprefix = "ckube"\nrun_dir = "/run/cube-kube/network"\ndata_dir = "/var/lib/cube-kube/network"\n[api]\nsocket = "/run/cube-kube/network-agent.sock"\n' > "$W/na-purge.toml"
  [ -d /var/lib/cube-kube/network ] && go run ./cmd/network-agent --purge --config "$W/na-purge.toml" >&2 || true
  for root in "$W" /var/lib/cube-kube /run/cube-kube; do
    grep " $root" /proc/self/mountinfo | awk '{print $5}' | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  done
  losetup -a 2>/dev/null | grep /var/lib/cube-kube | cut -d: -f1 | while read -r d; do losetup -d "$d" 2>/dev/null || true; done
  rm -rf /var/lib/cube-kube /run/cube-kube
  find /sys/fs/cgroup -depth -type d -name cube-kube -exec rmdir {} \; 2>/dev/null || true
  find /sys/fs/cgroup -depth -type d -path '*/cube-kube-n2*' -exec rmdir {} \; 2>/dev/null || true
  # The first kubelet's pod cgroups (its cgroup root is the hierarchies' own).
  for d in $(find /sys/fs/cgroup -maxdepth 2 -type d -name kubepods 2>/dev/null); do
    find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  ip link del cube-kube0 2>/dev/null || true
  # The second node: its network namespace (its veth and bridge with it).
  ip route del "$N2_POD_CIDR" 2>/dev/null || true
  ip netns del "$N2_NETNS" 2>/dev/null || true
  ip link del ckn2-h 2>/dev/null || true
  # Network namespaces and CNI results a pod left (those made since start).
  for n in $(ls /run/netns 2>/dev/null | grep '^cni-'); do
    grep -qx "$n" "$W/netns-before" 2>/dev/null || ip netns del "$n" 2>/dev/null
  done
  rm -f /var/lib/cni/results/cube-kube-*
  [ $rc = 0 ] || { log "failed ($(elapsed)); logs:"; tail -n 30 "$W"/*.log >&2 || true; }
  rm -rf "$W"
  exit $rc
}
trap cleanup EXIT

# Ports of their own, so as not to meet a system instance. The API server
# listens on the node's address on the pods' bridge (a host-local
# address): pods reach it there (no kube-proxy for the kubernetes Service).
ETCD=127.0.0.1:23790 API=172.30.0.1:16443
SVC_CIDR=172.30.128.0/24 POD_CIDR=172.30.0.0/24 CLUSTER_IP=172.30.128.1
# The node's address on the pods' bridge: the kubelet's node IP (so that
# pods reach the host-network node pod), the cluster DNS.
NODE_IP=172.30.0.1
ls /run/netns 2>/dev/null | grep '^cni-' > "$W/netns-before" || true
ip link add cube-kube0 type bridge
ip addr add "$NODE_IP/24" dev cube-kube0
ip link set cube-kube0 up
# The node pod's host paths with Bidirectional propagation must be shared
# mounts: each becomes a shared bind mount of itself (the root stays as it is).
for d in /var/lib/cube-kube /run/cube-kube; do
  mkdir -p "$d"
  mount --bind "$d" "$d"
  mount --make-rshared "$d"
done

log "images"
guest=/var/lib/cube/vm; [ -f "$guest/vmlinuz" ] || guest=/var/cache/cube/vm/guest-cubelet
if [ -n "${CUBE_KUBE_IMAGES:-}" ]; then
  # Images built before (go run ./hack/images --out DIR/layout --values DIR/values.yaml).
  cp -r "$CUBE_KUBE_IMAGES/layout" "$W/images"
  cp "$CUBE_KUBE_IMAGES/values.yaml" "$W/images.yaml"
else
  go run ./hack/images --out "$W/images" --values "$W/images.yaml" --guest-dir "$guest" 2>"$W/images.log"
  sed -n 's/.*msg=image name=\([^ ]*\) .*compressed_mib=\([0-9.]*\).*/   \1 \2 MiB compressed/p' "$W/images.log" >&2
fi
log "images built ($(elapsed)): $(du -sh "$W/images" | cut -f1) layout"

log "certificates"
mkdir -p "$W/pki"
(
  cd "$W/pki"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.crt -days 2 -subj "/CN=cube-kube-ca" 2>/dev/null
  issue() { # name subject sans [ca]
    local ca=${4:-ca}
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA "$ca.crt" -CAkey "$ca.key" -CAcreateserial -out "$1.crt" -days 2 -extfile "$1.ext" 2>/dev/null
  }
  issue apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:${API%:*},IP:$CLUSTER_IP,DNS:kubernetes,DNS:kubernetes.default.svc"
  issue admin "/O=system:masters/CN=admin" "DNS:admin"
  issue kubelet "/O=system:nodes/CN=system:node:$(hostname)" "IP:127.0.0.1,IP:$NODE_IP,DNS:$(hostname)"
  # cube's cluster CA (pki.existingSecret; ECDSA P-256, SEC1 key as cube's
  # pki package reads it), and the sandbox route's certificate from it
  # (proxy.tls.mode secret): helm test reaches cubeproxy at its Service's
  # name, the SDK suite through a port-forward on 127.0.0.1.
  openssl ecparam -name prime256v1 -genkey -noout -out cube-ca.key 2>/dev/null
  openssl req -x509 -new -key cube-ca.key -out cube-ca.crt -days 2 -subj "/CN=cube-kube cluster CA" 2>/dev/null
  issue route "/CN=cube-route" "DNS:*.sandbox.cube.local,DNS:sandbox.cube.local,DNS:cube-proxy.cube-system.svc,DNS:cube-proxy,IP:127.0.0.1" cube-ca
  openssl ecparam -name prime256v1 -genkey -noout -out sa.key 2>/dev/null
  openssl ec -in sa.key -pubout -out sa.pub 2>/dev/null
)
kcfg() { # file cert
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: cube, cluster: {server: "https://$API", certificate-authority: "$W/pki/ca.crt"}}]
users: [{name: u, user: {client-certificate: "$W/pki/$2.crt", client-key: "$W/pki/$2.key"}}]
contexts: [{name: c, context: {cluster: cube, user: u}}]
current-context: c
EOF
}
kcfg "$W/admin.kubeconfig" admin
kcfg "$W/kubelet.kubeconfig" kubelet
export KUBECONFIG="$W/admin.kubeconfig"
K="$KBIN/kubectl"

log "etcd"
etcd --name cube --data-dir "$W/etcd" --listen-client-urls "http://$ETCD" --advertise-client-urls "http://$ETCD" \
  --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
  --initial-cluster cube=http://127.0.0.1:23800 >"$W/etcd.log" 2>&1 &
pids+=($!)

log "kube-apiserver"
"$KBIN/kube-apiserver" --etcd-servers "http://$ETCD" --bind-address "${API%:*}" --secure-port "${API#*:}" \
  --advertise-address "${API%:*}" --service-cluster-ip-range "$SVC_CIDR" \
  --tls-cert-file "$W/pki/apiserver.crt" --tls-private-key-file "$W/pki/apiserver.key" --client-ca-file "$W/pki/ca.crt" \
  --service-account-key-file "$W/pki/sa.pub" --service-account-signing-key-file "$W/pki/sa.key" \
  --service-account-issuer https://kubernetes.default.svc --authorization-mode Node,RBAC \
  --kubelet-client-certificate "$W/pki/admin.crt" --kubelet-client-key "$W/pki/admin.key" \
  --kubelet-preferred-address-types InternalIP --allow-privileged >"$W/apiserver.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do "$K" get --raw /readyz >/dev/null 2>&1 && break; sleep 1; done
"$K" get --raw /readyz >/dev/null
log "apiserver ready ($(elapsed))"

"$KBIN/kube-controller-manager" --kubeconfig "$W/admin.kubeconfig" --bind-address 127.0.0.1 --secure-port 0 \
  --service-account-private-key-file "$W/pki/sa.key" --root-ca-file "$W/pki/ca.crt" --use-service-account-credentials=false \
  --cluster-signing-cert-file "$W/pki/ca.crt" --cluster-signing-key-file "$W/pki/ca.key" \
  --controllers '*,-nodeipam,-cloud-node-lifecycle' >"$W/controller-manager.log" 2>&1 &
pids+=($!)
ctl+=($!)
# Cluster DNS: Services' ready endpoints (hack/kube/dns; no CoreDNS, no
# kube-proxy: names resolve to the pods, as headless Services do).
go build -C hack/kube -o "$W/dns" ./dns
"$W/dns" --kubeconfig "$W/admin.kubeconfig" --listen "$NODE_IP:53" >"$W/dns.log" 2>&1 &
pids+=($!)
"$KBIN/kube-scheduler" --kubeconfig "$W/admin.kubeconfig" --bind-address 127.0.0.1 --secure-port 0 >"$W/scheduler.log" 2>&1 &
pids+=($!)
ctl+=($!)

log "containerd"
mkdir -p "$W/containerd" "$W/cni/net.d"
cat > "$W/containerd.toml" <<EOF
version = 2
root = "$W/containerd/root"
state = "$W/containerd/state"
[grpc]
  address = "$W/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  # These machines lack CAP_SYS_RESOURCE: runc cannot raise the pause
  # container's oom_score_adj.
  restrict_oom_score_adj = true
  sandbox_image = "docker.io/cube/pause:0.1.0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$W/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = false
EOF
# A default route through the bridge in every pod: the second node's pods
# are off-link (172.30.1.0/24, routed by the host).
cat > "$W/cni/net.d/10-cube-kube.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "cube-kube", "plugins": [
  {"type": "bridge", "bridge": "cube-kube0", "isGateway": true, "isDefaultGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "rangeEnd": "172.30.0.200"}]], "dataDir": "$W/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
# import_images LAYOUT: every image of an OCI layout into containerd, named
# by tag and, as the chart pins digests, by digest too (the kubelet asks
# containerd for repository@digest).
import_images() {
  tar -C "$1" -cf "$1.tar" .
  ctr -a "$W/containerd.sock" -n k8s.io images import --all-platforms "$1.tar" >>"$W/import.log"
  rm -f "$1.tar"
  for n in $(ctr -a "$W/containerd.sock" -n k8s.io images ls -q | grep '^docker.io/cube/.*:'); do
    d=$(ctr -a "$W/containerd.sock" -n k8s.io images ls | awk -v n="$n" '$1==n{print $3}')
    ctr -a "$W/containerd.sock" -n k8s.io images tag --force "$n" "${n%:*}@$d" >/dev/null
  done
}
containerd --config "$W/containerd.toml" >"$W/containerd.log" 2>&1 &
pids+=($!)
for _ in $(seq 30); do [ -S "$W/containerd.sock" ] && break; sleep 1; done
import_images "$W/images"
log "images imported: $(ctr -a "$W/containerd.sock" -n k8s.io images ls -q | grep -c cube/) ($(elapsed))"

log "kubelet"
cat > "$W/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
authentication: {anonymous: {enabled: false}, x509: {clientCAFile: "$W/pki/ca.crt"}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
address: "$NODE_IP"
port: 10350
readOnlyPort: 0
healthzPort: 0
tlsCertFile: "$W/pki/kubelet.crt"
tlsPrivateKeyFile: "$W/pki/kubelet.key"
containerRuntimeEndpoint: "unix://$W/containerd.sock"
staticPodPath: ""
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
resolvConf: /etc/resolv.conf
podLogsDir: "$W/pod-logs"
clusterDNS: ["$NODE_IP"]
clusterDomain: cluster.local
EOF
"$KBIN/kubelet" --config "$W/kubelet.yaml" --kubeconfig "$W/kubelet.kubeconfig" --root-dir "$W/kubelet" \
  --hostname-override "$(hostname)" --node-ip "$NODE_IP" >"$W/kubelet.log" 2>&1 &
pids+=($!)
kubelets+=($!)
NODE=$(hostname)
for _ in $(seq 120); do "$K" get node "$NODE" >/dev/null 2>&1 && break; sleep 1; done
"$K" wait --for=condition=Ready "node/$NODE" --timeout=180s >&2
log "node $NODE Ready ($(elapsed))"
"$K" label node "$NODE" cube.dev/node=true --overwrite >/dev/null

if [ "${CUBE_KUBE_NODES:-1}" = 2 ]; then
  # A second node: kubelet and containerd in a network namespace of their
  # own (nsenter --net: the host's mounts and cgroups, under a cgroup root
  # of its own), the pause image copied from the first node's containerd.
  # It is not labelled cube.dev/node: both nodes share this host's paths
  # (node.dataDir, /run/netns, cgroups), so a second cube-node pod here
  # would share the first one's state. A pod on it reaches the E2B API on
  # the first node across the two nodes' pod networks.
  NODE2="$(hostname)-n2"
  log "second node $NODE2 in network namespace $N2_NETNS"
  mkdir -p "$W/n2/cni/net.d"
  ip netns add "$N2_NETNS"
  ip link add ckn2-h type veth peer name ckn2-n
  ip link set ckn2-h master cube-kube0 up
  ip link set ckn2-n netns "$N2_NETNS"
  ip -n "$N2_NETNS" addr add "$N2_IP/24" dev ckn2-n
  ip -n "$N2_NETNS" link set lo up
  ip -n "$N2_NETNS" link set ckn2-n up
  ip -n "$N2_NETNS" route add default via "$NODE_IP"
  ip netns exec "$N2_NETNS" sysctl -qw net.ipv4.ip_forward=1
  sysctl -qw net.ipv4.ip_forward=1
  ip route add "$N2_POD_CIDR" via "$N2_IP"
  (
    cd "$W/pki"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout kubelet2.key -out kubelet2.csr -subj "/O=system:nodes/CN=system:node:$NODE2" 2>/dev/null
    printf 'subjectAltName=IP:%s,DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$N2_IP" "$NODE2" > kubelet2.ext
    openssl x509 -req -in kubelet2.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet2.crt -days 2 -extfile kubelet2.ext 2>/dev/null
  )
  kcfg "$W/kubelet2.kubeconfig" kubelet2
  sed -e "s#$W/containerd/#$W/n2/containerd/#; s#$W/containerd.sock#$W/n2/containerd.sock#; s#$W/cni/net.d#$W/n2/cni/net.d#" \
    "$W/containerd.toml" > "$W/n2/containerd.toml"
  printf '%s\n' '{"cniVersion": "1.0.0", "name": "cube-kube", "plugins": [' \
    '  {"type": "bridge", "bridge": "cube-kn2", "isGateway": true, "isDefaultGateway": true, "ipMasq": false,' \
    "   \"ipam\": {\"type\": \"host-local\", \"ranges\": [[{\"subnet\": \"$N2_POD_CIDR\"}]], \"dataDir\": \"$W/n2/cni/ipam\"}}," \
    '  {"type": "portmap", "capabilities": {"portMappings": true}}]}' > "$W/n2/cni/net.d/10-cube-kube.conflist"
  nsenter --net="/run/netns/$N2_NETNS" containerd --config "$W/n2/containerd.toml" >"$W/containerd2.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 30); do [ -S "$W/n2/containerd.sock" ] && break; sleep 1; done
  ctr -a "$W/containerd.sock" -n k8s.io images export "$W/n2/pause.tar" docker.io/cube/pause:0.1.0
  ctr -a "$W/n2/containerd.sock" -n k8s.io images import "$W/n2/pause.tar" >/dev/null
  sed -e "s#^address: .*#address: \"$N2_IP\"#; s#^port: .*#port: 10351#; s#$W/pki/kubelet\.#$W/pki/kubelet2.#g" \
    -e "s#$W/containerd.sock#$W/n2/containerd.sock#; s#$W/pod-logs#$W/n2/pod-logs#" "$W/kubelet.yaml" > "$W/n2/kubelet.yaml"
  # Its pods' cgroups under a root of their own (the kubelet wants it made).
  echo "cgroupRoot: /cube-kube-n2" >> "$W/n2/kubelet.yaml"
  for d in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do [ -f "$d/cgroup.procs" ] && mkdir -p "$d/cube-kube-n2"; done
  nsenter --net="/run/netns/$N2_NETNS" "$KBIN/kubelet" --config "$W/n2/kubelet.yaml" --kubeconfig "$W/kubelet2.kubeconfig" \
    --root-dir "$W/n2/kubelet" --hostname-override "$NODE2" --node-ip "$N2_IP" >"$W/kubelet2.log" 2>&1 &
  pids+=($!)
  kubelets+=($!)
  for _ in $(seq 120); do "$K" get node "$NODE2" >/dev/null 2>&1 && break; sleep 1; done
  "$K" wait --for=condition=Ready "node/$NODE2" --timeout=180s >&2
  # Its containerd holds only the pause image: the scheduler places
  # nothing there (the probe below names the node).
  "$K" taint node "$NODE2" cube.dev/second-node=true:NoSchedule >/dev/null
  log "node $NODE2 Ready ($(elapsed))"
fi

log "helm install"
"$K" create namespace "$NS" >/dev/null
"$K" -n "$NS" create secret generic cube-cluster-pki --from-file=ca.crt="$W/pki/cube-ca.crt" --from-file=ca.key="$W/pki/cube-ca.key" \
  --from-literal=admin-token="$(openssl rand -hex 20)" >/dev/null
"$K" -n "$NS" create secret tls cube-route-tls --cert "$W/pki/route.crt" --key "$W/pki/route.key" >/dev/null
t_install=$(date +%s)
touch "$W/installed"
"$KBIN/helm" install "$REL" deploy/helm/cube -n "$NS" -f deploy/helm/cube/ci/kube-up.yaml -f "$W/images.yaml" \
  --wait --timeout 8m >&2
log "helm install: every pod ready in $(($(date +%s) - t_install))s"
"$K" -n "$NS" get pods -o wide >&2

if [ "${CUBE_KUBE_NODES:-1}" = 2 ]; then
  # Across the nodes: a pod on the second node reaches the E2B API of a
  # master pod on the first, at its pod IP (busybox-static resolves no
  # names: glibc without NSS), plain HTTP to its TLS port answered 400 by
  # the API's server (busybox has no TLS client that speaks to it); the
  # node DaemonSet stays on the nodes labelled for it.
  mip2=$("$K" -n "$NS" get pod -l app.kubernetes.io/component=master -o jsonpath='{.items[0].status.podIP}')
  "$K" run n2-probe --image=docker.io/cube/pause:0.1.0 --image-pull-policy=Never --restart=Never \
    --overrides="{\"apiVersion\": \"v1\", \"spec\": {\"nodeName\": \"$NODE2\"}}" --command -- \
    /bin/busybox sh -c "out=\$(printf 'GET /health HTTP/1.0\\r\\n\\r\\n' | nc -w 10 $mip2 3000 2>&1); case \"\$out\" in *'400 Bad Request'*) echo a cube-master pod at $mip2:3000 answered from \$(hostname -i);; *) echo \"\$out\"; exit 1;; esac" >/dev/null
  "$K" wait --for=jsonpath='{.status.phase}'=Succeeded pod/n2-probe --timeout=120s >&2 || { "$K" logs n2-probe >&2; exit 1; }
  log "second node: $("$K" logs n2-probe); cube-node pods on: $("$K" -n "$NS" get pod -l app.kubernetes.io/component=node -o jsonpath='{.items[*].spec.nodeName}')"
  "$K" delete pod n2-probe --wait=false >/dev/null
fi

# Nodes hold no CA key: each joined through the master's join issuer. It
# refuses a token of another service account and the node pods' token
# asking for another node; control: the node pods' own token for its node
# gets a join token.
log "join issuer"
"$K" -n "$NS" get ds cube-node -o json | grep -q '"ca.key"' && { log "the node DaemonSet mounts the CA key"; exit 1; }
npod=$("$K" -n "$NS" get pod -l app.kubernetes.io/component=node -o jsonpath='{.items[0].metadata.name}')
mip=$("$K" -n "$NS" get pod -l app.kubernetes.io/component=master -o jsonpath='{.items[0].status.podIP}')
cp "$W/pki/cube-ca.crt" "$W/cube-ca.pem"
issue_for() { # token node: the issuer's HTTP status
  curl -s -o /dev/null -w '%{http_code}' --cacert "$W/cube-ca.pem" -H "Authorization: Bearer $1" \
    -d "{\"node\": \"$2\"}" "https://$mip:8091/v1/join-token"
}
other=$("$K" -n "$NS" create token default --audience cube-join)
own=$("$K" -n "$NS" create token cube-node --audience cube-join --bound-object-kind Pod --bound-object-name "$npod")
a1=$(issue_for "$other" "$NODE") a2=$(issue_for "$own" not-this-node) c1=$(issue_for "$own" "$NODE")
log "join issuer: another service account's token $a1, the node token for another node $a2; control: the node token for its node $c1"
[ "$a1" = 403 ] && [ "$a2" = 403 ] && [ "$c1" = 200 ] || exit 1

# One egress CA for the cluster: the master's (a Secret the chart makes,
# mounted beside the cluster CA) reaches the node at its join, and the
# node's network-agent terminates TLS under it; the node DaemonSet never
# mounts it.
"$K" -n "$NS" get ds cube-node -o json | grep -q 'egress-ca' && { log "the node DaemonSet mounts the egress CA"; exit 1; }
want=$("$K" -n "$NS" get secret "$REL-egress-ca" -o jsonpath='{.data.egress-ca\.pem}' | base64 -d | openssl x509 -noout -fingerprint -sha256)
got=$(openssl x509 -noout -fingerprint -sha256 -in /var/lib/cube-kube/pki/egress/egress-ca.pem 2>&1 || true)
log "egress CA: the cluster's ${want#*=}, the node's ${got#*=}"
[ -n "$want" ] && [ "$want" = "$got" ] || { log "the node's egress CA is not the cluster's"; exit 1; }

log "helm test"
t_test=$(date +%s)
"$KBIN/helm" test "$REL" -n "$NS" --logs --timeout 6m >&2
log "helm test passed in $(($(date +%s) - t_test))s; install to first sandbox: $(($(date +%s) - t_install))s"
# Adoption: a sandbox made on the node survives the node pod's deletion
# and is adopted by the new pod's cubelet (same sandbox, still running, its
# init process the same host PID).
go build -o "$W/cubecli" ./cmd/cubecli
CLI=("$W/cubecli" --addr /run/cube-kube/cubelet.sock)
"${CLI[@]}" sandbox create --template busybox --id kube-adopt >&2
pid_of() { "${CLI[@]}" -o json sandbox inspect kube-adopt | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -1; }
before=$(pid_of)
old=$("$K" -n "$NS" get pod -l app.kubernetes.io/component=node -o jsonpath='{.items[0].metadata.name}')
t_del=$(date +%s)
"$K" -n "$NS" delete pod "$old" --wait >&2
"$K" -n "$NS" rollout status ds/cube-node --timeout=5m >&2
state=$("${CLI[@]}" -o json sandbox inspect kube-adopt | sed -n 's/.*"state": *"\([A-Z_]*\)".*/\1/p' | head -1)
after=$(pid_of)
log "node pod $old replaced in $(($(date +%s) - t_del))s; sandbox kube-adopt: $state, pid $before -> $after"
[ "$state" = SANDBOX_STATE_RUNNING ] && [ -n "$before" ] && [ "$before" = "$after" ] || { log "sandbox not adopted"; exit 1; }
# helm upgrade to a new image digest: the cubelet and installer images
# rebuilt with a changed input (a label), so their digests change and the
# DaemonSet rolls; the sandbox stays, adopted by the upgraded cubelet, and
# keeps the cube-agent of the version it started under.
log "helm upgrade: cubelet and installer rebuilt with a changed label"
t_up=$(date +%s)
go run ./hack/images --only cubelet,installer --label "dev.cube.rebuild=$t_up" --out "$W/images2" \
  --values "$W/images2.yaml" --guest-dir "$guest" 2>"$W/images2.log"
import_images "$W/images2"
img_of() { "$K" -n "$NS" get ds cube-node -o jsonpath='{.spec.template.spec.containers[?(@.name=="cubelet")].image}'; }
img_before=$(img_of)
t_up=$(date +%s)
"$KBIN/helm" upgrade "$REL" deploy/helm/cube -n "$NS" -f deploy/helm/cube/ci/kube-up.yaml -f "$W/images.yaml" -f "$W/images2.yaml" \
  --wait --timeout 5m >&2
"$K" -n "$NS" rollout status ds/cube-node --timeout=5m >&2
img_after=$(img_of)
running=$("$K" -n "$NS" get pod -l app.kubernetes.io/component=node -o jsonpath='{.items[*].spec.containers[?(@.name=="cubelet")].image}')
state=$("${CLI[@]}" -o json sandbox inspect kube-adopt | sed -n 's/.*"state": *"\([A-Z_]*\)".*/\1/p' | head -1)
upgraded=$(pid_of)
log "helm upgrade in $(($(date +%s) - t_up))s: cubelet ${img_before##*@} -> ${img_after##*@}; sandbox kube-adopt: $state, pid $before -> $upgraded"
[ "$img_before" != "$img_after" ] && [ "$running" = "$img_after" ] || { log "the node pod does not run the new digest ($running)"; exit 1; }
[ "$state" = SANDBOX_STATE_RUNNING ] && [ "$before" = "$upgraded" ] || { log "sandbox not kept across the upgrade"; exit 1; }
kill -0 "$before" 2>/dev/null || { log "the sandbox's process $before is gone"; exit 1; }

# The unmodified E2B JS SDK suite (test:controlplane: the control-plane and
# tenancy specs cube up's system runs) against the chart's Services,
# reached through kubectl port-forward; the route's certificate is the
# cube-route-tls Secret, the E2B API's one of the cluster CA.
if [ "${CUBE_KUBE_SDK:-1}" != 0 ]; then
  log "E2B SDK suite through the Services"
  t_sdk=$(date +%s)
  npm ci --prefix test/e2e/node --no-audit --no-fund --loglevel=error >&2
  cp "$W/pki/cube-ca.crt" "$W/sdk-ca.pem"
  forward() { # service port file: a port-forward on a free loopback port
    "$K" -n "$NS" port-forward "svc/$1" ":$2" --address 127.0.0.1 >"$3" 2>&1 &
    pids+=($!)
    for _ in $(seq 30); do grep -q '^Forwarding from' "$3" && break; sleep 1; done
    sed -n 's/^Forwarding from 127.0.0.1:\([0-9]*\).*/\1/p' "$3" | head -1
  }
  api_port=$(forward cube-master 3000 "$W/pf-master.log")
  route_port=$(forward cube-proxy 8081 "$W/pf-proxy.log")
  [ -n "$api_port" ] && [ -n "$route_port" ] || { log "port-forward failed"; cat "$W"/pf-*.log >&2; exit 1; }
  mc() { "$K" -n "$NS" exec deploy/cube-master -c cubemaster -- cubecli --master /run/cube/cubemaster.sock "$@"; }
  key=$(mc apikey create "sdk-$t_sdk")
  for t in e2e-a e2e-b; do mc team create "$t" >/dev/null; done
  mc team create e2e-quota --max-sandboxes 1 >/dev/null
  rc_sdk=0
  E2B_API_URL="https://127.0.0.1:$api_port" E2B_SANDBOX_URL="https://127.0.0.1:$route_port" E2B_API_KEY="$key" \
    E2B_DOMAIN=sandbox.cube.local CUBE_E2E_TEMPLATE=busybox CUBE_E2E_RUNTIME=runc NODE_EXTRA_CA_CERTS="$W/sdk-ca.pem" \
    CUBE_E2E_TEAM_A_KEY="$(mc apikey create "a-$t_sdk" --team e2e-a)" \
    CUBE_E2E_TEAM_B_KEY="$(mc apikey create "b-$t_sdk" --team e2e-b)" \
    CUBE_E2E_QUOTA_KEY="$(mc apikey create "q-$t_sdk" --team e2e-quota)" \
    npm --prefix test/e2e/node run test:controlplane >"$W/sdk.log" 2>&1 || rc_sdk=$?
  grep -E '^(✔|✖)|ℹ (tests|pass|fail|skipped)|LATENCY|SNAPSHOTS' "$W/sdk.log" >&2 || true
  [ $rc_sdk = 0 ] || { log "E2B SDK suite failed:"; tail -n 80 "$W/sdk.log" >&2; exit 1; }
  log "E2B SDK suite passed in $(($(date +%s) - t_sdk))s"
fi

# helm uninstall: its pre-delete hook destroys every sandbox (kube-adopt
# still runs) and purges the node. Checked on the host before the
# teardown's own sweep: no sandbox process, mount or loop device under the
# node's paths, no link or nft table of network-agent's prefix, no cgroup.
log "helm uninstall"
t_un=$(date +%s)
rm -f "$W/installed"
# The hook Job's log (deleted with the Job when it succeeds), as it runs.
( for _ in $(seq 60); do "$K" -n "$NS" logs -f job/cube-uninstall 2>/dev/null && break; sleep 1; done ) >"$W/uninstall-hook.log" &
hooklog=$!
"$KBIN/helm" uninstall "$REL" -n "$NS" --wait --timeout 5m >&2
wait "$hooklog" || true
sed 's/^/   hook: /' "$W/uninstall-hook.log" >&2
"$KBIN/helm" history "$REL" -n "$NS" >/dev/null 2>&1 && { log "release still there"; exit 1; }
left=""
kill -0 "$before" 2>/dev/null && left+=" sandbox-process:$before"
left+=$(awk '$5 ~ "^/(var/lib|run)/cube-kube/" {printf " mount:%s", $5}' /proc/self/mountinfo)
for f in /sys/block/loop*/loop/backing_file; do
  [ -e "$f" ] && grep -q '^/var/lib/cube-kube/' "$f" && left+=" loop:$(cat "$f")"
done
left+=$(ip -o link show | awk -F': ' '$2 ~ /^ckube-/ {printf " link:%s", $2}')
left+=$(nft list tables 2>/dev/null | awk '$3 == "ckube" {printf " nft:%s", $2}')
left+=$(find /sys/fs/cgroup -maxdepth 2 -type d -name cube-kube -printf ' cgroup:%p' 2>/dev/null)
log "helm uninstall in $(($(date +%s) - t_un))s; left on the host:${left:- nothing}"
[ -z "$left" ] || exit 1
log "done ($(elapsed))"
