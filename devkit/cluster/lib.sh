# shellcheck shell=bash
# What build.sh and build-controllers.sh share; sourced after they set $out (the versioned
# cache directory the components land in).
# shellcheck disable=SC2154  # out: the sourcing script sets it
: "${out:?lib.sh is sourced once out is set}"

# One build per cache directory at a time: test lanes and sessions side by side share it,
# and the second waits here, then finds everything built. Released when the script exits.
exec {build_lock}>"$out/.build.lock"
flock "$build_lock"

log() { echo "[build] $*" >&2; }

step() {  # step ID WHAT FUNCTION: build one component; the Go tool's output goes to a log
  local name=$2 began file="$out/logs/$1.log" rc
  began=$(date +%s); mkdir -p "$out/logs"
  log "building $name (output: $file)"
  set +e
  ( set -e; "$3" ) >"$file" 2>&1
  rc=$?
  set -e
  if [ "$rc" != 0 ]; then
    log "building $name failed after $(( $(date +%s) - began )) s; the end of $file:"
    tail -n 40 "$file" >&2
    exit "$rc"
  fi
  log "built $name in $(( $(date +%s) - began )) s"
}
