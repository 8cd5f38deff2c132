#!/bin/sh
# The image's entry point: `shoal ARGS...` (router, worker, up, data, keys, models...).
# Secrets mounted as files named after their variable (Docker/podman compose secrets:
# /run/secrets/SHOAL_GPU_KEY ...; or a folder in SHOAL_SECRETS_DIR) become those SHOAL_*
# variables, so keys never sit in the environment of the compose file or the image.
set -eu
dir=${SHOAL_SECRETS_DIR:-/run/secrets}
if [ -d "$dir" ]; then
    for file in "$dir"/SHOAL_*; do
        [ -f "$file" ] || continue
        name=$(basename "$file")
        value=$(cat "$file")
        export "$name=$value"
    done
fi
# The healthcheck (a separate process) reads which command this container runs.
printf '%s\n' "${1:-}" > /tmp/shoal-command 2>/dev/null || true
exec shoal "$@"
