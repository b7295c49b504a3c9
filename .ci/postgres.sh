# Sourced by .ci/run: a throwaway PostgreSQL server on a local port for the multi-worker search test.
# Installs Debian's postgresql when no initdb is found, runs the server as the postgres user (it refuses
# root), trusts local connections, and exports VLM_DRAFT_NAS_PG_URL; pg_stop shuts it down.
PG_PORT=${PG_PORT:-54329}
PG_ROOT=$(mktemp -d /tmp/ci-postgres.XXXXXX)
PG_BIN=$(dirname "$(readlink -f "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | tail -1)")")
if [ ! -x "$PG_BIN/initdb" ]; then
  echo "ci: installing postgresql (Debian)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null 2>&1; }
  PG_BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
fi
as_pg() {  # the server refuses to run as root
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
[ "$(id -u)" = 0 ] && chown postgres "$PG_ROOT"
if as_pg "$PG_BIN/initdb" -D "$PG_ROOT/data" -A trust -U postgres >"$PG_ROOT/initdb.log" 2>&1 \
   && as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" -l "$PG_ROOT/server.log" -w \
        -o "-p $PG_PORT -k $PG_ROOT -c listen_addresses=127.0.0.1" start >/dev/null \
   && as_pg "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres nas; then
  export VLM_DRAFT_NAS_PG_URL="postgresql+psycopg2://postgres@127.0.0.1:$PG_PORT/nas"
  echo "ci: PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on port $PG_PORT"
else
  echo "ci: could not start PostgreSQL (see $PG_ROOT/*.log); the PostgreSQL test will fail under CI=true"
fi
pg_stop() {
  as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" -m fast stop >/dev/null 2>&1
  rm -rf "$PG_ROOT"
}
