#!/usr/bin/env bash
# Start a PostgreSQL server (Debian's packages) on loopback with its own data folder, and a
# database and user for a Prefect server. Idempotent. Prints one
# "POSTGRES READY <connection url, password masked> ..." line once the database accepts the
# user's connections (the URL itself: $POSTTRAIN_POSTGRES_DIR/url, readable by its owner only).
#
#   POSTGRES_PORT             (default 55432) TCP port, bound to 127.0.0.1 only
#   POSTTRAIN_POSTGRES_DIR    (default $POSTTRAIN_SERVICES_DIR/postgres) data/, the server's
#                             unix socket, log, and url (the connection URL, for start-prefect.sh)
#   POSTGRES_DB, POSTGRES_USER, POSTGRES_PASSWORD   (default prefect, prefect, prefect) the
#                             database and its owner; password auth on 127.0.0.1 only
#   POSTGRES_FSYNC=off        no fsync (throwaway test data: a crash of the machine can corrupt it)
#
# The server never runs as root: as root it runs as the `postgres` user of Debian's packages
# (apt-get installs `postgresql` when no /usr/lib/postgresql/*/bin/postgres exists, with
# Debian's own `main` cluster turned off). synchronous_commit=off: a crash loses at most the
# last few hundred ms of commits, never consistency. Stop with stop-postgres.sh.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_POSTGRES_DIR:-$SERVICES_DIR/postgres}"
PORT="${POSTGRES_PORT:-55432}"
DB="${POSTGRES_DB:-prefect}"
DB_USER="${POSTGRES_USER:-prefect}"
DB_PASSWORD="${POSTGRES_PASSWORD:-prefect}"
DATA="$RUN/data"
t0="$(now)"

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
BIN="$(pg_bin)"
if [ -z "$BIN" ] || [ ! -x "$BIN/postgres" ]; then
  [ "$(id -u)" = 0 ] || { echo "PostgreSQL is not installed; as root: apt-get install postgresql" >&2; exit 1; }
  echo "installing PostgreSQL (apt-get)" >&2
  # Debian's postinst would create and start a cluster `main` on 5432: not wanted here.
  mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/posttrain.conf
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >&2 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >&2; }
  BIN="$(pg_bin)"
fi

# as_owner CMD...: run CMD as the user that owns the data folder (postgres when we are root).
if [ "$(id -u)" = 0 ]; then
  OWNER=postgres
  id "$OWNER" >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/false "$OWNER"
  as_owner() { runuser -u "$OWNER" -- "$@"; }
else
  OWNER="$(id -un)"
  as_owner() { "$@"; }
fi

mkdir -p "$RUN"
chown "$OWNER" "$RUN"
chmod 755 "$RUN"
running_pid() {  # the postmaster's pid when it runs from $DATA
  [ -s "$DATA/postmaster.pid" ] || return 1
  local pid; pid="$(head -1 "$DATA/postmaster.pid")"
  running "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q postgres && echo "$pid"
}

if pid="$(running_pid)"; then
  running_port="$(sed -n 4p "$DATA/postmaster.pid")"
  if [ "$running_port" != "$PORT" ]; then
    echo "PostgreSQL from $DATA already runs on port $running_port (pid $pid); stop-postgres.sh first" >&2
    exit 1
  fi
  echo "PostgreSQL already running (pid $pid)" >&2
else
  if port_open "$PORT"; then echo "port $PORT is taken by another process" >&2; exit 1; fi
  if [ ! -s "$DATA/PG_VERSION" ]; then
    rm -rf "$DATA"
    as_owner "$BIN/initdb" -D "$DATA" -U postgres -E UTF8 --locale=C.UTF-8 --auth-local=trust \
      --auth-host=scram-sha-256 >"$RUN/initdb.log" 2>&1 \
      || { echo "initdb failed; see $RUN/initdb.log" >&2; exit 1; }
    # loopback TCP with a password; the unix socket (in $RUN, owner only) for the admin steps below
    printf '%s\n' "local all postgres trust" "host all all 127.0.0.1/32 scram-sha-256" >"$DATA/pg_hba.conf"
  fi
  fsync=on; [ "${POSTGRES_FSYNC:-on}" = off ] && fsync=off
  # -c options override postgresql.conf, so a data folder made for another port is reused as is.
  as_owner "$BIN/pg_ctl" -D "$DATA" -l "$RUN/server.log" -w -t 60 start -o \
    "-c listen_addresses=127.0.0.1 -p $PORT -c unix_socket_directories=$RUN -c unix_socket_permissions=0700 \
     -c synchronous_commit=off -c fsync=$fsync -c full_page_writes=$fsync -c max_connections=200 \
     -c shared_buffers=128MB" >/dev/null \
    || { echo "PostgreSQL did not start; see $RUN/server.log" >&2; exit 1; }
fi

psql_admin() { as_owner "$BIN/psql" -h "$RUN" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtAX "$@"; }
for _ in $(seq 100); do psql_admin -c 'select 1' >/dev/null 2>&1 && break; sleep 0.1; done
if [ "$(psql_admin -c "select 1 from pg_roles where rolname = '$DB_USER'")" != 1 ]; then
  psql_admin -c "create role \"$DB_USER\" login password '$DB_PASSWORD'" >/dev/null
else
  psql_admin -c "alter role \"$DB_USER\" login password '$DB_PASSWORD'" >/dev/null
fi
if [ "$(psql_admin -c "select 1 from pg_database where datname = '$DB'")" != 1 ]; then
  psql_admin -c "create database \"$DB\" owner \"$DB_USER\"" >/dev/null
fi

URL="postgresql+asyncpg://$DB_USER:$DB_PASSWORD@127.0.0.1:$PORT/$DB"
echo "$URL" >"$RUN/url"
chmod 600 "$RUN/url"
# the user's own password login over TCP, as Prefect will connect
PGPASSWORD="$DB_PASSWORD" "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U "$DB_USER" -d "$DB" -qtAX -c 'select 1' >/dev/null \
  || { echo "cannot log in as $DB_USER to $DB on 127.0.0.1:$PORT" >&2; exit 1; }
echo "POSTGRES READY ${URL/:"$DB_PASSWORD"@/:***@} (pid $(running_pid), $("$BIN/postgres" --version | awk '{print $3}')) in $(since "$t0")s"
