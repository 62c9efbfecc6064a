#!/bin/sh
# The official postgres image's entrypoint contract, reduced to what docker-compose.yml uses (see
# postgres.Containerfile). As root: read POSTGRES_PASSWORD_FILE, own PGDATA, drop to postgres.
# As postgres: on an empty PGDATA, initdb (local socket: trust; TCP: scram-sha-256 on every
# address), create POSTGRES_DB, run /docker-entrypoint-initdb.d/*.sql (psql as POSTGRES_USER in
# POSTGRES_DB, stopping at the first error) and *.sh (sourced), all on the socket only; then exec
# the command (postgres) listening on every address.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ "$(id -u)" = 0 ]; then
    if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
        POSTGRES_PASSWORD="$(cat "$POSTGRES_PASSWORD_FILE")"
        export POSTGRES_PASSWORD
        unset POSTGRES_PASSWORD_FILE
    fi
    chown postgres:postgres "$PGDATA"
    chmod 0700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "postgres: POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE is required" >&2
        exit 1
    fi
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256
    rm -f "$pwfile"
    printf 'host all all all scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
    psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
    for f in /docker-entrypoint-initdb.d/*; do
        case "$f" in
            *.sql) echo "running $f"; psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d "$POSTGRES_DB" -f "$f" ;;
            *.sh) echo "sourcing $f"; . "$f" ;;
        esac
    done
    pg_ctl -D "$PGDATA" -m fast -w stop
    echo "postgres: initialised"
fi
if [ "$1" = postgres ]; then
    shift
    exec postgres -c listen_addresses='*' "$@"
fi
exec "$@"
