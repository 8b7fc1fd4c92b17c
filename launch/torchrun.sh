#!/usr/bin/env bash
# Train a recipe on one node with torchrun (TP/EP/DP over the node's GPUs, or gloo on CPU).
#
#   launch/torchrun.sh RECIPE [section.field=value ...] [--resume]
#
#   launch/torchrun.sh recipes/tiny_ep2.yaml                              # 2 processes (EP=2, DP=2)
#   launch/torchrun.sh recipes/tiny_ep2.yaml train.sft_steps=3 train.out_dir=/tmp/r
#   NPROC=8 launch/torchrun.sh recipes/cluster/qwen3_moe_small_1node.yaml --resume
#
# Environment:
#   NPROC    processes (default: the recipe's world size, tensor x pipeline x data parallel).
#            A value that does not match the recipe's layout fails here, before torchrun starts.
#   PYTHON   interpreter with moe-rl installed (default: <repo>/.venv/bin/python, else python3).
#
# Logs: the console output (each worker line prefixed with its global rank, "[rank1]:") is
# also appended to <train.out_dir>/logs/torchrun-<date>-<pid>.log, and torchrun keeps each
# rank's stdout/stderr under <train.out_dir>/logs/torchrun-<date>-<pid>/.
# Exit status: torchrun's; 2 for a configuration error (the message names the field and the fix).
set -euo pipefail

usage() {
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit "${1:-2}"
}
[[ $# -ge 1 ]] || usage
[[ "$1" == "-h" || "$1" == "--help" ]] && usage 0
RECIPE="$1"
shift

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

# Validate the recipe (and NPROC against its layout) before any process starts; print
# "<world size> <out_dir>". Overrides are the arguments that are not flags (--resume).
PREFLIGHT='
import sys
from moe_rl.config import ConfigError, load_recipe
try:
    r = load_recipe(sys.argv[1], [a for a in sys.argv[3:] if not a.startswith("--")])
    if sys.argv[2]:
        from moe_rl.megatron.parallel import check_world
        check_world(r.parallel, int(sys.argv[2]))
except ConfigError as e:
    sys.exit(f"moe-rl: configuration error: {e}")
print(r.parallel.world_size, r.train.out_dir)
'
if [[ -n "${NPROC:-}" && ! "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "torchrun.sh: NPROC=$NPROC must be a positive integer" >&2
    exit 2
fi
info="$("$PYTHON" -c "$PREFLIGHT" "$RECIPE" "${NPROC:-}" "$@")" || exit 2
read -r WORLD OUT_DIR <<<"$info"
NPROC="${NPROC:-$WORLD}"

STAMP="torchrun-$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$OUT_DIR/logs"
LOG="$OUT_DIR/logs/$STAMP.log"
echo "torchrun.sh: $NPROC processes, recipe $RECIPE, log $LOG" | tee -a "$LOG" >&2

# shellcheck disable=SC2016  # a template torchrun fills in, not a shell expansion
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'
# torchrun sets 1 thread per process when OMP_NUM_THREADS is unset, and prints a banner saying so:
# set the same here, quietly (a value of yours wins)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torchrun runs in the background so that this script can forward a signal sent to it alone
# (SIGTERM, SIGINT; SIGHUP, a closed terminal, as SIGTERM) and, whoever got the signal, wait
# until torchrun and its workers have ended: they write a stop checkpoint first, and whatever
# runs after this script must not see the run finished before its save is. The log's tee
# ignores the signals, so a signal to the whole process group cannot cut the workers' output,
# and the script waits for it too: a bare `wait` does not wait for a process substitution.
set +e
exec {log_fd}> >(trap '' TERM INT HUP; exec tee -a "$LOG")
tee_pid=${!:-} # bash < 4.4 may leave $! unset for a process substitution: then no wait for it
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    --log-dir "$OUT_DIR/logs/$STAMP" --tee 3 \
    -m moe_rl.cli train "$RECIPE" "$@" >&"$log_fd" 2>&1 {log_fd}>&- &
child=$!
exec {log_fd}>&- # the tee ends once torchrun and its workers have closed their output
got=0
forward() {
    got=$1
    kill -s "$2" "$child" 2>/dev/null
}
trap 'forward 143 TERM' TERM
trap 'forward 143 TERM' HUP
trap 'forward 130 INT' INT
while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break # else wait was cut short by a trapped signal
done
# the tee, writing the last lines (30 s at most: a process a worker left behind may hold the pipe)
for _ in $(seq 300); do
    [[ -n $tee_pid ]] && kill -0 "$tee_pid" 2>/dev/null || break
    sleep 0.1
done
# stopped by a signal: 128 + its number (the trainer's convention), after the workers' save
if [[ $got -ne 0 && $rc -ne 0 ]]; then rc=$got; fi
exit "$rc"
