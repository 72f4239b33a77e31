#!/usr/bin/env bash
# Idempotently start a SLURM 22.05 cluster on localhost, without systemd, as root (Debian 12).
#
#   slurm/local_cluster/start.sh              one node named after `hostname -s`
#   slurm/local_cluster/start.sh --nodes 2    two nodes n1, n2 (two slurmd on 127.0.0.1, one Port each)
#
# munged + MariaDB + slurmdbd (so that `sacct` works: submitit and `roformer-submit status` need it)
# + slurmctld + one slurmd per node. Installs the Debian packages when they are missing. Re-running is
# safe: what runs is kept; a changed slurm.conf (e.g. another --nodes) restarts slurmctld/slurmd.
# Partitions: `debug` (default, preemptable with a 30 s grace time), `high` (higher priority tier:
# a job there preempts `debug` jobs, which are signalled and requeued; used by the preemption tests) and
# `short` (MaxTime 2 minutes: a job asking for more can never start; used by the unschedulable-job test).
# Env: ROFORMER_SLURM_ROOT (default ${TMPDIR:-/tmp}/roformer-slurm-<uid>) holds state, logs and the
# accounting DB; created 0711, refused when it is a symlink, another user's, or writable by others
# (common.sh). Stop with slurm/local_cluster/stop.sh. Facts behind the settings: docs/guides/slurm.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"

NUM_NODES=1
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) NUM_NODES=${2:?--nodes needs 1 or 2}; shift 2 ;;
    --nodes=*) NUM_NODES=${1#--nodes=}; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "start.sh: unknown argument $1 (usage: start.sh [--nodes 1|2])" >&2; exit 2 ;;
  esac
done
case $NUM_NODES in 1|2) ;; *) echo "start.sh: --nodes must be 1 or 2, got $NUM_NODES" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "start.sh: run as root" >&2; exit 1; }

BASE=$(cluster_root)
prepare_root "$BASE" || exit 1
STATE=$BASE/state
LOG=$STATE/log
CLUSTER=localcluster
HOST=$(hostname -s)
# The machine's CPUs: nproc alone honours OMP_NUM_THREADS / OMP_THREAD_LIMIT, which many cluster
# environments export; a node configured with fewer CPUs than a job's tasks never runs it.
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) * 9 / 10 ))
CONF=/etc/slurm/slurm.conf
DBDCONF=/etc/slurm/slurmdbd.conf
MYSOCK=/run/mysqld/mysqld.sock
if [ "$NUM_NODES" = 1 ]; then NODES=$HOST; else NODES="n1 n2"; fi

log() { echo "[local_cluster/start $(date +%T)] $*"; }
alive() { # alive PIDFILE COMM
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null && [ "$(cat /proc/"$(cat "$1")"/comm 2>/dev/null)" = "$2" ]
}
wait_for() { # wait_for DESCRIPTION SECONDS CMD...
  local what=$1 t=$2; shift 2
  for _ in $(seq $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  log "ERROR: timed out after ${t}s waiting for $what"; return 1
}

# 0. packages (only the missing ones)
missing=""
for p in slurmctld slurmd slurm-client munge slurmdbd mariadb-server; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "apt-get install:$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
# state: passable by the job users (the spool directories below it); its daemons' own parts: root only
install -d -m 0711 "$STATE"
install -d -m 0700 "$STATE/ctld" "$LOG"

# A cluster whose slurm.conf keeps its state elsewhere (an older start.sh used /tmp/roformer-slurm, or
# another ROFORMER_SLURM_ROOT) must be stopped first: its daemons hold the ports and its pid files
# are not in $STATE.
PREV_STATE=""  # no slurm.conf yet on a machine where the packages were just installed
[ -f "$CONF" ] && PREV_STATE=$(sed -n 's|^StateSaveLocation=\(.*\)/ctld$|\1|p' "$CONF" | head -n 1)
if [ -n "$PREV_STATE" ] && [ "$PREV_STATE" != "$STATE" ]; then
  running=""
  alive "$PREV_STATE/slurmctld.pid" slurmctld && running="$running slurmctld"
  for f in "$PREV_STATE"/slurmd-*.pid; do alive "$f" slurmd && running="$running slurmd"; done
  alive "$PREV_STATE/slurmdbd.pid" slurmdbd && running="$running slurmdbd"
  alive "$PREV_STATE/mysql/mariadb.pid" mariadbd && running="$running mariadbd"
  if [ -n "$running" ]; then
    log "ERROR: a cluster with its state in $PREV_STATE is running ($(echo $running)); stop it first with" \
        "slurm/local_cluster/stop.sh (it finds that state through $CONF), then run start.sh again"
    exit 1
  fi
fi

# 1. node names must resolve: the first node of a job becomes MASTER_ADDR
for n in $HOST $NODES; do
  getent hosts "$n" >/dev/null || { log "adding $n to /etc/hosts"; echo "127.0.0.1 $n" >> /etc/hosts; }
done

# 2. munge (refuses to run as root with the Debian-owned dirs -> run it as the munge user)
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged --force
  wait_for munged 10 sh -c 'munge -n | unmunge'
fi

# 3. slurm.conf (rewritten only when it changes)
node_lines() {
  if [ "$NUM_NODES" = 1 ]; then
    echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
  else
    # Two node daemons on one host: each needs its own Port; both see all CPUs of the machine.
    echo "NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS RealMemory=$((MEM_MB / 2)) State=UNKNOWN"
    echo "NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS RealMemory=$((MEM_MB / 2)) State=UNKNOWN"
  fi
}
new=$(mktemp)
cat > "$new" <<EOF
# Written by slurm/local_cluster/start.sh --nodes $NUM_NODES
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=5
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
$(node_lines)
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
PartitionName=short Nodes=ALL MaxTime=2 State=UP PriorityTier=1
EOF
CONF_CHANGED=0
if ! cmp -s "$new" "$CONF"; then
  log "writing $CONF ($NUM_NODES node(s): $NODES)"; install -D -m 644 "$new" "$CONF"; CONF_CHANGED=1
fi
rm -f "$new"

# 4. accounting: a private MariaDB instance + slurmdbd
if ! mariadb-admin --socket=$MYSOCK ping >/dev/null 2>&1; then
  install -d -o mysql -g mysql "$STATE/mysql" /run/mysqld
  if [ ! -d "$STATE/mysql/data/mysql" ]; then
    log "initialising MariaDB datadir"
    mariadb-install-db --user=mysql --datadir="$STATE/mysql/data" --auth-root-authentication-method=socket \
      --skip-test-db --innodb-log-file-size=16M > "$STATE/mysql/install.log" 2>&1
  fi
  log "starting mariadbd"
  # --log-error/--pid-file must be writable by the mysql user (a root-owned path made mariadbd segfault)
  setsid /usr/sbin/mariadbd --user=mysql --datadir="$STATE/mysql/data" --socket=$MYSOCK --skip-networking \
    --innodb-log-file-size=16M --pid-file="$STATE/mysql/mariadb.pid" --log-error="$STATE/mysql/mariadb.log" \
    </dev/null >/dev/null 2>&1 &
  wait_for mariadbd 30 mariadb-admin --socket=$MYSOCK ping
fi
mariadb --socket=$MYSOCK -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
new=$(mktemp)
cat > "$new" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
LogFile=$LOG/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
DebugLevel=info
EOF
DBD_CHANGED=0
cmp -s "$new" "$DBDCONF" || { install -D -m 600 "$new" "$DBDCONF"; DBD_CHANGED=1; }
rm -f "$new"
if [ "$DBD_CHANGED" = 1 ] && alive "$STATE/slurmdbd.pid" slurmdbd; then
  log "slurmdbd.conf changed: restarting slurmdbd"
  pid=$(cat "$STATE/slurmdbd.pid"); kill "$pid"
  wait_for "slurmdbd exit" 20 sh -c "! kill -0 $pid"
fi
if ! alive "$STATE/slurmdbd.pid" slurmdbd; then log "starting slurmdbd"; slurmdbd; fi
wait_for slurmdbd 30 sacctmgr -n show cluster
sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null

# 5. slurmctld + one slurmd per node
running_slurmds() { # pids of the slurmd daemons started from this state dir (any node set)
  for f in "$STATE"/slurmd-*.pid; do [ -e "$f" ] && alive "$f" slurmd && cat "$f"; done; true
}
if [ "$CONF_CHANGED" = 1 ] && { alive "$STATE/slurmctld.pid" slurmctld || [ -n "$(running_slurmds)" ]; }; then
  log "slurm.conf changed: restarting slurmctld and slurmd"
  old=$(echo $(running_slurmds) $(alive "$STATE/slurmctld.pid" slurmctld && cat "$STATE/slurmctld.pid"))
  all_gone() { for p in $old; do kill -0 "$p" 2>/dev/null && return 1; done; return 0; }
  scontrol shutdown >/dev/null 2>&1 || true
  for _ in $(seq 50); do all_gone && break; sleep 0.2; done
  # slurmds of nodes that left the config may not hear the shutdown: stop them by pid
  all_gone || { log "stopping the remaining daemons by pid"; for p in $old; do kill "$p" 2>/dev/null || true; done; }
  wait_for "slurm daemons exit" 20 all_gone
fi
if ! alive "$STATE/slurmctld.pid" slurmctld; then log "starting slurmctld"; slurmctld; fi
wait_for slurmctld 30 scontrol ping
for n in $NODES; do
  if ! alive "$STATE/slurmd-$n.pid" slurmd; then log "starting slurmd -N $n"; slurmd -N "$n"; fi
done

node_ok() { [ "$(sinfo -h -n "$1" -o %T 2>/dev/null | grep -Ec '^(idle|mixed|allocated|completing)')" -gt 0 ]; }
for n in $NODES; do
  for _ in $(seq 150); do
    node_ok "$n" && break
    if sinfo -h -n "$n" -o %T 2>/dev/null | grep -Eq 'down|drain'; then
      scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.2
  done
  node_ok "$n" || { log "ERROR: node $n not up"; sinfo -N -l; exit 1; }
done

log "cluster is up: $NUM_NODES node(s) ($(sinfo -V))"
sinfo -N
exit 0
