#!/usr/bin/env bash
# Compatibility run of the pod side on the oldest and the newest supported torch (issue #23 §3).
#
#   hack/compat.sh [TORCH[@PYTHON] ...]     default: 2.6.0@3.10 2.15.0@3.13
#
# For each torch version a venv under $cache/compat/torch-<ver>-py<pyver> (reused when present)
# gets this repository (editable, with the operator extra), torch==<ver> and the test tools,
# and then runs, from the repository root, with that venv's python:
#
#   python -m pytest tests/unit tests/e2e/test_torchrun.py -p no:cacheprovider -q
#
# Python 3.10 (the oldest pod-side Python) cannot run that command unchanged: the operator
# extra needs kopf, which needs Python >= 3.11, and the e2e starts the operator with the test
# interpreter (tests/support/operator.py uses sys.executable). On a Python below 3.11 the venv
# therefore gets the pod side only and runs tests/unit without test_webhook_config.py (it
# imports kopf); the e2e of that torch runs in a second venv on Python 3.11.
#
# The first version also gets a run of tests/unit/test_rest.py and tests/unit/test_plugin.py
# against the oldest supported Kubernetes client (COMPAT_OLDEST_CLIENT, default 31.0.0; empty
# skips it), in a venv of its own so that the other venvs keep the newest client.
#
# Writes tests/compat/results.md (COMPAT_RESULTS) and exits non-zero if any run failed.
# The control-plane binaries come from tests/cluster/build.sh, as in every test session.
#
# Environment:
#   K8S_RDZV_CACHE       cache root, as for tests/cluster/build.sh (~/.cache/k8s-rendezvous)
#   UV                   the uv binary (default: uv on PATH, else python3 -m uv)
#   UV_CACHE_DIR         uv's cache (default: $cache/compat/uv-cache, so that the download
#                        of a first install is measured cold and never shared with .venv)
#   COMPAT_PYTEST_ARGS   more pytest arguments for every run (e.g. "-W default")
#   COMPAT_OLDEST_CLIENT see above
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${K8S_RDZV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-rendezvous}
compat="$cache/compat"
results=${COMPAT_RESULTS:-$repo/tests/compat/results.md}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$compat/uv-cache}
oldest_client=${COMPAT_OLDEST_CLIENT-31.0.0}
read -r -a extra_pytest <<<"${COMPAT_PYTEST_ARGS:-}"

if [ -n "${UV:-}" ]; then
  read -r -a uv <<<"$UV"
elif command -v uv >/dev/null && uv --version >/dev/null 2>&1; then
  uv=(uv)
else
  uv=(python3 -m uv)
fi

# The Python each default torch runs on: the oldest torch with the oldest pod-side Python,
# the newest with the newest. Anything else runs on the test suite's Python unless given.
declare -A default_python=([2.6.0]=3.10 [2.15.0]=3.13)
fallback_python=3.11
test_deps=(numpy pytest pytest-timeout hypothesis pyyaml psutil)
unit_paths=(tests/unit)
e2e_paths=(tests/e2e/test_torchrun.py)
client_paths=(tests/unit/test_rest.py tests/unit/test_plugin.py)
needs_kopf=(tests/unit/test_webhook_config.py)

log() { echo "[compat] $*" >&2; }

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

rows=()
measurements=()
failed=0

prepare() {  # prepare VENV PYTHON EXTRA KUBERNETES TORCH: create or reuse, then install
  local venv=$1 python=$2 extra=$3 client=$4 torch=$5 state=reused
  local before after started elapsed install_log="$1/install.log"
  if [ ! -x "$venv/bin/python" ]; then
    state=created
    mkdir -p "$(dirname "$venv")"
    "${uv[@]}" venv --quiet --python "$python" "$venv"
  fi
  local packages=(-e "$repo$extra" "torch==$torch" "${test_deps[@]}")
  # The test session imports pydantic (tests/cluster/controlplane.py), which only newer
  # clients pull in.
  [ -z "$client" ] || packages+=("kubernetes==$client" pydantic)
  log "$(basename "$venv"): installing ($state venv)"
  before=$(rx_bytes)
  started=$EPOCHREALTIME
  if ! "${uv[@]}" pip install --python "$venv/bin/python" "${packages[@]}" >"$install_log" 2>&1; then
    cat "$install_log" >&2
    return 1
  fi
  elapsed=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.0f", b - a}')
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

run_suite() {  # run_suite VENV TORCH SUITE PATH...: one pytest run, one row
  local venv=$1 torch=$2 suite=$3
  shift 3
  local py="$venv/bin/python" rc started elapsed summary pyver client
  local args=(-m pytest "$@" -p no:cacheprovider -q "${extra_pytest[@]}")
  pyver=$("$py" -c 'import platform; print(platform.python_version())')
  client=$("$py" -c 'import kubernetes; print(kubernetes.__version__)')
  log "$(basename "$venv"): python ${args[*]}"
  started=$EPOCHREALTIME
  set +e
  (cd "$repo" && "$py" "${args[@]}") 2>&1 | tee "$venv/pytest-$suite.log"
  rc=${PIPESTATUS[0]}
  set -e
  elapsed=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.0f", b - a}')
  summary=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$venv/pytest-$suite.log" | tail -n 1 || true)
  count() { { grep -oE "[0-9]+ $1" <<<"$summary" || true; } | awk '{s += $1} END {print s + 0}'; }
  local passed failed_n skipped errors
  passed=$(count passed)
  failed_n=$(count failed)
  skipped=$(count skipped)
  errors=$(count 'errors?')
  [ "$rc" -eq 0 ] || failed=1
  rows+=("| $torch | $pyver | $client | $suite: \`${*}\` | $passed | $failed_n | $skipped | $errors | ${elapsed} s | $([ "$rc" -eq 0 ] && echo pass || echo "FAIL (exit $rc)") |")
}

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.6.0 2.15.0)
first=1
for spec in "${versions[@]}"; do
  torch=${spec%@*}
  if [ "$spec" != "$torch" ]; then pyver=${spec#*@}; else pyver=${default_python[$torch]:-$fallback_python}; fi
  python=$(find_python "$pyver")
  venv="$compat/torch-$torch-py$pyver"
  if "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    prepare "$venv" "$python" "[operator]" "" "$torch"
    run_suite "$venv" "$torch" "unit+e2e" "${unit_paths[@]}" "${e2e_paths[@]}"
  else
    prepare "$venv" "$python" "" "" "$torch"
    ignores=()
    for path in "${needs_kopf[@]}"; do ignores+=("--ignore=$path"); done
    run_suite "$venv" "$torch" "unit" "${unit_paths[@]}" "${ignores[@]}"
    e2e_venv="$compat/torch-$torch-py$fallback_python"
    prepare "$e2e_venv" "$(find_python "$fallback_python")" "[operator]" "" "$torch"
    run_suite "$e2e_venv" "$torch" "e2e" "${e2e_paths[@]}"
  fi
  if [ "$first" = 1 ] && [ -n "$oldest_client" ]; then
    client_venv="$venv-kubernetes$oldest_client"
    prepare "$client_venv" "$python" "" "$oldest_client" "$torch"
    run_suite "$client_venv" "$torch" "client" "${client_paths[@]}"
  fi
  first=0
done

mkdir -p "$(dirname "$results")"
{
  echo "# Compatibility run: oldest and newest supported torch"
  echo
  echo "Command (from the repository root): \`hack/compat.sh ${versions[*]}\`"
  echo
  echo "Each row ran \`python -m pytest <paths> -p no:cacheprovider -q${extra_pytest[*]:+ ${extra_pytest[*]}}\` from the"
  echo "repository root with its venv's python (see hack/compat.sh for why Python 3.10 runs"
  echo "the unit tests only). Written by hack/compat.sh on $(date -u +%Y-%m-%dT%H:%MZ),"
  echo "commit $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- handler operator tests 2>/dev/null || echo ' (with uncommitted changes)')."
  echo
  echo "| torch | python | kubernetes | tests | passed | failed | skipped | errors | wall time | result |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "## Measurements"
  echo
  echo "When each venv was created (with uv's cache at \$UV_CACHE_DIR, empty for the first):"
  echo "the torch wheel and all wheels downloaded are uv's own figures (it names every wheel"
  echo "above a few MiB), network is the bytes received on all interfaces meanwhile, install"
  echo "is the whole \`uv pip install\` (resolve, download, unpack, link). \"This run\" is the"
  echo "install step of this run (a no-op check when the venv is reused)."
  echo
  echo "| venv | created | torch wheel (MiB) | wheels downloaded (MiB) | network (MiB) | install (s) | this run's install (s) | venv size (MiB) |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${measurements[@]}"
  echo
  echo "uv hardlinks every venv's files from its cache, so the venvs share their disk: the"
  echo "venvs and the uv cache together take $(du -smc "$compat" "$UV_CACHE_DIR" | tail -n 1 | cut -f1) MiB."
} >"$results"
log "wrote $results"
exit "$failed"
