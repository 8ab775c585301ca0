#!/usr/bin/env bash
# The full install and demo on a kind cluster, for machines with Docker and internet access
# (kind, docker, helm and kubectl on PATH). It is NOT run in CI: CI machines here have no
# Docker engine; tests/ runs a real control plane built from Go modules instead.
#
#   tests/e2e/kind-demo.sh            # create the cluster, install, run, show, delete it
#   KEEP_CLUSTER=1 tests/e2e/kind-demo.sh
#
# What it shows: helm install of the chart (operator, webhook, admission policy); an
# annotated Job whose pods run plain `torchrun` (the webhook injects the rendezvous
# settings); a pod deleted mid-training and parallelism raised, with each round in
# `kubectl get rdzv`; the Job finishing and the Rendezvous closing.
set -euo pipefail
cd "$(dirname "$0")/../.."
cluster=${CLUSTER:-k8s-rendezvous-demo}
namespace=demo
for tool in kind docker helm kubectl; do
  command -v "$tool" >/dev/null || { echo "needs $tool on PATH" >&2; exit 1; }
done

cleanup() { [ -n "${KEEP_CLUSTER:-}" ] || kind delete cluster --name "$cluster"; }
trap cleanup EXIT
kind create cluster --name "$cluster" --wait 120s
export KUBECONFIG
KUBECONFIG=$(mktemp)
kind get kubeconfig --name "$cluster" > "$KUBECONFIG"

echo "== images"
docker build -t k8s-rendezvous-operator:demo .
trainer=$(mktemp -d)
cp examples/elastic_train.py "$trainer/"
cp -r pyproject.toml uv.lock README.md handler operator "$trainer/"
cat > "$trainer/Dockerfile" <<'DOCKERFILE'
FROM python:3.11-slim-bookworm
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu
COPY . /src
RUN pip install --no-cache-dir /src && cp /src/elastic_train.py /train.py
DOCKERFILE
docker build -t k8s-rendezvous-trainer:demo "$trainer"
kind load docker-image --name "$cluster" k8s-rendezvous-operator:demo k8s-rendezvous-trainer:demo

echo "== install"
helm install k8s-rendezvous charts/k8s-rendezvous -n k8s-rendezvous-system --create-namespace \
  --set image.repository=k8s-rendezvous-operator --set image.tag=demo \
  --set image.pullPolicy=Never --wait --timeout 5m
kubectl create namespace "$namespace"

echo "== an annotated Job running plain torchrun"
kubectl -n "$namespace" apply -f - <<'JOB'
apiVersion: batch/v1
kind: Job
metadata:
  name: train
  annotations:
    k8s-rendezvous.dev/nodes: "2:4"
    k8s-rendezvous.dev/last-call-timeout: "10"
spec:
  parallelism: 3
  completions: 3
  completionMode: Indexed
  backoffLimitPerIndex: 3
  podFailurePolicy:
    rules: [{action: Ignore, onPodConditions: [{type: DisruptionTarget}]}]
  successPolicy:
    rules: [{succeededCount: 1}]
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: trainer
          image: k8s-rendezvous-trainer:demo
          imagePullPolicy: Never
          command: [torchrun, --nproc-per-node=1, --max-restarts=5, /train.py, --steps=600]
          env: [{name: GLOO_SOCKET_IFNAME, value: eth0}]
JOB
round() { kubectl -n "$namespace" get rdzv train -o jsonpath='{.status.round}' 2>/dev/null || echo 0; }
wait_round() {  # wait_round N: until round N is sealed
  for _ in $(seq 300); do
    [ "$(round)" -ge "$1" ] && [ "$(kubectl -n "$namespace" get rdzv train -o jsonpath='{.status.state}')" = Sealed ] && break
    sleep 1
  done
  kubectl -n "$namespace" get rdzv train -o wide
}
wait_round 1

echo "== a node lost: delete one pod"
kubectl -n "$namespace" delete "$(kubectl -n "$namespace" get pods -l batch.kubernetes.io/job-name=train -o name | head -1)" --wait=false
wait_round 2

echo "== scale up: parallelism 4 (and completions: the Job is Indexed)"
kubectl -n "$namespace" patch job train --type merge -p '{"spec":{"parallelism":4,"completions":4}}'
wait_round 3

kubectl -n "$namespace" wait --for=condition=complete job/train --timeout=15m
kubectl -n "$namespace" get rdzv train -o wide
kubectl -n "$namespace" describe rdzv train | tail -25
