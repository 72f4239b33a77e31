#!/usr/bin/env bash
# Idempotently stop the localhost SLURM cluster started by start.sh (one node or two, whichever runs).
# Usage: slurm/local_cluster/stop.sh [--purge]   (--purge also deletes job state, logs and the accounting DB;
# job ids then start again from 1, so use a fresh submitit folder / run_dir afterwards)
# Processes are stopped by the pids in their pid files (SIGTERM, then SIGKILL after 15 s). The state
# directory is the running cluster's: the one /etc/slurm/slurm.conf names when start.sh wrote it (also
# a cluster an older start.sh kept in /tmp/roformer-slurm), else $ROFORMER_SLURM_ROOT/state
# (common.sh; default ${TMPDIR:-/tmp}/roformer-slurm-<uid>). --purge checks that root as start.sh does.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"

CONF=/etc/slurm/slurm.conf
STATE=$(cluster_root)/state
if head -n 1 "$CONF" 2>/dev/null | grep -q '^# Written by slurm/local_cluster/start.sh'; then
  conf_state=$(sed -n 's|^StateSaveLocation=\(.*\)/ctld$|\1|p' "$CONF" | head -n 1)
  STATE=${conf_state:-$STATE}
fi
MYSOCK=/run/mysqld/mysqld.sock
log() { echo "[local_cluster/stop $(date +%T)] $*"; }
pid_of() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null && [ "$(cat /proc/"$(cat "$1")"/comm 2>/dev/null)" = "$2" ] && cat "$1"; }
stop_pid() { # stop_pid NAME PID : SIGTERM, wait 15 s, then SIGKILL
  local name=$1 pid=$2
  [ -n "$pid" ] || return 0
  log "stopping $name (pid $pid)"
  kill "$pid" 2>/dev/null
  for _ in $(seq 75); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  log "$name did not exit, SIGKILL"; kill -9 "$pid" 2>/dev/null
}
slurmd_pids() { for f in "$STATE"/slurmd-*.pid "$STATE"/slurmd.pid; do [ -e "$f" ] && pid_of "$f" slurmd; done; true; }

CTLD=$(pid_of "$STATE/slurmctld.pid" slurmctld)
SLURMDS=$(slurmd_pids)
if [ -n "$CTLD" ] && scontrol ping >/dev/null 2>&1; then
  jobs=$(squeue -h -o %A | sort -u)
  if [ -n "$jobs" ]; then
    log "cancelling jobs: $(echo $jobs)"; scancel $jobs
    for _ in $(seq 150); do [ -z "$(squeue -h -o %A)" ] && break; sleep 0.2; done
  fi
  log "scontrol shutdown"; scontrol shutdown >/dev/null 2>&1
  for _ in $(seq 100); do
    left=0; for p in $CTLD $SLURMDS; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left = 0 ] && break; sleep 0.2
  done
fi
stop_pid slurmctld "$(pid_of "$STATE/slurmctld.pid" slurmctld)"
for p in $(slurmd_pids); do stop_pid slurmd "$p"; done
# job steps left behind by a killed slurmd (slurmstepd re-parents to init; only ours run on this machine)
for pid in $(pgrep -x slurmstepd); do stop_pid slurmstepd "$pid"; done

stop_pid slurmdbd "$(pid_of "$STATE/slurmdbd.pid" slurmdbd)"
MPID=$(pid_of "$STATE/mysql/mariadb.pid" mariadbd)
if [ -n "$MPID" ]; then
  log "stopping mariadbd (pid $MPID)"
  mariadb-admin --socket=$MYSOCK shutdown >/dev/null 2>&1 || stop_pid mariadbd "$MPID"
  for _ in $(seq 75); do kill -0 "$MPID" 2>/dev/null || break; sleep 0.2; done
fi
stop_pid munged "$(pid_of /run/munge/munged.pid munged)"

if [ "${1:-}" = "--purge" ]; then
  if check_root "$(dirname -- "$STATE")"; then
    log "purging $STATE"; rm -rf -- "$STATE"
  else
    log "not purging $STATE"; exit 1
  fi
fi
left=$(for n in slurmctld slurmd slurmstepd slurmdbd mariadbd munged; do pgrep -a -x $n; done)
[ -n "$left" ] && { log "WARNING, still running:"; echo "$left"; exit 1; }
log "cluster stopped"
exit 0
