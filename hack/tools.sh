#!/usr/bin/env bash
# Developer tools built from the Go module proxy at pinned versions, into a versioned cache
# directory outside the repository (as devkit/cluster/build.sh does for the control plane).
# A tool already built is not built again; the Go tool's output goes to a log beside it.
#
#   hack/tools.sh actionlint      # builds it if needed, prints the binary's path
set -euo pipefail

# The newest release the module proxy listed on 2026-12-02 (go list -m -versions).
ACTIONLINT_VERSION=1.7.12

case "${1:-}" in
  actionlint) module=github.com/rhysd/actionlint/cmd/actionlint version=$ACTIONLINT_VERSION ;;
  *) echo "usage: $0 actionlint" >&2; exit 2 ;;
esac
tool=$1
out=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}/tools-$tool$version

if [ ! -x "$out/$tool" ]; then
  export GOTOOLCHAIN=local CGO_ENABLED=0
  began=$(date +%s)
  mkdir -p "$out"
  echo "[tools] building $tool v$version (output: $out/build.log)" >&2
  if ! GOBIN="$out/.work" go install -trimpath -ldflags "-s -w" "$module@v$version" \
    >"$out/build.log" 2>&1; then
    echo "[tools] building $tool failed; the end of $out/build.log:" >&2
    tail -n 40 "$out/build.log" >&2
    exit 1
  fi
  mv -f "$out/.work/$tool" "$out/$tool"  # a rename: a run of the old binary is not disturbed
  rm -rf "$out/.work"
  echo "[tools] built $tool in $(( $(date +%s) - began )) s" >&2
fi
echo "$out/$tool"
