#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/dist/test_slurm.py (run as root).
#
#   sudo launch/ci_slurm_setup.sh          # install (once), configure, start, wait for the node
#   launch/ci_slurm_setup.sh --stop        # stop slurmd, slurmctld and munged (by their pid files)
#
# Idempotent and fast on a second run: packages are installed only when missing, the
# config is rewritten (and the daemons restarted) only when it changed, daemons already
# running are left alone. Works in a container without systemd: munged, slurmctld and
# slurmd are started directly and found again through their pid files, never by name.
#
# The cluster: one node "localhost" (NodeAddr 127.0.0.1) with this machine's CPUs and
# memory, partition "debug", select/cons_tres by CPU, proctrack/linuxproc, task/none
# (no cgroups), no accounting. Every daemon binds 127.0.0.1 only (NoInAddrAny, NoCtldInAddrAny).
# Environment: SLURM_SETUP_TIMEOUT (seconds to wait for the node, default 60).
set -euo pipefail

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
SPOOL=/var/spool
LOGS=/var/log/slurm
RUN=/run/slurm
CTLD_PID="$RUN/slurmctld.pid"
SLURMD_PID="$RUN/slurmd.pid"
MUNGE_PID=/run/munge/munged.pid
NODE=localhost
TIMEOUT="${SLURM_SETUP_TIMEOUT:-60}"

say() { echo "ci_slurm_setup: $*"; }
die() { echo "ci_slurm_setup: error: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE is running
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: SIGTERM the process, wait up to 10 s
    local pid
    alive "$1" || return 0
    pid="$(cat "$1")"
    say "stopping $2 (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    die "$2 (pid $pid) did not stop"
}

if [[ "${1:-}" == "--stop" ]]; then
    stop_pidfile "$SLURMD_PID" slurmd
    stop_pidfile "$CTLD_PID" slurmctld
    stop_pidfile "$MUNGE_PID" munged
    exit 0
fi
[[ $EUID -eq 0 ]] || die "run as root (installs packages and starts slurmd as root)"

# 1. packages -----------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # policy-rc.d (present in most container images) keeps the packages from starting services
    apt-get install -y -qq --no-install-recommends slurm-wlm slurmctld slurmd slurm-client munge >/dev/null
fi

# 2. munge key and daemon -----------------------------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! alive "$MUNGE_PID"; then
    say "starting munged"
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
fi
munge -n | unmunge >/dev/null || die "munge does not work: see /var/log/munge/munged.log"

# 3. slurm.conf ---------------------------------------------------------------------------
CPUS="$(nproc --all)"
MEM_MB="$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)"   # what `free -m` reports
MEM_MB=$(( MEM_MB * 95 / 100 ))   # a margin: slurmd marks a node invalid if it has less than this
CTLD_HOST="$(uname -n | cut -d. -f1)"   # slurmctld refuses to start on a host not named here
mkdir -p "$CONF_DIR" "$SPOOL/slurmctld" "$SPOOL/slurmd" "$LOGS" "$RUN"
NEW_CONF="$(cat <<EOF
# Written by launch/ci_slurm_setup.sh: a one-node test cluster.
ClusterName=moerl-ci
SlurmctldHost=${CTLD_HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation=$SPOOL/slurmctld
SlurmdSpoolDir=$SPOOL/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=300
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
)"
RESTART=0
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$NEW_CONF" ]]; then
    say "writing $CONF"
    printf '%s\n' "$NEW_CONF" > "$CONF"
    RESTART=1
fi
if (( RESTART )); then
    stop_pidfile "$SLURMD_PID" slurmd
    stop_pidfile "$CTLD_PID" slurmctld
fi

# 4. daemons ------------------------------------------------------------------------------
if ! alive "$CTLD_PID"; then
    say "starting slurmctld"
    slurmctld -i   # -i: ignore (possibly stale) saved state
fi
if ! alive "$SLURMD_PID"; then
    say "starting slurmd"
    slurmd -N "$NODE"
fi

# 5. wait until the node is idle ----------------------------------------------------------
deadline=$(( SECONDS + TIMEOUT ))
state=""
while (( SECONDS < deadline )); do
    state="$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)"
    case "$state" in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|fail*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
done
case "$state" in
    idle|mixed|allocated|completing) ;;
    *) tail -n 20 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 || true
       die "node $NODE is '${state:-not answering}' after ${TIMEOUT}s" ;;
esac
say "ready in ${SECONDS}s: $(sinfo -h -o 'partition %P, %D node(s) %N %T' | tr '\n' ' ')"
