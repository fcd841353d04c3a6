#!/usr/bin/env bash
# run_all.sh - every FanStore benchmark, in order; what `make bench` runs (as root, ~3 h on
# a quiet machine). Steps (ONLY="step ..." runs only those): mount_bench, peers
# (peers_run.sh), mpi_bench, prefetch_bench, fuse_bench (five runs), select_accuracy,
# sources_bench, stage_bench, jpeg_bench, death_bench. Each rewrites its own section of docs/benchmarks.md and its
# rows in tools/bench/results/ (docs/benchmarks.md, "How to rerun", says what each is).
#
# Environment: MOUNT_BENCH_ARGS ["--preset full"], MOUNT_BENCH_WORK [/tmp/fanstore-bench],
# PEERS_WORK [/tmp/fsbench] (peers_run.sh's own knobs pass through), MPI_BENCH_ARGS
# ["--preset full"], MPI_BENCH_WORK [/tmp/fanstore-mpibench], PREFETCH_BENCH_ARGS
# ["--preset full"], PREFETCH_BENCH_WORK [/tmp/fanstore-prefetchbench], FUSE_BENCH_WORK
# [/tmp/fuse-bench], SELECT_ACCURACY_WORK [/tmp/select-accuracy], STAGE_BENCH_ARGS
# [--ways], STAGE_BENCH_WORK [/tmp/fanstore-stagebench], DEATH_BENCH_ARGS ["--nodes 4,16"].
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=$REPO/.venv/bin/python
ONLY=${ONLY:-mount_bench peers mpi_bench prefetch_bench fuse_bench select_accuracy sources_bench stage_bench jpeg_bench death_bench}
FUSE_WORK=${FUSE_BENCH_WORK:-/tmp/fuse-bench}
SEL_WORK=${SELECT_ACCURACY_WORK:-/tmp/select-accuracy}

[ "$(id -u)" = 0 ] || { echo "run_all.sh: run as root (mounts, drop_caches)" >&2; exit 1; }
[ -x "$PY" ] || { echo "run_all.sh: no $PY; run 'make setup' first" >&2; exit 1; }

echo "[$(date +%T)] run_all: load average $(cut -d' ' -f1-3 /proc/loadavg) (results are noisy if the machine is busy)" >&2
status=0
for step in $ONLY; do
    case $step in
    mount_bench)
        echo "[$(date +%T)] run_all: mount_bench" >&2
        # shellcheck disable=SC2086
        "$PY" "$HERE/mount_bench.py" ${MOUNT_BENCH_ARGS:---preset full} \
            --work "${MOUNT_BENCH_WORK:-/tmp/fanstore-bench}" || status=$?
        ;;
    peers)
        echo "[$(date +%T)] run_all: peers_run" >&2
        bash "$HERE/peers_run.sh" "${PEERS_WORK:-/tmp/fsbench}" || status=$?
        ;;
    mpi_bench)
        echo "[$(date +%T)] run_all: mpi_bench" >&2
        # shellcheck disable=SC2086
        "$PY" "$HERE/mpi_bench.py" ${MPI_BENCH_ARGS:---preset full} \
            --work "${MPI_BENCH_WORK:-/tmp/fanstore-mpibench}" || status=$?
        ;;
    prefetch_bench)
        echo "[$(date +%T)] run_all: prefetch_bench" >&2
        # shellcheck disable=SC2086
        "$PY" "$HERE/prefetch_bench.py" ${PREFETCH_BENCH_ARGS:---preset full} \
            --work "${PREFETCH_BENCH_WORK:-/tmp/fanstore-prefetchbench}" || status=$?
        ;;
    fuse_bench)
        echo "[$(date +%T)] run_all: fuse_bench" >&2
        "$PY" "$HERE/fuse_bench.py" --preset peers --work "$FUSE_WORK" \
            --backends raw,squashfuse_ll,pyfuse3,kernel || status=$?
        "$PY" "$HERE/fuse_bench.py" --preset peers --work "$FUSE_WORK" \
            --backends kernel-w1,kernel-w2 --passes read --section fuse_bench-peers-workers \
            || status=$?
        "$PY" "$HERE/fuse_bench.py" --preset small300k --work "$FUSE_WORK" \
            --backends raw,squashfuse_ll,kernel --passes read,find || status=$?
        "$PY" "$HERE/fuse_bench.py" --preset small300k --work "$FUSE_WORK" \
            --backends squashfuse_ll,kernel,kernel-noplus,kernel-autoplus --passes find,findread \
            --section fuse_bench-small300k-dirs || status=$?
        "$PY" "$HERE/fuse_bench.py" --preset small1280k --work "$FUSE_WORK" \
            --backends squashfuse_ll,kernel --passes read,find || status=$?
        ;;
    select_accuracy)
        echo "[$(date +%T)] run_all: select_accuracy" >&2
        # generates its four data sets under $SEL_WORK/data when they are missing
        "$PY" "$HERE/select_accuracy.py" --work "$SEL_WORK/run" --data "$SEL_WORK/data" \
            --sets small60k,peers,demo,big64 \
            --budget small60k=files:1000 --budget small60k=default \
            --budget peers=files:2000 --budget peers=default \
            --budget demo=files:1000 --budget demo=default \
            --budget big64=mb:500 --budget big64=default || status=$?
        ;;
    sources_bench)
        echo "[$(date +%T)] run_all: sources_bench" >&2
        "$PY" "$HERE/sources_bench.py" || status=$?
        ;;
    jpeg_bench)
        echo "[$(date +%T)] run_all: jpeg_bench" >&2
        "$PY" "$HERE/jpeg_bench.py" || status=$?
        ;;
    stage_bench)
        echo "[$(date +%T)] run_all: stage_bench" >&2
        # shellcheck disable=SC2086
        "$PY" "$HERE/stage_bench.py" ${STAGE_BENCH_ARGS:---ways} \
            --work "${STAGE_BENCH_WORK:-/tmp/fanstore-stagebench}" || status=$?
        ;;
    death_bench)
        echo "[$(date +%T)] run_all: death_bench" >&2
        # shellcheck disable=SC2086
        "$PY" "$HERE/death_bench.py" ${DEATH_BENCH_ARGS:---nodes 4,16} || status=$?
        ;;
    *) echo "run_all.sh: unknown step $step" >&2; exit 2 ;;
    esac
done
left=$(grep -F -e " ${MOUNT_BENCH_WORK:-/tmp/fanstore-bench}/mnt/" -e " ${PEERS_WORK:-/tmp/fsbench}/mnt/" \
    -e " ${MPI_BENCH_WORK:-/tmp/fanstore-mpibench}/" -e " ${PREFETCH_BENCH_WORK:-/tmp/fanstore-prefetchbench}/" \
    -e " $FUSE_WORK/" -e " $SEL_WORK/" \
    /proc/mounts || true)
if [ -n "$left" ]; then
    echo "run_all.sh: WARNING: still mounted:" >&2
    echo "$left" >&2
    status=1
fi
echo "[$(date +%T)] run_all: done (status $status); see docs/benchmarks.md" >&2
exit "$status"
