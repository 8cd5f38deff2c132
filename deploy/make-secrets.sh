#!/bin/sh
# Make the keys and the database password deploy/compose.yaml reads (deploy/secrets/), once:
# files already there are kept. Prints where the client key is.
set -eu
dir=$(dirname "$0")/secrets
mkdir -p "$dir"
umask 077
token() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
make() { [ -s "$dir/$1" ] || printf '%s' "$2" > "$dir/$1"; }
make SHOAL_ROUTER_API_KEY "sk-shoal-$(token)"
make SHOAL_ADMIN_KEY "ak-shoal-$(token)"
make SHOAL_GPU_KEY "wk-shoal-$(token)"
make postgres_password "$(token)"
make SHOAL_DATABASE_URL "postgresql://shoal:$(cat "$dir/postgres_password")@postgres:5432/shoal"
# The containers run as uid 10001 (the image's user) and read these as compose secrets.
chmod 0444 "$dir"/*
chmod 0700 "$dir"  # the files are bind-mounted: the folder keeps other users of this machine out
echo "client key: $dir/SHOAL_ROUTER_API_KEY   admin key: $dir/SHOAL_ADMIN_KEY"
