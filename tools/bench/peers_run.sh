#!/usr/bin/env bash
# peers_run.sh - FanStore in the same run as its peers, with the shared peer harness.
#
# usage: tools/bench/peers_run.sh [WORKDIR]      (default /tmp/fsbench; run as root)
#
# Runs ../shared/bench/peers.sh with FanStore as its custom backend, in the same run as the
# raw directory and squashfs (squashfuse_ll, kernel), one run per FanStore codec and
# frontend (run 1 builds every image; later runs reuse them with SKIP_BUILD=1 and measure
# raw and the same-codec squashfuse_ll again, so every ratio compares rows of one run); then
# peers_table.py writes the `peers` section of docs/benchmarks.md and the rows go to
# tools/bench/results/. Each run's report and rows stay in WORKDIR/fanstore-runK.{md,jsonl}.
#
# Environment (peers.sh's own knobs pass through: N_SMALL N_LARGE LARGE_MIB SEED REPS
# WARM_REPS INSTALL SKIP_BUILD; PASS_LIMIT defaults to 120 s here instead of 30):
#   PEERS_SH        [<repo>/../shared/bench/peers.sh]
#   PEER_BACKENDS   [raw sqfs-zstd3-kernel sqfs-zstd3-squashfuse_ll sqfs-lz4-squashfuse_ll]
#   FANSTORE_CODECS ["zstd:3 lz4"]   FanStore codecs
#   FANSTORE_FRONTENDS ["kernel pyfuse3"]  FUSE frontends (fanstore mount --frontend); one
#                   FanStore backend per codec and frontend: fanstore-zstd3-kernel, ...
#   PARTITIONS      [8]              fanstore pack --partitions
#   FANSTORE        [<repo>/.venv/bin/fanstore]
#   LABEL           note at the top of the docs section (default: a "smoke run" warning when
#                   the dataset or the repetitions are smaller than the peers' full run)
#   DOCS            [<repo>/docs/benchmarks.md]   NO_DOCS=1: leave docs and results alone
#
# Full run (20,000 files + 8 x 256 MiB, 3 reps): about 25-30 min on this machine.
# Smoke run: N_SMALL=2000 N_LARGE=1 LARGE_MIB=64 REPS=1 WARM_REPS=1 \
#            PEER_BACKENDS="raw sqfs-zstd3-squashfuse_ll" FANSTORE_CODECS="zstd:3" \
#            tools/bench/peers_run.sh /tmp/fsbench-smoke
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${1:-/tmp/fsbench}
PEERS_SH=${PEERS_SH:-$(cd "$REPO/.." && pwd)/shared/bench/peers.sh}
PEER_BACKENDS=${PEER_BACKENDS:-raw sqfs-zstd3-kernel sqfs-zstd3-squashfuse_ll sqfs-lz4-squashfuse_ll}
FANSTORE_CODECS=${FANSTORE_CODECS:-zstd:3 lz4}
FANSTORE_FRONTENDS=${FANSTORE_FRONTENDS:-kernel pyfuse3}
PARTITIONS=${PARTITIONS:-8}
FANSTORE=${FANSTORE:-$REPO/.venv/bin/fanstore}
PY=$REPO/.venv/bin/python
DOCS=${DOCS:-$REPO/docs/benchmarks.md}
NO_DOCS=${NO_DOCS:-0}
RESULTS=$REPO/tools/bench/results
LABEL=${LABEL:-}
N_SMALL=${N_SMALL:-20000} N_LARGE=${N_LARGE:-8} LARGE_MIB=${LARGE_MIB:-256}
REPS=${REPS:-3} WARM_REPS=${WARM_REPS:-3}
# peers.sh cuts a pass off after PASS_LIMIT s (default 30) and reports the partial rate; a
# cold 20,000-file FanStore pass with 1 reader can take longer than that on a busy machine,
# so give every backend more room (fast backends never get near it).
PASS_LIMIT=${PASS_LIMIT:-120}
export N_SMALL N_LARGE LARGE_MIB REPS WARM_REPS PASS_LIMIT

log() { printf '[%s] peers_run: %s\n' "$(date +%T)" "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "peers_run.sh: run as root (mounts, drop_caches)" >&2; exit 1; }
[ -x "$PEERS_SH" ] || { echo "peers_run.sh: no peer harness at $PEERS_SH (set PEERS_SH)" >&2; exit 1; }
[ -x "$FANSTORE" ] || { echo "peers_run.sh: no fanstore command at $FANSTORE (make setup)" >&2; exit 1; }
mkdir -p "$WORK/mnt"

# Whatever happens (error, Ctrl-C), nothing stays mounted under WORKDIR/mnt. peers.sh cleans
# up after itself too; this catches a FanStore daemon it might miss.
cleanup() {
    local m
    for m in "$WORK"/mnt/*; do
        [ -d "$m" ] || continue
        if mountpoint -q "$m"; then
            log "cleanup: unmounting $m"
            "$FANSTORE" umount "$m" >/dev/null 2>&1 || fusermount3 -u -z -- "$m" 2>/dev/null || umount -l -- "$m" 2>/dev/null || true
        fi
    done
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# peers.sh reads its umount command as ${CUSTOM_UMOUNT:-fusermount -u {mnt}}: bash ends that
# expansion at the first '}', so a literal '}' is appended to any CUSTOM_UMOUNT that is set
# ("fanstore umount /x/mnt}" then fails and the mount stays). The trailing ' #' turns the
# stray brace into a comment.
name_of() { printf 'fanstore-%s-%s' "${1//:/}" "$2"; }  # zstd:3 kernel -> fanstore-zstd3-kernel
peer_tag() { case $1 in zstd:3) echo zstd3 ;; lz4) echo lz4 ;; *) echo "" ;; esac; }

T0=$(date +%s)
RUN_FILES=()
k=0
VARIANTS=()
for codec in $FANSTORE_CODECS; do
    for frontend in $FANSTORE_FRONTENDS; do VARIANTS+=("$codec $frontend"); done
done
for variant in "${VARIANTS[@]}"; do
    read -r codec frontend <<<"$variant"
    k=$((k + 1))
    name=$(name_of "$codec" "$frontend")
    tag=$(peer_tag "$codec")
    if [ "$k" = 1 ]; then
        # FanStore right after its same-codec squashfuse_ll peer (drift hits neighbours alike)
        backends=""
        placed=0
        for b in $PEER_BACKENDS; do
            backends="$backends $b"
            if [ -n "$tag" ] && [ "$b" = "sqfs-$tag-squashfuse_ll" ]; then backends="$backends $name"; placed=1; fi
        done
        [ "$placed" = 1 ] || backends="$backends $name"
        skip=${SKIP_BUILD:-0}
    else
        backends="raw"
        if [ -n "$tag" ]; then backends="$backends sqfs-$tag-squashfuse_ll"; fi
        backends="$backends $name"
        skip=1
        if [ "${SKIP_BUILD:-0}" != 1 ]; then
            # reuse only what run 1 of THIS invocation built; anything older is rebuilt
            rm -rf "$WORK/img/$name"
            if [ -n "$tag" ] && [[ " $run1_backends " != *" sqfs-$tag-"* ]]; then
                rm -f "$WORK/img/data-$tag.sqfs"
            fi
        fi
    fi
    [ "$k" = 1 ] && run1_backends=$backends
    backends=${backends# }
    md=$WORK/fanstore-run$k.md
    merge=""
    for f in "${RUN_FILES[@]}"; do merge="$merge $f"; done
    log "run $k: BACKENDS=\"$backends\" (SKIP_BUILD=$skip)"
    BACKENDS="$backends" SKIP_BUILD="$skip" \
    CUSTOM_NAME="$name" \
    CUSTOM_BUILD="$FANSTORE pack {data} {img}/$name --codec $codec --partitions $PARTITIONS --jobs $(nproc) --no-progress --force" \
    CUSTOM_ARTIFACT="{img}/$name" \
    CUSTOM_MOUNT="$FANSTORE mount {img}/$name {mnt} --frontend $frontend" \
    CUSTOM_UMOUNT="$FANSTORE umount {mnt} #" \
    MERGE_RESULTS="${merge# }" RESULTS_MD="$md" \
        "$PEERS_SH" "$WORK"
    # keep each run's command log next to its rows (peers.sh rewrites commands.txt every run),
    # headed by the exact peers.sh invocation
    {
        echo "# peers.sh invocation:"
        echo "#   BACKENDS=\"$backends\" SKIP_BUILD=$skip N_SMALL=$N_SMALL N_LARGE=$N_LARGE LARGE_MIB=$LARGE_MIB REPS=$REPS WARM_REPS=$WARM_REPS \\"
        echo "#   CUSTOM_NAME=$name CUSTOM_BUILD='$FANSTORE pack {data} {img}/$name --codec $codec --partitions $PARTITIONS --jobs $(nproc) --no-progress --force' \\"
        echo "#   CUSTOM_ARTIFACT='{img}/$name' CUSTOM_MOUNT='$FANSTORE mount {img}/$name {mnt} --frontend $frontend' CUSTOM_UMOUNT='$FANSTORE umount {mnt} #' \\"
        echo "#   $PEERS_SH $WORK"
        cat "$WORK/commands.txt"
    } >"$WORK/fanstore-run$k.commands.txt"
    RUN_FILES+=("$WORK/fanstore-run$k.jsonl")
done
T_TOTAL=$(($(date +%s) - T0))
log "all runs done in ${T_TOTAL}s"

if [ "$NO_DOCS" = 1 ]; then
    "$PY" "$HERE/peers_table.py" --work "$WORK" "${RUN_FILES[@]/#/--run=}" \
        --total-seconds "$T_TOTAL" --label "$LABEL" --stdout
    exit 0
fi
mkdir -p "$RESULTS"
rm -f "$RESULTS"/peers-run*.jsonl "$RESULTS"/peers-run*.commands.txt
i=0
for f in "${RUN_FILES[@]}"; do
    i=$((i + 1))
    cp "$f" "$RESULTS/peers-run$i.jsonl"
    cp "${f%.jsonl}.commands.txt" "$RESULTS/peers-run$i.commands.txt"
done
"$PY" "$HERE/peers_table.py" --work "$WORK" "${RUN_FILES[@]/#/--run=}" \
    --total-seconds "$T_TOTAL" --label "$LABEL" --docs "$DOCS"
log "wrote the peers section of $DOCS; rows in $RESULTS/peers-run*.jsonl"
