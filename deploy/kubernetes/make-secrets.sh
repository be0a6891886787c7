#!/usr/bin/env bash
# The Secrets deploy/kubernetes needs, as manifests on standard output, with development certificates
# from `ringq certs` (docs/security.md). For production, cert-manager (README.md beside this file).
#
#   deploy/kubernetes/make-secrets.sh [--nodes N] [--namespace NS] [--cluster-domain DOMAIN]
#       [--host NAME]... [--dir DIR] > ringq-secrets.yaml
#   kubectl apply -f ringq-secrets.yaml
#
# Secret                 keys                                what
# ringq-ca               ca.pem                              the cluster CA certificate; its key stays in DIR
# ringq-coordinator-tls  coordinator.pem, coordinator.key    DNS coordinator.ringq, which members check whatever
#                                                            address they dial, and the headless Service's name
# ringq-node-tls         node-ID.pem, node-ID.key            for ID = ringq-node-0 .. ringq-node-(N-1): DNS
#                                                            ID.node.ringq, the pod's names in the headless
#                                                            Service, the client Service's names, localhost,
#                                                            127.0.0.1 and every --host
# ringq-admin            username, password                  the administrator the coordinators make on the
#                                                            cluster's first start: $RINGQ_ADMIN_USER (default
#                                                            admin), $RINGQ_ADMIN_PASSWORD (default: random,
#                                                            made once and kept in DIR like the certificates)
#
# Every node pod mounts ringq-node-tls and reads its own pair. The certificates are made in DIR (default
# var/kubernetes/NS under the repository), which keeps them: running this again with more nodes adds
# theirs under the same CA, and changes nothing else. A certificate in DIR made for other names (another
# namespace, domain or --host) is refused, not reissued: delete it, or use another DIR.
#
# The `ringq` command is $RINGQ, else `ringq` on the PATH, else the repository's .venv/bin/ringq.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)

# Names in the manifests of this directory.
node_set="ringq-node"               # the node StatefulSet and its headless Service (node.yaml)
client_service="ringq"              # the client Service (node.yaml)
coordinator_set="ringq-coordinator" # the coordinator StatefulSet and its headless Service (coordinator.yaml)

nodes=3
namespace=ringq
domain=cluster.local
dir=
extra_hosts=()

usage() {
  echo "usage: make-secrets.sh [--nodes N] [--namespace NS] [--cluster-domain DOMAIN] [--host NAME]... [--dir DIR]" >&2
  exit 2
}
count() {
  [[ $2 =~ ^[1-9][0-9]{0,2}$ ]] || { echo "make-secrets.sh: $1 expects a number from 1 to 999, got '$2'" >&2; exit 2; }
}

while (($#)); do
  [[ $1 == -h || $1 == --help ]] && usage
  (($# >= 2)) || { echo "make-secrets.sh: $1 needs a value" >&2; usage; }
  case $1 in
    --nodes) count "$1" "$2"; nodes=$2 ;;
    --namespace) namespace=$2 ;;
    --cluster-domain) domain=$2 ;;
    --host) extra_hosts+=("$2") ;;
    --dir) dir=$2 ;;
    *) echo "make-secrets.sh: unknown argument '$1'" >&2; usage ;;
  esac
  shift 2
done
dns_label='^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'
[[ $namespace =~ $dns_label ]] || { echo "make-secrets.sh: '$namespace' is not a namespace name" >&2; exit 2; }
[[ $domain =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$ ]] || { echo "make-secrets.sh: '$domain' is not a DNS domain" >&2; exit 2; }
dir=${dir:-$top/var/kubernetes/$namespace}

ringq=${RINGQ:-}
if [[ -z $ringq ]]; then
  if command -v ringq >/dev/null 2>&1; then
    ringq=ringq
  elif [[ -x $top/.venv/bin/ringq ]]; then
    ringq=$top/.venv/bin/ringq
  else
    echo "make-secrets.sh: no ringq command: set RINGQ, or run 'make setup' first" >&2
    exit 2
  fi
fi

# Makes (or keeps) the certificate of KIND (node ID, or coordinator) in $dir for the names after it; a
# NAME.hosts file beside it records the names, so one made for other names is noticed.
issue() {
  local kind=$1 id=$2 stem=$3
  shift 3
  local hosts=("$@") wanted made=()
  wanted=$(printf '%s\n' "${hosts[@]}")
  if [[ -e $dir/$stem.pem ]]; then
    if [[ ! -f $dir/$stem.hosts || $(<"$dir/$stem.hosts") != "$wanted" ]]; then
      echo "make-secrets.sh: $dir/$stem.pem exists but was not made for these names:" >&2
      printf '  %s\n' "${hosts[@]}" >&2
      echo "delete $dir/$stem.pem, .key and .hosts to make it again, or give another --dir" >&2
      exit 1
    fi
    return
  fi
  local host
  for host in "${hosts[@]}"; do made+=(--host "$host"); done
  if [[ $kind == node ]]; then
    "$ringq" certs node --dir "$dir" --id "$id" "${made[@]}" >/dev/null
  else
    "$ringq" certs coordinator --dir "$dir" "${made[@]}" >/dev/null
  fi
  printf '%s\n' "$wanted" >"$dir/$stem.hosts"
}

mkdir -p "$dir"
chmod 700 "$dir"
"$ringq" certs ca --dir "$dir" >/dev/null

client_hosts=(
  "$client_service.$namespace.svc.$domain" "$client_service.$namespace.svc" "$client_service.$namespace"
  "$client_service" localhost 127.0.0.1 "${extra_hosts[@]}"
)
node_ids=()
for ((k = 0; k < nodes; k++)); do
  id=$node_set-$k
  node_ids+=("$id")
  issue node "$id" "node-$id" \
    "$id.$node_set.$namespace.svc.$domain" "$id.$node_set.$namespace.svc" "$id.$node_set.$namespace" \
    "$id.$node_set" "${client_hosts[@]}"
done
issue coordinator - coordinator "$coordinator_set.$namespace.svc.$domain" localhost 127.0.0.1

# The administrator: from the environment, else as made the first time (kept in DIR, so that running this
# again does not put another password in the Secret than the one the cluster started with).
admin_user=${RINGQ_ADMIN_USER:-}
[[ -n $admin_user || ! -f $dir/admin-user ]] || admin_user=$(<"$dir/admin-user")
admin_user=${admin_user:-admin}
admin_password=${RINGQ_ADMIN_PASSWORD:-}
random_password=
if [[ -z $admin_password && -f $dir/admin-password ]]; then
  admin_password=$(<"$dir/admin-password")
elif [[ -z $admin_password ]]; then
  admin_password=$(head -c 32 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
  admin_password=${admin_password:0:24}
  random_password=yes
fi
(
  umask 077
  printf '%s\n' "$admin_user" >"$dir/admin-user"
  printf '%s\n' "$admin_password" >"$dir/admin-password"
)

b64_file() { base64 <"$1" | tr -d '\n'; }
b64_text() { printf '%s' "$1" | base64 | tr -d '\n'; }
secret_header() {
  cat <<EOF
---
apiVersion: v1
kind: Secret
metadata:
  name: $1
  namespace: $namespace
  labels:
    app.kubernetes.io/name: ringq
    app.kubernetes.io/part-of: ringq
type: Opaque
data:
EOF
}

echo "# Made by deploy/kubernetes/make-secrets.sh; private keys and a password: keep this file out of git."
secret_header ringq-ca
echo "  ca.pem: $(b64_file "$dir/ca.pem")"
secret_header ringq-coordinator-tls
echo "  coordinator.pem: $(b64_file "$dir/coordinator.pem")"
echo "  coordinator.key: $(b64_file "$dir/coordinator.key")"
secret_header ringq-node-tls
for id in "${node_ids[@]}"; do
  echo "  node-$id.pem: $(b64_file "$dir/node-$id.pem")"
  echo "  node-$id.key: $(b64_file "$dir/node-$id.key")"
done
secret_header ringq-admin
echo "  username: $(b64_text "$admin_user")"
echo "  password: $(b64_text "$admin_password")"

{
  echo "make-secrets.sh: Secrets for $nodes node(s) in namespace $namespace;"
  echo "  certificates and the CA key in $dir"
  echo "  administrator $admin_user${random_password:+, a random password}: in $dir/admin-password, and"
  echo "  kubectl get secret -n $namespace ringq-admin -o jsonpath='{.data.password}' | base64 -d"
} >&2
