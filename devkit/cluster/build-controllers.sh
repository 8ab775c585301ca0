#!/usr/bin/env bash
# Build the workload controllers tests/controllers runs against the test control plane
# (Kueue, JobSet, Kubeflow Trainer v2, LeaderWorkerSet) from the Go module proxy into a versioned cache
# directory beside build.sh's; anything already built is skipped.
#
#   devkit/cluster/build-controllers.sh    # prints the directory holding them
#
# Each controller's binary lands in <dir>/<name>/ next to its manifests (CRDs, RBAC,
# webhook configurations, samples), copied from its module zip in the Go module cache:
# what a release's install.yaml is made from, at exactly the built version.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"

cache=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}
out=$cache/controllers-kueue${KUEUE_VERSION}-jobset${JOBSET_VERSION}-trainer${TRAINER_VERSION}-lws${LWS_VERSION}
mkdir -p "$out"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

# shellcheck source=lib.sh
. "$here/lib.sh"

module_dir() {  # module_dir MODULE@VERSION: its source, downloaded into the module cache
  go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}

# build DIR MODULE@VERSION PACKAGE LDFLAGS: build PACKAGE (relative to the module) inside a
# copy of the module, with exactly its go.mod and go.sum (-mod=readonly), into a scratch
# file renamed into DIR, so a controller running meanwhile from the cache is not disturbed.
# Not `go install PACKAGE@VERSION`: it asks the proxy for the module's version list (for
# deprecations), which the proxy here refuses for JobSet.
build() {
  local dir=$1 module=$2 package=$3 flags=$4 scratch="$out/.work/$1" name
  name=$(basename "$package"); [ "$package" != . ] && [ "$name" != cmd ] || name=$dir
  rm -rf "$scratch"; mkdir -p "$scratch" "$out/$dir"
  cp -r "$(module_dir "$module")" "$scratch/src"; chmod -R u+w "$scratch/src"
  ( cd "$scratch/src" && go build -mod=readonly -trimpath -ldflags "-s -w $flags" \
      -o "$scratch/$name" "./$package" )
  mv -f "$scratch/$name" "$out/$dir/$name"
}

# manifests DIR MODULE@VERSION SUBDIR...: copy what the release installs from its module.
manifests() {
  local dir=$1 module=$2 src sub; shift 2
  src=$(module_dir "$module")
  rm -rf "$out/$dir/manifests"; mkdir -p "$out/$dir/manifests"
  for sub in "$@"; do
    mkdir -p "$out/$dir/manifests/$(dirname "$sub")"
    cp -r "$src/$sub" "$out/$dir/manifests/$sub"
  done
  chmod -R u+w "$out/$dir/manifests"
}

version_flags() {  # version_flags PKG VERSION: the -X flags its Makefile sets
  echo "-X $1.GitVersion=v$2 -X $1.GitCommit=v$2"
}

build_kueue() {
  build kueue "sigs.k8s.io/kueue@v$KUEUE_VERSION" cmd/kueue \
    "$(version_flags sigs.k8s.io/kueue/pkg/version "$KUEUE_VERSION")"
  manifests kueue "sigs.k8s.io/kueue@v$KUEUE_VERSION" \
    config/components/crd/bases config/components/rbac config/components/webhook \
    config/components/manager
}

build_jobset() {  # JobSet's manager is its module's root package
  build jobset "sigs.k8s.io/jobset@v$JOBSET_VERSION" . \
    "$(version_flags sigs.k8s.io/jobset/pkg/version "$JOBSET_VERSION")"
  manifests jobset "sigs.k8s.io/jobset@v$JOBSET_VERSION" \
    config/components/crd/bases config/components/rbac config/components/webhook \
    config/components/manager
}

build_lws() {
  build lws "sigs.k8s.io/lws@v$LWS_VERSION" cmd \
    "$(version_flags sigs.k8s.io/lws/pkg/version "$LWS_VERSION")"
  manifests lws "sigs.k8s.io/lws@v$LWS_VERSION" \
    config/crd/bases config/rbac config/webhook config/manager
}

build_trainer() {
  build trainer "github.com/kubeflow/trainer/v2@v$TRAINER_VERSION" cmd/trainer-controller-manager ""
  manifests trainer "github.com/kubeflow/trainer/v2@v$TRAINER_VERSION" \
    manifests/base/crds manifests/base/rbac manifests/base/webhook manifests/base/manager \
    manifests/base/runtimes
}

have() { [ -x "$out/$1/$2" ] && [ -d "$out/$1/manifests" ]; }

start=$(date +%s)
have kueue kueue || step kueue "Kueue v$KUEUE_VERSION (about 5 minutes cold on 2 cores)" build_kueue
have jobset jobset || step jobset "JobSet v$JOBSET_VERSION" build_jobset
have trainer trainer-controller-manager || step trainer "Kubeflow Trainer v$TRAINER_VERSION" build_trainer
have lws lws || step lws "LeaderWorkerSet v$LWS_VERSION" build_lws
rm -rf "$out/.work"
log "controllers ready in $out ($(( $(date +%s) - start )) s)"
echo "$out"
