#!/usr/bin/env bash
# Start a Slurm cluster of N nodes on this host (Debian's slurm-wlm 22.05), with
# slurmdbd + MariaDB accounting, without systemd: one `slurmd -N nX` per node, each
# with its own Port and NodeAddr=127.0.0.1. Needs root. Idempotent: daemons already up
# are only re-checked. Prints one "SLURM READY ..." line.
#
#   PREEMPT=1                 partition "high" preempts "debug": REQUEUE with GraceTime=30
#                             and preempt_send_user_signal, so submitit gets its USR2 and
#                             checkpoints before the requeue
#   INSTALL=0                 do not apt-get install missing packages
#   POSTTRAIN_SLURM_DIR       (default $POSTTRAIN_SERVICES_DIR/slurm) state, spool, logs,
#                             pids and the MariaDB data
#   POSTTRAIN_SLURM_PORT      (default 6817) slurmctld; slurmd, slurmdbd and MariaDB use the
#                             next three ports
#   POSTTRAIN_SLURM_CONF_DIR  (default /etc/slurm) elsewhere, clients need SLURM_CONF
#   POSTTRAIN_SLURM_CLUSTER   (default localcluster)
#   POSTTRAIN_SLURM_NODES     (default 2) nodes n1..nN; each is given the whole host's CPUs
#                             and memory (SlurmdParameters=config_overrides), so a 1-node
#                             job sees what the single-node cluster offered. n1 uses the
#                             slurmd port, nX (X>1) port CTLD_PORT+3+X.
#
# cred_expire=10: a requeued job starts again after ~12 s instead of ~122 s.
#
# Why slurmdbd: submitit polls `sacct`; without accounting a cancelled or killed
# job never looks done and job.result() hangs. Stop with stop-slurm.sh.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/slurm-env.sh"
HOST="$(hostname -s)"
NCPU="$(nproc)"
REAL_MEM=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 * 90 / 100 ))  # a bit below actual
t0="$(now)"
log() { echo "[start-slurm] $*"; }
[ "$(id -u)" = 0 ] || { log "needs root"; exit 1; }

# ------------------------------------------------------------------ packages
if [ "${INSTALL:-1}" = 1 ]; then
  missing=""
  for p in slurm-wlm munge slurmdbd mariadb-server; do
    dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    log "apt-get install$missing"
    export DEBIAN_FRONTEND=noninteractive
    [ -n "$(ls /var/lib/apt/lists/ 2>/dev/null | grep -v -e '^lock$' -e '^partial$' -e '^auxfiles$')" ] \
      || apt-get update -qq
    # stale package lists (404s) are the other reason to update; then retry once.
    # The machines' policy-rc.d keeps postinst scripts from starting any daemon.
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null \
      || { apt-get update -qq && apt-get install -y -qq $missing >/dev/null; }
  fi
fi

# Daemons from $RUN that run with other ports/config, or state of another
# cluster, would mix two clusters: refuse rather than half-restart them.
SETTINGS="ports=$CTLD_PORT-$DB_PORT conf=$CONF_DIR cluster=$CLUSTER"
for f in "$RUN"/slurmctld.pid "$RUN"/slurmd.*.pid "$RUN"/slurmdbd.pid "$RUN"/mariadbd.pid; do
  d="$(basename "$f" .pid)"; d="${d%%.*}"
  if pid_alive "$f" "$d" && [ "$(cat "$RUN/settings" 2>/dev/null)" != "$SETTINGS" ]; then
    log "$d from $RUN runs with other settings ($(cat "$RUN/settings" 2>/dev/null || echo unknown));" \
        "run stop-slurm.sh with those first, or use another POSTTRAIN_SLURM_DIR"
    exit 1
  fi
done
if [ -s "$RUN/state/clustername" ] && [ "$(cat "$RUN/state/clustername")" != "$CLUSTER" ]; then
  log "$RUN/state belongs to cluster '$(cat "$RUN/state/clustername")', not '$CLUSTER';" \
      "use another POSTTRAIN_SLURM_DIR, or PURGE=1 stop-slurm.sh"
  exit 1
fi

# Another Slurm on our ports (not started from this folder) would answer our
# clients and fight over /etc/slurm: refuse instead of rewriting its config.
# A single slurmd from an older start of this folder (slurmd.pid, before nodes had names n1..nN):
# ours, and in the way of n1's port; stop it (slurmctld restarts below as slurm.conf changes).
if pid_alive "$RUN/slurmd.pid" slurmd; then
  log "stopping the single-node slurmd of an earlier start"
  stop_pidfile slurmd "$RUN/slurmd.pid" slurmd >/dev/null
fi
node_port() { if [ "$1" = 1 ]; then echo "$SLURMD_PORT"; else echo $((CTLD_PORT + 3 + $1)); fi; }
checks=("slurmctld $CTLD_PORT slurmctld" "slurmdbd $DBD_PORT slurmdbd" "mariadbd $DB_PORT mariadbd")
for i in $(seq "$NODES"); do checks+=("slurmd $(node_port "$i") slurmd.n$i"); done
for d in "${checks[@]}"; do
  set -- $d
  if port_open "$2" && ! pid_alive "$RUN/$3.pid" "$1"; then
    log "port $2 is taken by a $1 (or other process) not started from $RUN;" \
        "stop it or choose other ports with POSTTRAIN_SLURM_PORT"
    exit 1
  fi
done

# Pitfall: an empty state folder restarts job ids at 1 while the accounting DB
# keeps its rows, so `sacct` (and submitit) would report old jobs' states for new
# jobs with the same ids. Both live under $RUN and go together (stop-slurm.sh
# PURGE=1); if only the state went, the DB is dropped below.
FRESH_STATE=0
[ -n "$(ls -A "$RUN/state" 2>/dev/null)" ] || FRESH_STATE=1
mkdir -p "$RUN"/{state,spool,log} "$DB_DIR"
for i in $(seq "$NODES"); do mkdir -p "$RUN/spool/n$i"; done   # %n: one spool per slurmd
chown slurm:slurm "$RUN" "$RUN"/{state,spool,log} "$RUN"/spool/n*
chown mysql:mysql "$DB_DIR"
chmod 755 "$RUN"
echo "$SETTINGS" > "$RUN/settings"

# ------------------------------------------------------------------ munge
mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key
fi
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  cp /run/munge/munged.pid "$RUN/munged.pid"   # recorded only when we started it
fi
munge_ok || { log "munge does not work"; exit 1; }

# ------------------------------------------------------------------ slurm.conf
NODE_LINES=""
for i in $(seq "$NODES"); do
  NODE_LINES="${NODE_LINES}NodeName=n$i NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=$(node_port "$i") CPUs=${NCPU} RealMemory=${REAL_MEM} State=UNKNOWN
"
done
NODE_LINES="${NODE_LINES%$'\n'}"
if [ "${PREEMPT:-0}" = 1 ]; then
  # 22.05 takes preempt_send_user_signal only under SlurmctldParameters
  # (PreemptParameters= is an unknown key there and kills the daemons)
  PREEMPT_LINES="PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal"
  PART_LINES="PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=30
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"
else
  PREEMPT_LINES="PreemptType=preempt/none"
  PART_LINES="PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
fi
mkdir -p "$CONF_DIR"
CONF="$(cat <<CONF
# written by posttrain scripts/services/start-slurm.sh
ClusterName=${CLUSTER}
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
AuthInfo=cred_expire=10
CryptoType=crypto/munge
# several slurmd on one host, each given the whole host (see NODE_LINES)
SlurmdParameters=config_overrides
# bind to what the host name resolves to (loopback here), not to every address
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
StateSaveLocation=${RUN}/state
SlurmdSpoolDir=${RUN}/spool/%n
SlurmctldPidFile=${RUN}/slurmctld.pid
SlurmdPidFile=${RUN}/slurmd.%n.pid
SlurmctldLogFile=${RUN}/log/slurmctld.log
SlurmdLogFile=${RUN}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
# the default 60 s leaves pending jobs waiting for the main scheduler loop
SchedulerParameters=sched_interval=2
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
JobRequeue=1
JobCompType=jobcomp/none
${PREEMPT_LINES}
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=${DBD_PORT}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
${NODE_LINES}
${PART_LINES}
CONF
)"
conf_changed=0
if [ ! -f "$SLURM_CONF" ] || [ "$(cat "$SLURM_CONF")" != "$CONF" ]; then
  printf '%s\n' "$CONF" > "$SLURM_CONF"
  conf_changed=1
fi
chmod 644 "$SLURM_CONF"

# ------------------------------------------------------------------ MariaDB (own instance)
if ! db_ok; then
  log "starting mariadbd"
  [ -d "$DB_DIR/data/mysql" ] || mariadb-install-db --no-defaults --user=mysql \
      --datadir="$DB_DIR/data" --auth-root-authentication-method=socket --skip-test-db >/dev/null
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB_DIR/data" \
      --socket="$DB_SOCK" --pid-file="$DB_DIR/mariadbd.pid" \
      --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
      --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
      </dev/null >>"$RUN/log/mariadb.log" 2>&1 &
  echo $! > "$RUN/mariadbd.pid"
  for _ in $(seq 150); do db_ok && break; sleep 0.2; done
  db_ok || { log "mariadbd did not come up; see $RUN/log/mariadb.log"; exit 1; }
fi
if [ "$FRESH_STATE" = 1 ]; then
  stop_pidfile slurmdbd "$RUN/slurmdbd.pid" slurmdbd >/dev/null
  db -e 'DROP DATABASE IF EXISTS slurm_acct_db'
fi
db <<'SQL'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL

# ------------------------------------------------------------------ slurmdbd
DBD_CONF="$(cat <<DBD
AuthType=auth/munge
DbdHost=localhost
DbdPort=${DBD_PORT}
CommunicationParameters=NoInAddrAny
SlurmUser=slurm
LogFile=${RUN}/log/slurmdbd.log
PidFile=${RUN}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=${DB_PORT}
StorageUser=slurm
StoragePass=slurmpass
StorageLoc=slurm_acct_db
DBD
)"
if [ ! -f "$CONF_DIR/slurmdbd.conf" ] || [ "$(cat "$CONF_DIR/slurmdbd.conf")" != "$DBD_CONF" ]; then
  printf '%s\n' "$DBD_CONF" > "$CONF_DIR/slurmdbd.conf"
  stop_pidfile slurmdbd "$RUN/slurmdbd.pid" slurmdbd >/dev/null
fi
chown slurm:slurm "$CONF_DIR/slurmdbd.conf"; chmod 600 "$CONF_DIR/slurmdbd.conf"
if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd; then
  log "starting slurmdbd"
  /usr/sbin/slurmdbd
  for _ in $(seq 100); do port_open "$DBD_PORT" && break; sleep 0.2; done
fi
# the cluster must exist in the DB before slurmctld registers
if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# ------------------------------------------------------------------ slurmctld + slurmd
if [ "$conf_changed" = 1 ]; then   # plugin changes need a restart, not `scontrol reconfigure`
  for f in "$RUN"/slurmd.pid "$RUN"/slurmd.*.pid "$RUN"/slurmctld.pid; do
    [ -e "$f" ] || continue
    d="$(basename "$f" .pid)"; d="${d%%.*}"
    if pid_alive "$f" "$d"; then
      log "slurm.conf changed: restarting $(basename "$f" .pid)"
      stop_pidfile "$d" "$f" "$d" >/dev/null
    fi
  done
fi
if ! pid_alive "$RUN/slurmctld.pid" slurmctld; then
  log "starting slurmctld"
  /usr/sbin/slurmctld -i   # -i: ignore unreadable state files
fi
for i in $(seq "$NODES"); do
  if ! pid_alive "$RUN/slurmd.n$i.pid" slurmd; then
    log "starting slurmd -N n$i"
    /usr/sbin/slurmd -N "n$i"
  fi
done

# ------------------------------------------------------------------ readiness
node_up() {  # idle/mixed/allocated; a down or drained node (left from an earlier run) is resumed
  local st=""
  for _ in $(seq 150); do
    st="$(sinfo -h -n "$1" -o %T 2>/dev/null || true)"
    case "$st" in idle*|mixed*|allocated*) return 0 ;; down*|drain*) break ;; esac
    sleep 0.2
  done
  case "$st" in
    down*|drain*) scontrol update nodename="$1" state=resume || true; return 0 ;;
  esac
  log "node $1 not up (state '$st'); see $RUN/log"; return 1
}
for i in $(seq "$NODES"); do node_up "n$i" || exit 1; done
out="$(cd "$RUN" && srun -N1 -n1 -t 1 hostname 2>&1)" || { log "test srun failed: $out"; exit 1; }
if [ "$NODES" -gt 1 ]; then
  out="$(cd "$RUN" && srun -N"$NODES" --ntasks-per-node=1 -t 1 printenv SLURMD_NODENAME 2>&1)" \
    || { log "test srun on $NODES nodes failed: $out"; exit 1; }
fi
parts="$(sinfo -h -o %P | paste -sd, -)"
[ "$SLURM_CONF" = /etc/slurm/slurm.conf ] || log "clients need: export SLURM_CONF=$SLURM_CONF"
echo "SLURM READY cluster=$CLUSTER nodes=$(sinfo -h -o %N | paste -sd, -) host=$HOST partitions=$parts" \
     "(slurmctld 127.0.0.1:$CTLD_PORT pid $(cat "$RUN/slurmctld.pid")) in $(since "$t0")s"
