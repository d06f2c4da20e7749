#!/usr/bin/env bash
# Resume prologue: before a (requeued) training job trains, assemble the newest copy of
# every layer in its save dir into one checkpoint with `mpitailor recover` on MPI ranks,
# and say where training resumes from.
#
#   bash slurm/resume-prologue.sh [SAVE_DIR [OUT_PARENT]]
#
# SAVE_DIR     the training's save dir (full and partial checkpoints); else $MPITAILOR_SAVE_DIR
# OUT_PARENT   where recovered-step<N>/ goes (default: SAVE_DIR's parent; never inside
#              SAVE_DIR, where it would look like one more checkpoint to the next recovery)
#
# stdout is one line, MPITAILOR_RESUME_FROM=<dir> (empty: start from scratch); the same
# path (or an empty line) goes to $MPITAILOR_RESUME_FILE (default OUT_PARENT/resume-from),
# which is absent after a failure. Logs go to stderr. Exit 0: resume from that dir, or no
# save ever finished (nothing to resume); 1: saves exist but recovery failed (never read as
# "start from scratch"); 2: bad arguments.
#
# Run twice, it reuses the first result: recovered-step<N> is named after the newest save
# and mpitailor publishes it with one rename, so it is either complete or absent (a merge
# killed half-way leaves a hidden staging dir that the next one reclaims).
#
# Several nodes (a batch script of a job with SLURM_JOB_NUM_NODES > 1): the save dir may be
# node-local (DeepSpeed's use_node_local_storage: each node holds only its ranks' files, on a
# disk the other nodes cannot see, at the same path). Then everything that reads the saves
# runs as srun steps over all of the job's nodes: the recovery plan (one MPI rank per node),
# the merge (one MPI job over all the job's tasks, laid out as the training's: srun's defaults
# in the job, the same ranks per node; each node reads its own files, the rest moves over
# MPI, and each node gets its ranks' part of the composite at OUT_PARENT/recovered-step<N>, on
# its own disk when OUT_PARENT is node-local), and the check that an earlier recovery is
# complete on every node. The batch host (the job's first node, which holds DeepSpeed rank
# 0's files and `latest`) does the rest. A requeued job must come back on the nodes that
# hold the saves (sbatch --nodelist).
#
# MPITAILOR_WORLD_SIZE   ranks of the training that resumes (default: $SLURM_NTASKS in a job,
#                        else the saves' own): the composite is written for that many, so a
#                        job requeued on another number of GPUs resumes as it is; it is
#                        named recovered-step<N>-w<W> then
# MPITAILOR_KEEP_LAST    after a recovery, `mpitailor prune SAVE_DIR --keep-last K
#                        --composites OUT_PARENT`: what the new composite no longer needs goes
#                        (older chains, superseded saves, older recovered-step* dirs); unset:
#                        nothing is deleted. One node only (node-local saves: prune in-job)
# MPITAILOR_NODES        nodes of the job (default: $SLURM_JOB_NUM_NODES in a job, else 1);
#                        1 plans and checks on this host alone, as on one node
# MPITAILOR_PYTHON       python with mpitailor installed (default: python)
# MPITAILOR_MERGE_RANKS  MPI ranks of the merge (default 2; on several nodes the job's
#                        $SLURM_NTASKS; the job needs --ntasks >= this)
# MPITAILOR_LAUNCH       launcher (default: srun --mpi=pmi2 -n $MPITAILOR_MERGE_RANKS). As the
#                        first step of a batch script, srun runs in the job's allocation.
#                        From a Slurm Prolog (root, before the job starts: no job steps and
#                        none of the job's environment), use a node-local launcher such as
#                        the venv's `mpiexec -n 2` and pass SAVE_DIR explicitly.
set -euo pipefail

PY=${MPITAILOR_PYTHON:-python}
NODES=${MPITAILOR_NODES:-1}
if [[ -z ${MPITAILOR_NODES:-} && -n ${SLURM_JOB_ID:-} ]]; then
    NODES=${SLURM_JOB_NUM_NODES:-1}
fi
[[ $NODES =~ ^[1-9][0-9]*$ ]] \
    || { echo "resume-prologue: MPITAILOR_NODES=$NODES is not a node count" >&2; exit 2; }
if ((NODES > 1)); then
    RANKS=${MPITAILOR_MERGE_RANKS:-${SLURM_NTASKS:-$NODES}}
else
    RANKS=${MPITAILOR_MERGE_RANKS:-2}
fi
LAUNCH=${MPITAILOR_LAUNCH:-srun --mpi=pmi2 -n $RANKS}
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    HINT="inside a job, --ntasks must be at least MPITAILOR_MERGE_RANKS=$RANKS"
else
    HINT="outside a Slurm job, set MPITAILOR_LAUNCH to a launcher that runs here, e.g. MPITAILOR_LAUNCH='mpiexec -n 2'"
fi
WORLD=${MPITAILOR_WORLD_SIZE:-}
if [[ -z $WORLD && -n ${SLURM_JOB_ID:-} ]]; then
    WORLD=${SLURM_NTASKS:-}
fi
[[ -z $WORLD || $WORLD =~ ^[1-9][0-9]*$ ]] \
    || { echo "resume-prologue: MPITAILOR_WORLD_SIZE=$WORLD is not a number of ranks" >&2; exit 2; }
KEEP=${MPITAILOR_KEEP_LAST:-}
[[ -z $KEEP || $KEEP =~ ^[0-9]+$ ]] \
    || { echo "resume-prologue: MPITAILOR_KEEP_LAST=$KEEP is not a count of saves" >&2; exit 2; }

log() { printf '%s resume-prologue: %s\n' "$(date '+%F %T')" "$*" >&2; }
fail() { log "error: $2"; exit "$1"; }

# Retention once the composite is there (MPITAILOR_KEEP_LAST): a failure to prune is said,
# never a failed prologue (the job can resume all the same).
retain() {
    [[ -n $KEEP ]] || return 0
    if ((NODES > 1)); then
        log "not pruning: node-local saves on $NODES nodes (prune in the job: keep_last=)"
        return 0
    fi
    "$PY" -m mpitailor prune "$SAVE_DIR" --keep-last "$KEEP" --composites "$OUT_PARENT" >&2 \
        || log "warning: mpitailor prune exited $? (nothing else changes: resuming all the same)"
}

# Atomic write of the resume file, then the stdout line (an empty path: nothing to resume).
announce() {
    printf '%s\n' "$1" >"$RESUME_FILE.tmp"
    mv "$RESUME_FILE.tmp" "$RESUME_FILE"
    echo "MPITAILOR_RESUME_FROM=$1"
}

# Complete (manifest and latest, both written last) and assembled from this newest save:
# the same path and, where the save records one, the same save id (a tag rewritten after a
# rollback is another save under the same name). On several nodes, also complete on every
# node of the job (each node's part is published on it; a node whose part is missing would
# fail the resume).
is_recovery_of() {
    [[ -f $1/mpitailor_manifest.json && -f $1/latest ]] || return 1
    # ... written for the world size this job resumes at (without one: the saves' own).
    # The save id from the save's own record (a partial save's manifest, or the record beside
    # a full save's files; in an HF checkpoint-N/, in the tag dir its `latest` names), as
    # read_meta finds it, but reading no rank files: on a node that holds only its own
    # ranks' files (node-local storage) read_meta would refuse the save.
    # Exit 3: not a recovery of this save; any other failure is the check's own (mpitailor
    # missing from $PY, the save's record unreadable), said rather than taken for a "no".
    local rc=0
    "$PY" -c 'import json, sys
from pathlib import Path
from mpitailor.formats.zero import PARTIAL_MANIFEST, read_latest, read_save_record
try:
    m = json.load(open(sys.argv[1] + "/mpitailor_manifest.json"))
    base = m["sources"][m["base"]]
    made = (base["path"], m["world_size"], m["source_world_size"], base.get("save_id"))
except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
    sys.exit(3)  # no manifest of a recovery there
tag = save = Path(sys.argv[2])
if not (save / PARTIAL_MANIFEST).is_file() and (save / "latest").is_file():
    tag = save / read_latest(save / "latest")
lineage = read_save_record(tag, (tag / PARTIAL_MANIFEST).is_file())[0]
world = int(sys.argv[3]) if sys.argv[3] else made[2]
# (the manifest names the tag dir: in an HF or Accelerate checkpoint-N/, the one inside it)
sys.exit(3 if made[0] not in (sys.argv[2], str(tag)) or made[1] != world
         or made[3] != (lineage.save_id if lineage else None) else 0)' \
        "$1" "$2" "$WORLD" || rc=$?
    ((rc == 3)) && return 1
    ((rc == 0)) || fail 1 "cannot tell whether $1 is a recovery of $2: the check exited $rc (see the error above)"
    ((NODES == 1)) && return 0
    srun --mpi=none -N "$NODES" -n "$NODES" --ntasks-per-node=1 \
        sh -c 'test -f "$1/mpitailor_manifest.json" && test -f "$1/latest"' sh "$1" 2>/dev/null
}

# Exists here; on several nodes, on any node of the job (a node-local part left behind).
exists() {
    [[ -e $1 ]] && return 0
    ((NODES == 1)) && return 1
    [[ -n $(srun --mpi=none -N "$NODES" -n "$NODES" --ntasks-per-node=1 \
            sh -c 'test -e "$1" && echo y' sh "$1" 2>/dev/null) ]]
}

SAVE_DIR=${1:-${MPITAILOR_SAVE_DIR:-}}
[[ -n $SAVE_DIR ]] || fail 2 "no save dir: give it as the first argument or in MPITAILOR_SAVE_DIR"
SAVE_DIR=$(realpath -m "$SAVE_DIR")
OUT_PARENT=$(realpath -m "${2:-$(dirname "$SAVE_DIR")}")
[[ $OUT_PARENT/ == "$SAVE_DIR"/* ]] && fail 2 "output location $OUT_PARENT is inside the save dir $SAVE_DIR: recoveries there would be read as checkpoints"
mkdir -p "$OUT_PARENT"
RESUME_FILE=${MPITAILOR_RESUME_FILE:-$OUT_PARENT/resume-from}
rm -f "$RESUME_FILE"  # no file: this prologue failed (an earlier answer must not stand in)

log "save dir $SAVE_DIR (job ${SLURM_JOB_ID:-none}, restart ${SLURM_RESTART_COUNT:-0})"
nothing() {
    log "no checkpoint in $SAVE_DIR yet: nothing to resume from, training starts from scratch"
    announce ""
    exit 0
}
compgen -G "$SAVE_DIR/[!.]*" >/dev/null || nothing  # first start: no save dir, or empty
err=$(mktemp)
trap 'rm -f "$err"' EXIT
rc=0
if ((NODES > 1)); then
    # Node-local saves are whole only on all of the job's nodes together; one rank per node
    # will do (each lists and checks its node's files).
    log "planning on $NODES nodes: srun -N $NODES -n $NODES $PY -m mpitailor recover" \
        "--emit-recipe"
    recipe=$(srun --mpi=pmi2 -N "$NODES" -n "$NODES" --ntasks-per-node=1 \
             "$PY" -m mpitailor recover "$SAVE_DIR" --emit-recipe 2>"$err") || rc=$?
else
    recipe=$("$PY" -m mpitailor recover "$SAVE_DIR" --emit-recipe 2>"$err") || rc=$?
fi
cat "$err" >&2  # what recover skipped, and why, belongs in the job's log
# Exit 3: no save ever finished (a first start, or a first save killed half-way). Any other
# failure is an error: saves exist, and training from scratch would lose them; or SAVE_DIR
# is no save dir (a tag dir, a dir of several runs' save dirs), which recover says in one line.
((rc == 3)) && nothing
((rc == 0)) || fail 1 "cannot plan the recovery of $SAVE_DIR (recover exited $rc; see the mpitailor error above)"
base=$(sed -n 's/^base: //p' <<<"$recipe")
base_path=$(sed -n "s/^  $base: //p" <<<"$recipe")
step=${base##*[!0-9]}
[[ -n $step && -n $base_path ]] || fail 1 "no step in the recovery plan's base '$base'"
NAME=recovered-step$step${WORLD:+-w$WORLD}
OUT=$OUT_PARENT/$NAME
log "newest save is $base (step $step)${WORLD:+; recovering for world size $WORLD}"
# A recovery of another save of this step (a timeline abandoned by a rollback) stays as it
# is: this one takes the next free name.
n=1
while exists "$OUT" && ! is_recovery_of "$OUT" "$base_path"; do
    OUT=$OUT_PARENT/$NAME.$n
    n=$((n + 1))
done

if exists "$OUT"; then
    log "reusing $OUT: already recovered from $base"
    retain
    announce "$OUT"
    exit 0
fi

command -v "${LAUNCH%% *}" >/dev/null \
    || fail 2 "launcher ${LAUNCH%% *} not found ($HINT)"
log "recovering into $OUT: $LAUNCH $PY -m mpitailor recover ..."
start=$SECONDS
rc=0
# The merge's own output (summary line, errors of every rank) goes to the log stream.
$LAUNCH "$PY" -m mpitailor recover "$SAVE_DIR" -o "$OUT" --no-progress \
    ${WORLD:+--world-size "$WORLD"} >&2 || rc=$?
if ((rc != 0)); then
    # A prologue running beside this one may have published the same recovery first.
    is_recovery_of "$OUT" "$base_path" \
        || fail 1 "recover exited $rc after $((SECONDS - start)) s ($HINT)"
    log "recover exited $rc, but $OUT is complete: published by a concurrent run"
fi
is_recovery_of "$OUT" "$base_path" \
    || fail 1 "recover exited 0 but $OUT is not a complete recovery of $base_path"
log "recovered $OUT (tag $(cat "$OUT/latest")${WORLD:+, world size $WORLD}) in $((SECONDS - start)) s"
retain
announce "$OUT"
