#!/usr/bin/env bash
# The compatibility run (issue #23 §3): the oldest and the newest supported torch, and the
# oldest and the newest supported Kubernetes.
#
#   hack/compat.sh                          everything, with the defaults below (= "all")
#   hack/compat.sh torch [TORCH[@PYTHON] ...]       default: 2.6.0@3.10 2.15.0@3.13
#   hack/compat.sh kubernetes [K8S@ETCD ...]        default: 1.32.9@3.5.16 and versions.env's
#   hack/compat.sh TORCH[@PYTHON] ...       the same as "torch ..."
#
# Torch side, written to tests/compat/results.md (COMPAT_RESULTS). For each torch version a
# venv under $cache/compat/torch-<ver>-py<pyver> (reused when present) gets this repository
# (editable, with the operator extra), torch==<ver> and the test tools, and then runs, from
# the repository root, with that venv's python, two pytest sessions:
#
#   python -m pytest tests/unit tests/e2e/test_torchrun.py -p no:cacheprovider -q
#   python -m pytest tests/contract -p no:cacheprovider -q
#
# Python 3.10 (the oldest pod-side Python) cannot run them unchanged: the operator extra
# needs kopf, which needs Python >= 3.11, and the e2e and the contract suite start the
# operator with the test interpreter (devkit/operator.py uses sys.executable). On a
# Python below 3.11 the venv therefore gets the pod side only and runs tests/unit without
# test_webhook_config.py (it imports kopf); the e2e and the contract suite of that torch run
# in a second venv on Python 3.11.
#
# The first torch version also gets a run of tests/unit/test_rest.py and
# tests/unit/test_plugin.py against the oldest supported Kubernetes client
# (COMPAT_OLDEST_CLIENT, default 31.0.0; empty skips it), in a venv of its own so that the
# other venvs keep the newest client.
#
# Kubernetes side, written to tests/compat/kubernetes.md (COMPAT_KUBERNETES_RESULTS). For
# each version a copy of devkit/cluster/versions.env with that Kubernetes and etcd, at
# $cache/compat/kubernetes-<ver>-etcd<ver>/versions.env, is named by K8S_RDZV_VERSIONS for
# devkit/cluster/build.sh (which builds into a cache directory named by the versions) and
# for the test session's control plane; then, with the newest torch's venv
# (COMPAT_KUBERNETES_TORCH, default 2.15.0@3.13):
#
#   python -m pytest tests/integration tests/security tests/chart -p no:cacheprovider -q
#
# Every session starts its own control plane: K8S_RDZV_KUBECONFIG_DIR, K8S_RDZV_BINARIES and
# KUBEBUILDER_ASSETS are unset for them. Exits non-zero if any build or run failed.
#
# Environment:
#   K8S_RDZV_CACHE       cache root, as for devkit/cluster/build.sh (~/.cache/k8s-rendezvous)
#   UV                   the uv binary (default: uv on PATH, else python3 -m uv)
#   UV_CACHE_DIR         uv's cache (default: $cache/compat/uv-cache, so that the download
#                        of a first install is measured cold and never shared with .venv)
#   COMPAT_PYTEST_ARGS   more pytest arguments for every run (e.g. "-W default")
#   COMPAT_OLDEST_CLIENT see above
#   COMPAT_KUBERNETES_TORCH  the venv the Kubernetes side's tests run in, as TORCH@PYTHON
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}
compat="$cache/compat"
torch_results=${COMPAT_RESULTS:-$repo/tests/compat/results.md}
kubernetes_results=${COMPAT_KUBERNETES_RESULTS:-$repo/tests/compat/kubernetes.md}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$compat/uv-cache}
oldest_client=${COMPAT_OLDEST_CLIENT-31.0.0}
kubernetes_torch=${COMPAT_KUBERNETES_TORCH:-2.15.0@3.13}
read -r -a extra_pytest <<<"${COMPAT_PYTEST_ARGS:-}"

if [ -n "${UV:-}" ]; then
  read -r -a uv <<<"$UV"
elif command -v uv >/dev/null && uv --version >/dev/null 2>&1; then
  uv=(uv)
else
  uv=(python3 -m uv)
fi

pinned() { awk -F= -v key="$1" '$1 == key {print $2}' "$repo/devkit/cluster/versions.env"; }

# The Python each default torch runs on: the oldest torch with the oldest pod-side Python,
# the newest with the newest. Anything else runs on the test suite's Python unless given.
declare -A default_python=([2.6.0]=3.10 [2.15.0]=3.13)
default_torch=(2.6.0 2.15.0)
# The oldest Kubernetes: 1.32 is the first with CRD selectable fields GA, and 1.32.9 the
# only 1.32 patch whose staging modules the Go module proxy here serves all of (README.md
# beside this table's file); etcd is the one the release names. The newest is the pin.
default_kubernetes=(1.32.9@3.5.16 "$(pinned KUBERNETES_VERSION)@$(pinned ETCD_VERSION)")
fallback_python=3.11
test_deps=(numpy pytest pytest-timeout hypothesis pyyaml psutil)
unit_paths=(tests/unit)
e2e_paths=(tests/e2e/test_torchrun.py)
contract_paths=(tests/contract)
client_paths=(tests/unit/test_rest.py tests/unit/test_plugin.py)
needs_kopf=(tests/unit/test_webhook_config.py)
kubernetes_paths=(tests/integration tests/security tests/chart)

log() { echo "[compat] $*" >&2; }
die() { log "$*"; exit 2; }

find_python() {  # find_python X.Y: path of a CPython X.Y interpreter
  local want=$1 candidate
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/python \
    "/usr/bin/python$want" "/usr/local/bin/python$want"; do
    if [ -x "$candidate" ] &&
      [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ]; then
      echo "$candidate"
      return
    fi
  done
  "${uv[@]}" python find --no-python-downloads "$want" 2>/dev/null ||
    { log "no Python $want found"; return 1; }
}

rx_bytes() {  # bytes received on every interface but lo (download measurement)
  awk -F'[: ]+' 'NR > 2 && $2 != "lo" {sum += $3} END {printf "%.0f\n", sum}' /proc/net/dev
}

mib() { awk -v b="$1" 'BEGIN {printf "%.0f", b / 1048576}'; }
seconds_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.0f", b - a}'; }
minutes() { awk -v s="$1" 'BEGIN {printf "%d min %02d s", s / 60, s % 60}'; }

commit_line() {  # the commit the run tested, and whether the tree differed from it
  echo "commit $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- \
    handler operator tests charts manifests pyproject.toml ':!tests/compat' 2>/dev/null ||
    echo ' (with uncommitted changes)')"
}

# --- arguments ---------------------------------------------------------------------------

command_line="hack/compat.sh${*:+ $*}"
mode=all
case "${1:-all}" in
  all) [ $# -le 1 ] || die "\"all\" takes no versions: use \"torch ...\" or \"kubernetes ...\""; shift $# ;;
  torch | kubernetes) mode=$1; shift ;;
  [0-9]*) mode=torch ;;
  *) die "usage: $0 [all | torch [TORCH[@PYTHON] ...] | kubernetes [K8S@ETCD ...]]" ;;
esac
torch_versions=(); kubernetes_versions=()
if [ "$mode" != kubernetes ]; then torch_versions=("$@"); [ $# -gt 0 ] || torch_versions=("${default_torch[@]}"); fi
if [ "$mode" != torch ]; then kubernetes_versions=("$@"); [ $# -gt 0 ] || kubernetes_versions=("${default_kubernetes[@]}"); fi
failed=0
run_started=$EPOCHREALTIME

# --- venvs and pytest sessions -----------------------------------------------------------

measurements=()

prepare() {  # prepare VENV PYTHON EXTRA KUBERNETES TORCH: create or reuse, then install
  local venv=$1 python=$2 extra=$3 client=$4 torch=$5 state=reused
  local before after started elapsed install_log="$1/install.log"
  if [ ! -x "$venv/bin/python" ]; then
    state=created
    mkdir -p "$(dirname "$venv")"
    "${uv[@]}" venv --quiet --python "$python" "$venv"
  fi
  local packages=(-e "$repo$extra" "torch==$torch" "${test_deps[@]}")
  # The test session imports pydantic (devkit/cluster/controlplane.py), which only newer
  # clients pull in.
  [ -z "$client" ] || packages+=("kubernetes==$client" pydantic)
  log "$(basename "$venv"): installing ($state venv)"
  before=$(rx_bytes)
  started=$EPOCHREALTIME
  if ! "${uv[@]}" pip install --python "$venv/bin/python" "${packages[@]}" >"$install_log" 2>&1; then
    cat "$install_log" >&2
    die "installing into $venv failed"
  fi
  elapsed=$(seconds_since "$started")
  after=$(rx_bytes)
  # uv names every wheel above a few MiB it downloads: "Downloading torch (731.2MiB)".
  local wheels torch_wheel
  wheels=$(awk '/^ *Downloading .*\(/ {gsub(/[()]/, "", $NF); v = $NF + 0;
    if ($NF ~ /GiB/) v *= 1024; else if ($NF ~ /KiB/) v /= 1024; s += v} END {printf "%.0f", s}' "$install_log")
  torch_wheel=$(awk '$1 == "Downloading" && $2 == "torch" {gsub(/[()]|MiB/, "", $3); print $3}' "$install_log")
  # What creating the venv cost is kept with it, so that a later run (reusing it) still
  # reports the cold figures.
  if [ "$state" = created ]; then
    echo "$(date -u +%Y-%m-%d) | ${torch_wheel:--} | ${wheels} | $(mib $((after - before))) | ${elapsed}" >"$venv/created.txt"
  fi
  measurements+=("| $(basename "$venv") | $(cat "$venv/created.txt" 2>/dev/null || echo "- | - | - | - | -") | ${elapsed} | $(du -sm "$venv" | cut -f1) |")
}

# run_pytest LOG PYTHON PATH...: one pytest session from the repository root, its output
# also in LOG, its environment this one's without what would choose another control plane,
# plus session_env's NAME=VALUE; sets rc, elapsed, passed, failed_n, skipped, errors.
session_env=()
run_pytest() {
  local log_file=$1 py=$2 started summary
  shift 2
  local args=(-m pytest "$@" -p no:cacheprovider -q "${extra_pytest[@]}")
  log "$(dirname "$log_file" | xargs basename): python ${args[*]}"
  started=$EPOCHREALTIME
  set +e
  (cd "$repo" && env -u K8S_RDZV_KUBECONFIG_DIR -u K8S_RDZV_BINARIES -u KUBEBUILDER_ASSETS \
    -u K8S_RDZV_VERSIONS "${session_env[@]}" "$py" "${args[@]}") 2>&1 | tee "$log_file"
  rc=${PIPESTATUS[0]}
  set -e
  elapsed=$(seconds_since "$started")
  summary=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log_file" | tail -n 1 || true)
  count() { { grep -oE "[0-9]+ $1" <<<"$summary" || true; } | awk '{s += $1} END {print s + 0}'; }
  passed=$(count passed)
  failed_n=$(count failed)
  skipped=$(count skipped)
  errors=$(count 'errors?')
  [ "$rc" -eq 0 ] || failed=1
}

cell() { tr '|`' "/'"; }  # text that cannot break a table's cell or code span
side() {  # side NAME VERSIONS OTHER: what of the command a results file holds
  [ "$mode" = all ] || return 0
  echo "; this file holds its $1 side (\`hack/compat.sh $1 $2\`), [$3]($3) the other"
}

result() { [ "$rc" -eq 0 ] && echo pass || echo "FAIL (exit $rc)"; }

# notes LABEL LOG: pytest's short summary (-ra) lines for skips, failures and errors
notes=()
add_notes() {
  local label=$1 line
  while IFS= read -r line; do
    notes+=("- $label: \`${line//\`/\'}\`")
  done < <(grep -E '^(SKIPPED|FAILED|ERROR) ' "$2" || true)
}

# --- torch side --------------------------------------------------------------------------

torch_rows=()

run_torch_suite() {  # run_torch_suite VENV TORCH SUITE PATH...: one pytest run, one row
  local venv=$1 torch=$2 suite=$3 pyver client
  shift 3
  pyver=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
  client=$("$venv/bin/python" -c 'import kubernetes; print(kubernetes.__version__)')
  run_pytest "$venv/pytest-$suite.log" "$venv/bin/python" "$@"
  torch_rows+=("| $torch | $pyver | $client | $suite: \`${*}\` | $passed | $failed_n | $skipped | $errors | ${elapsed} s | $(result) |")
  add_notes "torch $torch, Python $pyver, $suite" "$venv/pytest-$suite.log"
}

torch_venv() {  # torch_venv TORCH@PYTHON: the venv the torch side uses for it (operator extra)
  local torch=${1%@*} pyver=${1#*@}
  echo "$compat/torch-$torch-py$pyver"
}

run_torch() {
  local spec torch pyver python venv first=1 ignores path e2e_venv client_venv
  for spec in "${torch_versions[@]}"; do
    torch=${spec%@*}
    if [ "$spec" != "$torch" ]; then pyver=${spec#*@}; else pyver=${default_python[$torch]:-$fallback_python}; fi
    python=$(find_python "$pyver")
    venv=$(torch_venv "$torch@$pyver")
    if "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      prepare "$venv" "$python" "[operator]" "" "$torch"
      run_torch_suite "$venv" "$torch" "unit+e2e" "${unit_paths[@]}" "${e2e_paths[@]}"
      run_torch_suite "$venv" "$torch" "contract" "${contract_paths[@]}"
    else
      prepare "$venv" "$python" "" "" "$torch"
      ignores=()
      for path in "${needs_kopf[@]}"; do ignores+=("--ignore=$path"); done
      run_torch_suite "$venv" "$torch" "unit" "${unit_paths[@]}" "${ignores[@]}"
      e2e_venv=$(torch_venv "$torch@$fallback_python")
      prepare "$e2e_venv" "$(find_python "$fallback_python")" "[operator]" "" "$torch"
      run_torch_suite "$e2e_venv" "$torch" "e2e" "${e2e_paths[@]}"
      run_torch_suite "$e2e_venv" "$torch" "contract" "${contract_paths[@]}"
    fi
    if [ "$first" = 1 ] && [ -n "$oldest_client" ]; then
      client_venv="$venv-kubernetes$oldest_client"
      prepare "$client_venv" "$python" "" "$oldest_client" "$torch"
      run_torch_suite "$client_venv" "$torch" "client" "${client_paths[@]}"
    fi
    first=0
  done
}

write_torch_results() {
  local total=$1
  mkdir -p "$(dirname "$torch_results")"
  {
    echo "# Compatibility run: oldest and newest supported torch"
    echo
    echo "Command (from the repository root): \`$command_line\`$(side torch "${torch_versions[*]}" kubernetes.md)."
    echo "Written by hack/compat.sh on $(date -u +%Y-%m-%dT%H:%MZ), $(commit_line); the"
    echo "torch side took $(minutes "$total") in all (installs included) on $(nproc) cores."
    echo
    echo "Each row ran \`python -m pytest <paths> -p no:cacheprovider -q${extra_pytest[*]:+ ${extra_pytest[*]}}\` from the"
    echo "repository root with its venv's python (see hack/compat.sh and README.md for why"
    echo "Python 3.10 runs the unit tests only). The e2e and contract sessions each start their own"
    echo "control plane (Kubernetes $(pinned KUBERNETES_VERSION), the pin)."
    echo
    echo "| torch | python | kubernetes client | tests | passed | failed | skipped | errors | wall time | result |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${torch_rows[@]}"
    echo
    echo "## Skipped, failed"
    echo
    if [ ${#torch_notes[@]} -gt 0 ]; then printf '%s\n' "${torch_notes[@]}"; else echo "None."; fi
    echo
    echo "## Measurements"
    echo
    echo "When each venv was created (with uv's cache at \$UV_CACHE_DIR, empty for the first):"
    echo "the torch wheel and all wheels downloaded are uv's own figures (it names every wheel"
    echo "above a few MiB), network is the bytes received on all interfaces meanwhile (the"
    echo "machine's other traffic included), install is the whole \`uv pip install\` (resolve,"
    echo "download, unpack, link). \"This run\" is the install step of this run (a no-op check"
    echo "when the venv is reused)."
    echo
    echo "| venv | created | torch wheel (MiB) | wheels downloaded (MiB) | network (MiB) | install (s) | this run's install (s) | venv size (MiB) |"
    echo "|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${measurements[@]}"
    echo
    echo "uv hardlinks every venv's files from its cache, so the venvs share their disk: the"
    echo "venvs and the uv cache together take $(du -smc "$compat"/torch-* "$UV_CACHE_DIR" | tail -n 1 | cut -f1) MiB."
  } >"$torch_results"
  log "wrote $torch_results"
}

# --- Kubernetes side ---------------------------------------------------------------------

kubernetes_rows=()
build_rows=()

run_kubernetes() {
  local spec k8s etcd dir versions venv py binaries build_log before started status
  local build_elapsed server etcd_reported built_now pyver client components
  venv=$(torch_venv "$kubernetes_torch")
  prepare "$venv" "$(find_python "${kubernetes_torch#*@}")" "[operator]" "" "${kubernetes_torch%@*}"
  py="$venv/bin/python"
  pyver=$("$py" -c 'import platform; print(platform.python_version())')
  client=$("$py" -c 'import kubernetes; print(kubernetes.__version__)')
  for spec in "${kubernetes_versions[@]}"; do
    k8s=${spec%@*}
    etcd=${spec#*@}
    [ "$etcd" != "$spec" ] || die "give a Kubernetes version with its etcd: K8S@ETCD (e.g. 1.32.9@3.5.16)"
    dir="$compat/kubernetes-$k8s-etcd$etcd"
    versions="$dir/versions.env"
    build_log="$dir/build.log"
    mkdir -p "$dir"
    sed -e "s/^KUBERNETES_VERSION=.*/KUBERNETES_VERSION=$k8s/" -e "s/^ETCD_VERSION=.*/ETCD_VERSION=$etcd/" \
      "$repo/devkit/cluster/versions.env" >"$versions"
    log "Kubernetes $k8s, etcd $etcd: devkit/cluster/build.sh (log: $build_log)"
    before=$(rx_bytes)
    started=$EPOCHREALTIME
    set +e
    binaries=$(env -u K8S_RDZV_BINARIES -u KUBEBUILDER_ASSETS K8S_RDZV_VERSIONS="$versions" \
      bash "$repo/devkit/cluster/build.sh" 2>"$build_log")
    status=$?
    set -e
    cat "$build_log" >&2
    binaries=$(tail -n 1 <<<"$binaries")
    build_elapsed=$(seconds_since "$started")
    built_now=$(grep -c '^\[build\] built ' "$build_log" || true)
    if [ "$built_now" -gt 0 ] && [ "$status" -eq 0 ]; then
      # What building cost is kept with the versions, so that a later run (finding the
      # binaries cached) still reports it.
      components=$(sed -n 's/ (about [^)]*)//; s/^\[build\] built \(.*\) in \([0-9]*\) s$/\1: \2 s/p' "$build_log" |
        paste -sd ';' | sed 's/;/; /g')
      echo "$(date -u +%Y-%m-%d) | $build_elapsed s ($(minutes "$build_elapsed")) | $(mib $(($(rx_bytes) - before))) | $components" >"$dir/built.txt"
    fi
    if [ "$status" -ne 0 ] || [ ! -x "$binaries/kube-apiserver" ]; then
      failed=1
      kubernetes_rows+=("| $k8s | $etcd | - | build FAILED (exit $status) after $build_elapsed s | - | - | - | - | - | FAIL |")
      build_rows+=("| $k8s | $etcd | FAILED on $(date -u +%Y-%m-%d) | $build_elapsed s | - | $(grep -E '^\[build\]' "$build_log" | tail -n 1 | cell) (the log: $build_log) |")
      continue
    fi
    server=$("$binaries/kube-apiserver" --version | awk '{print $2}')
    etcd_reported=$("$binaries/etcd" --version | awk '/^etcd Version/ {print $3}')
    build_rows+=("| $k8s | $etcd | $(cat "$dir/built.txt" 2>/dev/null || echo "not by this script (found cached) | - | - | -") |")
    session_env=("K8S_RDZV_VERSIONS=$versions")
    run_pytest "$dir/pytest.log" "$py" "${kubernetes_paths[@]}"
    session_env=()
    kubernetes_rows+=("| $k8s | $etcd | $server, etcd $etcd_reported | $([ "$built_now" -gt 0 ] && echo "built: $build_elapsed s" || echo "cached ($build_elapsed s)") | $passed | $failed_n | $skipped | $errors | ${elapsed} s ($(minutes "$elapsed")) | $(result) |")
    add_notes "Kubernetes $k8s" "$dir/pytest.log"
  done
  kubernetes_python="$pyver (torch ${kubernetes_torch%@*}, kubernetes client $client)"
}

write_kubernetes_results() {
  local total=$1
  mkdir -p "$(dirname "$kubernetes_results")"
  {
    echo "# Compatibility run: oldest and newest supported Kubernetes"
    echo
    echo "Command (from the repository root): \`$command_line\`$(side kubernetes "${kubernetes_versions[*]}" results.md)."
    echo "Written by hack/compat.sh on $(date -u +%Y-%m-%dT%H:%MZ), $(commit_line); the"
    echo "Kubernetes side took $(minutes "$total") in all (builds included) on $(nproc) cores."
    echo
    echo "For each version, \`devkit/cluster/build.sh\` built (or found cached) the control plane"
    echo "for a copy of devkit/cluster/versions.env with that Kubernetes and etcd (kwok"
    echo "$(pinned KWOK_VERSION), helm $(pinned HELM_VERSION) and $(pinned HELM3_VERSION) kept; helm 3 is"
    echo "built per Kubernetes minor, for \`helm template\`'s default), named by \`K8S_RDZV_VERSIONS\`. Then"
    echo "\`python -m pytest ${kubernetes_paths[*]} -p no:cacheprovider -q${extra_pytest[*]:+ ${extra_pytest[*]}}\` ran from the"
    echo "repository root on Python $kubernetes_python, with the same"
    echo "\`K8S_RDZV_VERSIONS\`, so its control plane is that version's (test_control_plane.py"
    echo "checks the server's and kubectl's version against it)."
    echo
    echo "| Kubernetes | etcd | binaries report | binaries (this run) | passed | failed | skipped | errors | test wall time | result |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${kubernetes_rows[@]}"
    echo
    echo "## Skipped, failed"
    echo
    echo "pytest's short summary (\`-ra\`) for each version:"
    echo
    if [ ${#kubernetes_notes[@]} -gt 0 ]; then printf '%s\n' "${kubernetes_notes[@]}"; else echo "None."; fi
    echo
    echo "## Builds"
    echo
    echo "When hack/compat.sh built each version's binaries (whole build.sh, and each"
    echo "component as it reported it). Go's module cache (\`go env GOMODCACHE\`) is shared"
    echo "between versions and with \`make test\`'s build, so a build's network figure (bytes"
    echo "received on all interfaces meanwhile, the machine's other traffic included) counts"
    echo "only modules no earlier build had fetched."
    echo
    echo "| Kubernetes | etcd | built on | build wall time | network (MiB) | components |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${build_rows[@]}"
  } >"$kubernetes_results"
  log "wrote $kubernetes_results"
}

# --- the run -----------------------------------------------------------------------------

if [ ${#torch_versions[@]} -gt 0 ]; then
  started=$EPOCHREALTIME
  run_torch
  torch_notes=("${notes[@]}")
  notes=()
  write_torch_results "$(seconds_since "$started")"
fi
if [ ${#kubernetes_versions[@]} -gt 0 ]; then
  started=$EPOCHREALTIME
  measurements=()
  run_kubernetes
  kubernetes_notes=("${notes[@]}")
  write_kubernetes_results "$(seconds_since "$started")"
fi
log "done in $(minutes "$(seconds_since "$run_started")"); $([ "$failed" = 0 ] && echo "every run passed" || echo "some run FAILED")"
exit "$failed"
