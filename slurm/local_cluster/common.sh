# Sourced by start.sh and stop.sh: where the localhost cluster keeps its state, and the checks on it.
#
# The root holds slurmctld's state, the node daemons' spool directories (the job scripts they run),
# the accounting database, the daemons' pid files and logs: whoever controls it controls the cluster
# (and the root processes that read it). So it is per user, and checked before use:
#
#   ROFORMER_SLURM_ROOT   (LOCAL_SLURM_DIR: the older name)   default ${TMPDIR:-/tmp}/roformer-slurm-<uid>
#
# - a missing root is created with mode 0711: only its owner lists or writes it; others may only pass
#   through, which the mysql user (its datadir) and the users whose jobs run (their batch scripts in the
#   spool directory) need;
# - an existing root must be a directory, not a symlink, owned by this user and not writable by the
#   group or others, and its parent must not let others rename it away (not group/other-writable, or
#   sticky like /tmp). Anything else is refused with a message: another local user may have created it.

# cluster_root: the root directory (absolute)
cluster_root() {
  local dir=${ROFORMER_SLURM_ROOT:-${LOCAL_SLURM_DIR:-${TMPDIR:-/tmp}/roformer-slurm-$(id -u)}}
  case $dir in /*) ;; *) dir=$PWD/$dir ;; esac
  printf '%s\n' "${dir%/}"
}

_root_refused() { # _root_refused DIR WHY
  echo "local_cluster: refusing cluster root $1: $2 (set ROFORMER_SLURM_ROOT to a directory of your own)" >&2
  return 1
}

# check_root DIR: status 1 (and the reason on stderr) when DIR is not safe to use as the cluster root
check_root() {
  local dir=$1 me uid mode parent puid pmode
  me=$(id -u)
  [ -L "$dir" ] && { _root_refused "$dir" "it is a symlink (to $(readlink "$dir"))"; return 1; }
  [ -d "$dir" ] || { _root_refused "$dir" "it is not a directory"; return 1; }
  read -r uid mode < <(stat -c '%u %a' -- "$dir")
  [ "$uid" = "$me" ] || { _root_refused "$dir" "it belongs to uid $uid, not to you (uid $me)"; return 1; }
  (( 8#$mode & 8#022 )) && { _root_refused "$dir" "it is writable by the group or others (mode $mode)"; return 1; }
  parent=$(dirname -- "$dir")
  read -r puid pmode < <(stat -L -c '%u %a' -- "$parent")
  if (( 8#$pmode & 8#022 )) && ! (( 8#$pmode & 8#1000 )); then
    _root_refused "$dir" "its parent $parent is writable by others and not sticky (mode $pmode): they could replace it"
    return 1
  fi
  return 0
}

# prepare_root DIR: create DIR (mode 0711) when missing, check it, and leave it 0711
prepare_root() {
  local dir=$1
  if [ ! -e "$dir" ] && [ ! -L "$dir" ]; then
    mkdir -p -- "$(dirname -- "$dir")"
    mkdir -m 0711 -- "$dir" 2>/dev/null || true  # lost a race: whoever made it is checked below
  fi
  check_root "$dir" || return 1
  chmod 0711 -- "$dir"
}
