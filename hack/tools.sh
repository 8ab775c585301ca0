#!/usr/bin/env bash
# Developer tools built from the Go module proxy at pinned versions, into a versioned cache
# directory outside the repository (as devkit/cluster/build.sh does for the control plane).
# A tool already built is not built again; the Go tool's output goes to a log beside it.
#
#   hack/tools.sh actionlint      # builds it if needed, prints the binary's path
#   hack/tools.sh prometheus      # the distribution's package, unpacked (not installed)
#   hack/tools.sh promtool        # from the same package (promtool test rules)
set -euo pipefail

# The newest release the module proxy listed on 2026-12-02 (go list -m -versions).
ACTIONLINT_VERSION=1.7.12

cache=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}

# Prometheus for the dashboard's test (tests/integration/test_dashboard.py) and its promtool
# for the alerts' (tests/chart/test_alerts.py): the Debian or Ubuntu package of the
# machine's apt sources, downloaded and unpacked into the cache, never installed (its
# postinst would start a system service). The package's version names the directory, so a
# new one in the sources is fetched once. Prints the directory holding both.
prometheus() {
  local version out deb
  version=$(apt-cache policy prometheus 2>/dev/null | awk '$1 == "Candidate:" {print $2}')
  if [ -z "$version" ] || [ "$version" = "(none)" ]; then
    echo "[tools] apt knows no prometheus package: add a Debian or Ubuntu source and run" \
      "apt-get update" >&2
    exit 1
  fi
  out=$cache/tools-prometheus${version//[:~]/_}
  if [ ! -x "$out/prometheus" ] || [ ! -x "$out/promtool" ]; then
    rm -rf "$out/.work"; mkdir -p "$out/.work"
    # A superseded version in stale package lists is gone from the mirror: refresh them once
    # (as root, or through sudo where that needs no password, as on CI runners).
    if ! (cd "$out/.work" && apt-get download -q "prometheus=$version" >/dev/null 2>&1); then
      echo "[tools] downloading prometheus $version failed; running apt-get update" >&2
      if [ "$(id -u)" = 0 ]; then apt-get update -q >&2; else sudo -n apt-get update -q >&2; fi
      version=$(apt-cache policy prometheus | awk '$1 == "Candidate:" {print $2}')
      out=$cache/tools-prometheus${version//[:~]/_}
      rm -rf "$out/.work"; mkdir -p "$out/.work"
      (cd "$out/.work" && apt-get download -q "prometheus=$version" >&2)
    fi
    deb=$(echo "$out"/.work/prometheus_*.deb)
    dpkg-deb -x "$deb" "$out/.work/root"
    mv -f "$out/.work/root/usr/bin/promtool" "$out/promtool"
    mv -f "$out/.work/root/usr/bin/prometheus" "$out/prometheus"
    rm -rf "$out/.work"
    echo "[tools] unpacked prometheus and promtool $version into $out" >&2
  fi
  prometheus_dir=$out
}

case "${1:-}" in
  actionlint) module=github.com/rhysd/actionlint/cmd/actionlint version=$ACTIONLINT_VERSION ;;
  prometheus|promtool) prometheus; echo "$prometheus_dir/$1"; exit 0 ;;
  *) echo "usage: $0 actionlint|prometheus|promtool" >&2; exit 2 ;;
esac
tool=$1
out=$cache/tools-$tool$version

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
