#!/bin/sh
# Put llama.cpp's binaries in the image: shoal-llama-cpp PREBUILT DEST [shoal llama-cpp install options]
# PREBUILT holding an executable llama-server: those binaries (and everything beside them), as they are.
# Otherwise `shoal llama-cpp install` (the pinned release, or a build of the pinned sdist, into
# $SHOAL_CACHE_DIR: a build cache, so the next image build finds it), then its folder is copied.
set -eu
prebuilt=$1 dest=$2
shift 2
mkdir -p "$dest"
if [ -x "$prebuilt/llama-server" ]; then
    echo "llama.cpp: using the binaries given in deploy/prebuilt/"
    src=$prebuilt
else
    shoal llama-cpp install "$@"
    server=$(shoal llama-cpp which "$@" | awk '$1 == "llama-server:" { print $2 }')
    src=$(dirname "$server")
fi
# The binaries with the shared libraries a release ships beside them (a build has none).
find "$src" -maxdepth 1 \( -type f -o -type l \) ! -name '*.md' -exec cp -a {} "$dest"/ \;
"$dest/llama-server" --version
test -x "$dest/ggml-rpc-server" || test -x "$dest/rpc-server" ||
    echo "llama.cpp: no ggml-rpc-server beside llama-server: this image cannot run split models' stages"
