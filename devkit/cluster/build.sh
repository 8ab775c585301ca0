#!/usr/bin/env bash
# Build the real control plane from the Go module proxy into a versioned cache directory
# outside the repository; anything already built is skipped.
#
#   devkit/cluster/build.sh            # prints the directory holding the binaries
#   devkit/cluster/build.sh nodes      # the same for real nodes: kubelet, containerd, runc,
#                                     # the CNI plugins and a pause image's binary
#   devkit/cluster/build.sh helm [VERSION]  # the directory of helm HELM_VERSION (or VERSION)
#
# The control plane's build also builds helm HELM_VERSION and HELM3_VERSION, each in a
# directory of its own (the chart tests run both).
#
# K8S_RDZV_BINARIES=<dir> or KUBEBUILDER_ASSETS=<dir> pointing at prebuilt binaries skips
# the build for whatever they hold (envtest assets have etcd and kube-apiserver only).
# K8S_RDZV_VERSIONS=<file> reads the versions from that file instead of versions.env (the
# compatibility run, hack/compat.sh, builds other Kubernetes releases so).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "${K8S_RDZV_VERSIONS:-$here/versions.env}"

target=${1:-control-plane}
cache=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}
minor=$(cut -d. -f2 <<<"$KUBERNETES_VERSION")
helm_dir() {  # helm_dir VERSION: where that helm is built (helm 3 per Kubernetes minor)
  echo "$cache/helm$1-k8s1.$minor"
}
case "$target" in
  control-plane)
    out=$cache/bin-k8s${KUBERNETES_VERSION}-etcd${ETCD_VERSION}-kwok${KWOK_VERSION}
    # Its binaries were once kept with helm's, under a name that held helm's version too:
    # such a directory is used (linked), not built again, and stays for checkouts from then.
    if [ ! -e "$out" ]; then
      for old in "$out"-helm*/; do
        if [ -x "$old/kube-apiserver" ]; then ln -s "${old%/}" "$out"; break; fi
      done
    fi ;;
  nodes) out=$cache/nodes-k8s${KUBERNETES_VERSION}-containerd${CONTAINERD_VERSION}-runc${RUNC_VERSION}-cni${CNI_PLUGINS_VERSION} ;;
  helm) helm_version=${2:-$HELM_VERSION}; out=$(helm_dir "$helm_version") ;;
  *) echo "usage: $0 [control-plane|nodes|helm [VERSION]]" >&2; exit 2 ;;
esac
mkdir -p "$out"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

# shellcheck source=lib.sh
. "$here/lib.sh"

have() {  # have NAME: a usable binary is in the cache or in a prebuilt directory
  local name=$1 dir
  for dir in "${K8S_RDZV_BINARIES:-}" "${KUBEBUILDER_ASSETS:-}"; do
    if [ -n "$dir" ] && [ -x "$dir/$name" ] && [ ! -e "$out/$name" ]; then
      ln -sf "$dir/$name" "$out/$name"
    fi
  done
  [ -x "$out/$name" ]
}

wrapper() {  # wrapper NAME: a fresh throwaway module directory
  local dir="$out/.work/$1"
  rm -rf "$dir"; mkdir -p "$dir"; echo "$dir"
}

build_kubernetes() {  # build_kubernetes CMD...: k8s.io/kubernetes/cmd/<CMD> into $out
  local minor patch dir gomod ldflags pkg date cmd targets=()
  minor=$(cut -d. -f2 <<<"$KUBERNETES_VERSION"); patch=$(cut -d. -f3 <<<"$KUBERNETES_VERSION")
  dir=$(wrapper kubernetes); cd "$dir"
  go mod init local/k8s-rendezvous-kubernetes >/dev/null 2>&1
  gomod=$(go mod download -json "k8s.io/kubernetes@v$KUBERNETES_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with local
  # paths; replace lines of a dependency are ignored, so map each to its published tag.
  for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod" | sort -u); do
    go mod edit -replace="$m=$m@v0.$minor.$patch"
  done
  # The release's own godebug settings (its go.mod's godebug lines; default=go1.<minor-10>
  # held up to 1.35 only: 1.32 says go1.23, 1.37 go1.26, and a default newer than the
  # toolchain is an error).
  local godebug found=0
  while read -r godebug; do
    go mod edit -godebug="$godebug"; found=1
  done < <(awk '$1 == "godebug" && $2 ~ /=/ {print $2}' "$gomod")
  [ "$found" = 1 ] || go mod edit -godebug="default=go1.$((minor - 10))"
  go get "k8s.io/kubernetes@v$KUBERNETES_VERSION" >/dev/null 2>&1 || go get "k8s.io/kubernetes@v$KUBERNETES_VERSION"
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=v$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  for cmd in "$@"; do targets+=("k8s.io/kubernetes/cmd/$cmd"); done
  go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" -o "$out/" "${targets[@]}"
}

build_control_plane() { build_kubernetes kube-apiserver kube-controller-manager kube-scheduler kubectl; }
build_kubelet() { build_kubernetes kubelet; }

# runc needs cgo and libseccomp (the seccomp tag): without it a pod asking for the
# RuntimeDefault profile, as the chart's operator does, cannot start.
build_runc() {
  if ! pkg-config --exists libseccomp; then
    log "installing libseccomp-dev (Debian) for runc's seccomp support"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libseccomp-dev \
      || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libseccomp-dev; }
  fi
  CGO_ENABLED=1 GOBIN="$out" go install -trimpath -tags seccomp \
    -ldflags "-s -w -X main.version=$RUNC_VERSION" "github.com/opencontainers/runc@v$RUNC_VERSION"
}

build_containerd() {
  local cmd module=github.com/containerd/containerd/v2 pkgs=()
  for cmd in containerd ctr containerd-shim-runc-v2; do pkgs+=("$module/cmd/$cmd@v$CONTAINERD_VERSION"); done
  GOBIN="$out" go install -trimpath -tags no_btrfs,urfave_cli_no_docs \
    -ldflags "-s -w -X $module/version.Version=v$CONTAINERD_VERSION" "${pkgs[@]}"
}

build_cni() {
  local module=github.com/containernetworking/plugins
  mkdir -p "$out/cni"
  GOBIN="$out/cni" go install -trimpath -ldflags "-s -w" \
    "$module/plugins/main/bridge@v$CNI_PLUGINS_VERSION" \
    "$module/plugins/main/loopback@v$CNI_PLUGINS_VERSION" \
    "$module/plugins/ipam/host-local@v$CNI_PLUGINS_VERSION"
}

build_pause() {  # the pod sandbox's process: sleeps until told to stop
  go build -trimpath -ldflags "-s -w" -o "$out/pause" "$here/images/pause.go"
}

build_etcd() {
  local dir; dir=$(wrapper etcd); cd "$dir"
  go mod init local/k8s-rendezvous-etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
  GOBIN="$out" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
  # kwok's stage definitions ship in its module; keep them beside the binary.
  local src; src=$(go env GOMODCACHE)/sigs.k8s.io/kwok@v$KWOK_VERSION/kustomize/stage
  rm -rf "$out/kwok-stages"; cp -r "$src" "$out/kwok-stages"; chmod -R u+w "$out/kwok-stages"
}

# helm 3's Makefile sets the Kubernetes version it assumes without a cluster (helm template,
# helm lint; default 1.20, below the chart's kubeVersion) through these variables; here they
# name the pinned control plane's version. Helm 4 assumes that of the client-go it was built
# with, which no flag changes (4.3.2: 1.37). The stamp beside the binary records the flags,
# so that a cached helm built without them is rebuilt.
helm_module() {  # helm_module VERSION: helm.sh/helm/v3 or v4
  echo "helm.sh/helm/v${1%%.*}"
}

helm_ldflags() {  # helm_ldflags VERSION
  local module pkg flags
  module=$(helm_module "$1")
  flags="-s -w -X $module/internal/version.version=v$1"
  if [ "${1%%.*}" = 3 ]; then
    for pkg in "$module/pkg/chartutil" "$module/pkg/lint/rules"; do
      flags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
    done
  fi
  echo "$flags"
}

have_helm() {  # have_helm VERSION DIR: a cached build with today's flags, or (for
  # HELM_VERSION) a prebuilt one, taken as it is
  local dir
  if [ "$1" = "$HELM_VERSION" ]; then
    for dir in "${K8S_RDZV_BINARIES:-}" "${KUBEBUILDER_ASSETS:-}"; do
      if [ -n "$dir" ] && [ -x "$dir/helm" ] && [ ! -f "$2/helm.ldflags" ]; then
        ln -sf "$dir/helm" "$2/helm"; return 0
      fi
    done
  fi
  [ -x "$2/helm" ] && [ "$(cat "$2/helm.ldflags" 2>/dev/null)" = "$(helm_ldflags "$1")" ]
}

build_helm() {  # build_helm VERSION DIR
  local work="$2/.work"
  rm -rf "$work"; mkdir -p "$work"
  GOBIN="$work" go install -trimpath -ldflags "$(helm_ldflags "$1")" "$(helm_module "$1")/cmd/helm@v$1"
  rm -f "$2/helm"
  mv -f "$work/helm" "$2/helm"  # a rename: a helm running meanwhile is not disturbed
  helm_ldflags "$1" >"$2/helm.ldflags"
  rm -rf "$work"
}

ensure_helm() {  # ensure_helm VERSION: built (or found) in its directory, its log there
  local dir saved=$out lock; dir=$(helm_dir "$1"); mkdir -p "$dir"
  if [ "$dir" != "$out" ]; then  # lib.sh holds $out's lock; a second one would wait on it
    exec {lock}>"$dir/.build.lock"
    flock "$lock"
  fi
  if ! have_helm "$1" "$dir"; then
    helm_building=$1 helm_building_dir=$dir out=$dir
    step helm "helm v$1" build_pending_helm
    out=$saved
  fi
  if [ -n "${lock:-}" ]; then exec {lock}>&-; fi
}
build_pending_helm() { build_helm "$helm_building" "$helm_building_dir"; }

start=$(date +%s)
if [ "$target" = control-plane ]; then
  if ! { have kube-apiserver && have kube-controller-manager && have kube-scheduler && have kubectl; }; then
    step kubernetes "Kubernetes v$KUBERNETES_VERSION (5 min on 2 cores, 20 with Go's module cache cold)" build_control_plane
  fi
  have etcd || step etcd "etcd v$ETCD_VERSION" build_etcd
  { have kwok && [ -d "$out/kwok-stages" ]; } || step kwok "kwok v$KWOK_VERSION" build_kwok
  ensure_helm "$HELM_VERSION"
  ensure_helm "$HELM3_VERSION"
elif [ "$target" = helm ]; then
  ensure_helm "$helm_version"
else
  have kubelet || step kubelet "kubelet v$KUBERNETES_VERSION" build_kubelet
  have runc || step runc "runc v$RUNC_VERSION" build_runc
  { have containerd && have ctr && have containerd-shim-runc-v2; } || step containerd "containerd v$CONTAINERD_VERSION" build_containerd
  { [ -x "$out/cni/bridge" ] && [ -x "$out/cni/loopback" ] && [ -x "$out/cni/host-local" ]; } || step cni "CNI plugins v$CNI_PLUGINS_VERSION" build_cni
  have pause || step pause "pause" build_pause
fi
rm -rf "$out/.work"
log "binaries ready in $out ($(( $(date +%s) - start )) s)"
echo "$out"
