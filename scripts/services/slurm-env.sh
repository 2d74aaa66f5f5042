# Settings shared by start-slurm.sh and stop-slurm.sh. Sourced after lib.sh.
RUN="${POSTTRAIN_SLURM_DIR:-$SERVICES_DIR/slurm}"
CTLD_PORT="${POSTTRAIN_SLURM_PORT:-6817}"
SLURMD_PORT=$((CTLD_PORT + 1))
DBD_PORT=$((CTLD_PORT + 2))
DB_PORT=$((CTLD_PORT + 3))
CONF_DIR="${POSTTRAIN_SLURM_CONF_DIR:-/etc/slurm}"
CLUSTER="${POSTTRAIN_SLURM_CLUSTER:-localcluster}"
NODES="${POSTTRAIN_SLURM_NODES:-2}"
export SLURM_CONF="$CONF_DIR/slurm.conf"
DB_DIR="$RUN/db"                 # owned by mysql: data, socket
DB_SOCK="$DB_DIR/mysqld.sock"
db() { mysql --no-defaults --socket="$DB_SOCK" -u root "$@"; }
db_ok() { mysqladmin --no-defaults --socket="$DB_SOCK" -u root ping >/dev/null 2>&1; }
