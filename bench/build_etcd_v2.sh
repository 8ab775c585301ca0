#!/usr/bin/env bash
# Build etcd 3.5 (the last release line with the v2 API, served with --enable-v2) from the
# Go module proxy in a throwaway wrapper module, for torch's etcd-v2 rendezvous baseline.
# Prints the path of the binary; a no-op when it is cached.
#
#   bench/build_etcd_v2.sh
set -euo pipefail
version=${ETCD_V2_VERSION:-3.5.35}
out=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}/etcd-v2-$version
bin="$out/etcd"
if [ ! -x "$bin" ]; then
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
  work="$out/.work"
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init local/k8s-rendezvous-etcd-v2 >/dev/null 2>&1
  echo "[build] etcd v$version (v2 API) into $out" >&2
  go get "go.etcd.io/etcd/server/v3@v$version" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin" go.etcd.io/etcd/server/v3 >&2
  rm -rf "$work"
fi
echo "$bin"
