#!/usr/bin/env bash
# tools/slurm-local.sh - a real Slurm cluster on this one machine, for tests.
#
#   tools/slurm-local.sh start    install (if needed) and start the cluster; idempotent
#   tools/slurm-local.sh stop     cancel jobs, stop the daemons this script started
#   tools/slurm-local.sh status   show daemons and nodes; exit 0 only if all is up
#
# What "the cluster" is: munged (authentication), one slurmctld (controller) and
# two slurmd processes that emulate compute nodes n1 and n2, all on this host,
# with partition "debug" (default) holding both nodes. Jobs run as root with the
# submitter's environment and working directory. Needs root (Debian/Ubuntu).
#
# Files (override the three dirs with the environment variables in brackets):
#   /etc/slurm/slurm.conf               generated from tools/slurm-local/slurm.conf.in
#                                       (the default path: sinfo/srun/sbatch need no SLURM_CONF)
#   /run/fanstore-slurm-local/          pid files [FANSTORE_SLURM_RUN_DIR]: munged.pid
#                                       slurmctld.pid slurmd-n1.pid slurmd-n2.pid, and
#                                       reaper.pid (+ reaper.py, see REAPER_PY below)
#   /var/log/fanstore-slurm-local/      logs [FANSTORE_SLURM_LOG_DIR]: slurmctld.log,
#                                       slurmd-n1.log, slurmd-n2.log, launch.out (start-up
#                                       messages), *.out (daemons' stdout/stderr), apt.log;
#                                       munged logs to /var/log/munge/munged.log
#   /var/lib/fanstore-slurm-local/      controller state (ctld/) and per-node spool dirs
#                                       (spool/n1, spool/n2) [FANSTORE_SLURM_LIB_DIR]
#
# Other knobs: FANSTORE_SLURM_WAIT (seconds to wait for the nodes, default 30),
# FANSTORE_SLURM_CTLD_PORT (6817), FANSTORE_SLURM_NODE_PORT (17001; n2 uses +1).
#
# `stop` exits 0 when nothing was running. `start` and `stop` take a lock
# (/run/fanstore-slurm-local.lock), so concurrent callers queue up.
#
# Inside a job, the emulated nodes share one hostname (`hostname` prints the same
# on n1 and n2): tell them apart with $SLURMD_NODENAME (n1/n2) or $SLURM_NODEID.
# They also share one /tmp. SLURM_TMPDIR is not set; TMPDIR is the submitter's,
# or /tmp (set by Slurm) when the submitter has none.
set -euo pipefail

PROG="slurm-local"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEMPLATE="$SCRIPT_DIR/slurm-local/slurm.conf.in"

RUN_DIR="${FANSTORE_SLURM_RUN_DIR:-/run/fanstore-slurm-local}"
LOG_DIR="${FANSTORE_SLURM_LOG_DIR:-/var/log/fanstore-slurm-local}"
LIB_DIR="${FANSTORE_SLURM_LIB_DIR:-/var/lib/fanstore-slurm-local}"
WAIT_SECS="${FANSTORE_SLURM_WAIT:-30}"
CTLD_PORT="${FANSTORE_SLURM_CTLD_PORT:-6817}"
NODE_PORT="${FANSTORE_SLURM_NODE_PORT:-17001}"

SLURM_CONF_PATH=/etc/slurm/slurm.conf
NODES=(n1 n2)
PACKAGES=(slurmctld slurmd slurm-client munge)
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PIDFILE=/run/munge/munged.pid      # where Debian's munged writes its pid
MUNGE_LOG=/var/log/munge/munged.log

# Every daemon we start gets this variable in its environment. slurmd passes its
# environment on to the slurmstepd processes it forks, so `stop` can find those
# too (by reading /proc/PID/environ) and never touches anyone else's processes.
MARK="FANSTORE_SLURM_LOCAL_DAEMON=1"

# The daemons are started under a tiny reaper process ("fanstore-reaper", pid in
# RUN_DIR/reaper.pid). Daemons double-fork; the orphaned halves, and every
# slurmstepd, end up as children of the nearest "child subreaper" ancestor, or of
# PID 1. In some sandboxes PID 1 reaps them late or never, so each start and
# each job step would leave <defunct> munged/slurmd/slurmstepd entries behind. The reaper
# marks itself as subreaper (prctl PR_SET_CHILD_SUBREAPER), runs the launch
# command given to it, writes that command's exit status to a file, then reaps
# until it has no children left (i.e. it exits by itself after `stop`).
REAPER_PY='
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)                    # PR_SET_CHILD_SUBREAPER
libc.prctl(15, b"fanstore-reaper", 0, 0, 0)   # PR_SET_NAME (shows as comm)
pidfile, rcfile, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(pidfile, "w") as f:
    f.write("%d\n" % os.getpid())
child = os.fork()
if child == 0:
    os.execvp(cmd[0], cmd)
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if pid == child:
        with open(rcfile + ".tmp", "w") as f:
            f.write("%d\n" % os.waitstatus_to_exitcode(status))
        os.rename(rcfile + ".tmp", rcfile)
'

T0=$(date +%s.%N)

say()  { echo "$PROG: $*"; }
warn() { echo "$PROG: warning: $*" >&2; }
die()  { echo "$PROG: error: $*" >&2; exit 1; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# ----------------------------------------------------------------- helpers ---

# pidfile NAME -> path of our pid file for daemon NAME (munged, slurmctld, slurmd-n1, ...)
pidfile() { echo "$RUN_DIR/$1.pid"; }

# comm_of NAME -> the process name (/proc/PID/comm) that daemon NAME runs as
comm_of() { case "$1" in slurmd-*) echo slurmd ;; reaper) echo fanstore-reaper ;; *) echo "$1" ;; esac; }

# read_pid NAME -> prints the recorded pid (empty if no/garbled pid file)
read_pid() {
    local f; f="$(pidfile "$1")"
    [[ -r "$f" ]] || return 0
    local p; p="$(tr -dc '0-9' <"$f" 2>/dev/null || true)"
    echo "$p"
}

# proc_comm PID -> the process name (/proc/PID/comm); proc_state PID -> its
# state letter (R, S, Z, ...). Bash builtins only: these run in loops over /proc.
proc_comm() { local c=""; { read -r c <"/proc/$1/comm"; } 2>/dev/null || true; echo "$c"; }
proc_state() {
    local l=""; { read -r l <"/proc/$1/stat"; } 2>/dev/null || true
    l="${l##*) }"; echo "${l%% *}"
}

# pid_alive PID COMM -> true if PID exists, is not a zombie, and is running COMM
# (guards against a recycled pid belonging to some unrelated process).
pid_alive() {
    local pid="$1" comm="$2" state
    [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
    [[ "$(proc_comm "$pid")" == "$comm" ]] || return 1
    state="$(proc_state "$pid")"
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

# daemon_alive NAME -> true if the daemon recorded under NAME is running
daemon_alive() { pid_alive "$(read_pid "$1")" "$(comm_of "$1")"; }

# live_pids COMM -> pids of running (non-zombie) processes named COMM. PID 1 in
# some sandboxes does not reap orphans, so dead daemons linger as zombies that
# pgrep would still list.
live_pids() {
    local d c
    for d in /proc/[0-9]*; do
        c=""; { read -r c <"$d/comm"; } 2>/dev/null || true   # (no subshell: hot loop)
        [[ "$c" == "$1" ]] || continue
        pid_alive "${d#/proc/}" "$1" && echo "${d#/proc/}"
    done
    return 0
}

# cmd_running COMM ARGV... -> true if a live process named COMM runs exactly ARGV
cmd_running() {
    local comm="$1" pid line; shift
    local want; want="$(printf '%s ' "$@")"
    for pid in $(live_pids "$comm"); do
        line="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)"
        [[ "$line" == "$want" ]] && return 0
    done
    return 1
}

# marked_pids -> pids of slurm/munge processes carrying our marker variable
marked_pids() {
    local d pid comm
    for d in /proc/[0-9]*; do
        pid="${d#/proc/}"
        comm=""; { read -r comm <"$d/comm"; } 2>/dev/null || true   # (no subshell: hot loop)
        case "$comm" in munged|slurmctld|slurmscriptd|slurmd|slurmstepd|fanstore-reaper) ;; *) continue ;; esac
        pid_alive "$pid" "$comm" || continue
        if tr '\0' '\n' <"$d/environ" 2>/dev/null | grep -qx "$MARK"; then
            echo "$pid"
        fi
    done
}

# children_of PID -> live (non-zombie) child pids of PID
children_of() {
    local parent="$1" d l st pp
    for d in /proc/[0-9]*; do
        l=""; { read -r l <"$d/stat"; } 2>/dev/null || continue
        l="${l##*) }"                          # "STATE PPID ..."
        st="${l%% *}"; l="${l#* }"; pp="${l%% *}"
        [[ "$pp" == "$parent" && "$st" != Z ]] && echo "${d#/proc/}"
    done
    return 0
}

# wait_gone TIMEOUT PID... -> wait until all PIDs are gone; false on timeout
wait_gone() {
    local timeout="$1"; shift
    local deadline=$(( $(date +%s) + timeout )) p left
    while :; do
        left=0
        for p in "$@"; do
            if [[ -d "/proc/$p" ]] && [[ "$(proc_state "$p")" != Z ]]; then
                left=1
            fi
        done
        (( left == 0 )) && return 0
        (( $(date +%s) >= deadline )) && return 1
        sleep 0.1
    done
}

# terminate TIMEOUT PID... -> SIGTERM, wait up to TIMEOUT s, then SIGKILL the rest
terminate() {
    local timeout="$1"; shift
    (( $# )) || return 0
    kill -TERM "$@" 2>/dev/null || true
    if ! wait_gone "$timeout" "$@"; then
        warn "pids $* did not exit within ${timeout}s after SIGTERM; sending SIGKILL"
        kill -KILL "$@" 2>/dev/null || true
        wait_gone 5 "$@" || warn "pids $* survived SIGKILL"
    fi
}

# node_states -> "n1 idle" lines from sinfo (bounded, never hangs)
node_states() { timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true; }

# nodes_in STATE_REGEX -> true if every emulated node's state matches the regex.
# sinfo appends "*" to a state when the node does not respond, so "idle*" fails.
nodes_in() {
    local re="$1" states n st
    states="$(node_states)"
    for n in "${NODES[@]}"; do
        st="$(awk -v n="$n" '$1 == n { print $2 }' <<<"$states")"
        [[ "$st" =~ ^($re)$ ]] || return 1
    done
}
UP_STATES='idle|allocated|mixed|completing'

# show_logs -> tails of the daemon logs (used on failures)
show_logs() {
    local f
    for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd-*.log "$MUNGE_LOG" "$LOG_DIR"/*.out; do
        [[ -s "$f" && "$f" != "$LOG_DIR/launch.out" ]] || continue
        echo "----- last lines of $f -----" >&2
        tail -n 10 "$f" >&2
    done
}

# fail MESSAGE -> print the logs' tails, stop whatever this start got running
# (the logs stay), then die with MESSAGE as the last line. Inside the internal
# __launch step it only dies: the outer `start` does the rest.
fail() {
    [[ -z "${IN_LAUNCH:-}" ]] || die "$*"
    show_logs
    do_stop quiet >/dev/null 2>&1 || true
    die "$* (logs: $LOG_DIR)"
}

# lock -> serialize start/stop between concurrent callers (waits up to 120 s).
# fd 9 must not leak into the daemons (they would hold the lock forever), so
# every daemon launch below closes it with 9>&-.
lock() {
    exec 9>"${RUN_DIR%/}.lock"
    flock -w 120 9 || die "another start/stop holds ${RUN_DIR%/}.lock for over 120 s"
}

need_root() { [[ "$(id -u)" == 0 ]] || die "must run as root (it installs packages and starts system daemons)"; }

# ----------------------------------------------------------------- install ---

# Install the Debian packages that are missing. `apt-get update` runs only when
# something must be installed, so a start on a ready machine costs nothing here.
ensure_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
            missing+=("$p")
        fi
    done
    (( ${#missing[@]} )) || return 0
    say "installing ${missing[*]} (log: $LOG_DIR/apt.log)"
    mkdir -p "$LOG_DIR"
    local apt=(apt-get -o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
    # policy-rc.d / no systemd: installing does not start the services; we do.
    if ! { DEBIAN_FRONTEND=noninteractive "${apt[@]}" update -q &&
           DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -q --no-install-recommends "${PACKAGES[@]}"; } \
           >"$LOG_DIR/apt.log" 2>&1; then
        tail -n 20 "$LOG_DIR/apt.log" >&2
        die "apt-get failed installing ${missing[*]} (full log: $LOG_DIR/apt.log)"
    fi
    say "installed ${missing[*]} ($(elapsed)s)"
}

# ------------------------------------------------------------------ config ---

# Create the munge key if missing (mode 0400, owned by munge, as munged demands).
ensure_munge_key() {
    if [[ ! -s "$MUNGE_KEY" ]]; then
        say "creating munge key $MUNGE_KEY"
        mkdir -p "$(dirname "$MUNGE_KEY")"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$MUNGE_KEY" --force >/dev/null
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge "$(dirname "$MUNGE_KEY")" "$MUNGE_KEY"
    chmod 0700 "$(dirname "$MUNGE_KEY")"
    chmod 0400 "$MUNGE_KEY"
}

# Directories for state, spool, pid files and logs; munged's own directories.
make_dirs() {
    local n
    mkdir -p "$RUN_DIR" "$LOG_DIR" "$LIB_DIR/ctld" /etc/slurm
    for n in "${NODES[@]}"; do mkdir -p "$LIB_DIR/spool/$n"; done
    chmod 0755 "$RUN_DIR" "$LOG_DIR" "$LIB_DIR"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    chmod 0700 /var/log/munge /var/lib/munge
}

# Write /etc/slurm/slurm.conf from the template: real hostname, this machine's
# CPU count for each node (`nproc`; both emulated nodes claim all of them), and
# half the memory each. Rewritten only when the content changes.
write_conf() {
    [[ -r "$TEMPLATE" ]] || die "template $TEMPLATE not found"
    local host cpus mem_mb tmp
    host="$(hostname)"
    [[ -n "$host" ]] || die "hostname is empty"
    cpus="$(nproc)"
    mem_mb="$(awk '/^MemTotal:/ { m = int($2 / 1024 / 2) - 256; if (m < 256) m = 256; print m }' /proc/meminfo)"
    tmp="$(mktemp "$SLURM_CONF_PATH.XXXXXX")"
    sed -e "s|@HOSTNAME@|$host|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEM_MB@|$mem_mb|g" \
        -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@PORT_N1@|$NODE_PORT|g" -e "s|@PORT_N2@|$((NODE_PORT + 1))|g" \
        -e "s|@LIB_DIR@|$LIB_DIR|g" -e "s|@RUN_DIR@|$RUN_DIR|g" -e "s|@LOG_DIR@|$LOG_DIR|g" \
        -e "s|@SCRIPT_DIR@|$SCRIPT_DIR|g" \
        "$TEMPLATE" >"$tmp"
    chmod 0644 "$tmp"
    if [[ -f "$SLURM_CONF_PATH" ]] && cmp -s "$tmp" "$SLURM_CONF_PATH"; then
        rm -f "$tmp"; return 0
    fi
    # Keep a slurm.conf that somebody else wrote, once.
    if [[ -f "$SLURM_CONF_PATH" ]] && ! grep -q 'fanstore-slurm-local-generated' "$SLURM_CONF_PATH" &&
       [[ ! -e "$SLURM_CONF_PATH.orig" ]]; then
        cp -p "$SLURM_CONF_PATH" "$SLURM_CONF_PATH.orig"
        warn "kept the previous $SLURM_CONF_PATH as $SLURM_CONF_PATH.orig"
    fi
    mv -f "$tmp" "$SLURM_CONF_PATH"
}

# ------------------------------------------------------------------ daemons ---

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# Start munged as the munge user, unless a munged we did not start already
# answers (then use it and leave it alone on stop).
start_munged() {
    if daemon_alive munged && munge_works; then return 0; fi
    # (Only ask munge when some munged runs: against a stale socket the munge
    # client retries for seconds.)
    if [[ -n "$(live_pids munged)" ]]; then
        if munge_works; then
            say "using the munged that is already running (not started by this script; stop leaves it)"
            rm -f "$(pidfile munged)"
            return 0
        fi
        die "a munged not started by this script is running (pid $(live_pids munged | tr '\n' ' ')) but 'munge -n | unmunge' fails; stop it first"
    fi
    rm -f "$MUNGE_PIDFILE"
    runuser -u munge -- env "$MARK" /usr/sbin/munged </dev/null >>"$LOG_DIR/munged.out" 2>&1 ||
        fail "munged failed to start"
    local i pid=""
    for i in $(seq 1 100); do          # up to 10 s
        pid="$(tr -dc '0-9' <"$MUNGE_PIDFILE" 2>/dev/null || true)"
        if pid_alive "$pid" munged && munge_works; then
            echo "$pid" >"$(pidfile munged)"
            return 0
        fi
        sleep 0.1
    done
    fail "munged did not come up ('munge -n | unmunge' fails)"
}

# Start one slurm daemon (it daemonizes and writes its own pid file into RUN_DIR);
# wait until the pid file names a live process.
#   start_daemon NAME COMMAND...
start_daemon() {
    local name="$1"; shift
    local f; f="$(pidfile "$name")"
    rm -f "$f"
    env "$MARK" "$@" </dev/null >>"$LOG_DIR/$name.out" 2>&1 || fail "$name failed to start: $*"
    local i log="$LOG_DIR/$name.log"
    for i in $(seq 1 100); do          # up to 10 s
        daemon_alive "$name" && return 0
        # no process runs this command line any more: it died (e.g. port in use)
        if (( i > 3 )) && ! cmd_running "$(comm_of "$name")" "$@"; then break; fi
        sleep 0.1
    done
    local why; why="$(grep -h 'error:' "$log" 2>/dev/null | tail -n 1 | sed 's/^\[[^]]*\] //' || true)"
    fail "$name did not start${why:+: $why}"
}

# Refuse to run next to slurm daemons that are not ours: they would hold the
# ports, and we must never stop them.
check_foreign() {
    local comm pid ours
    ours=" $(for n in slurmctld "${NODES[@]/#/slurmd-}"; do read_pid "$n"; done | tr '\n' ' ') $(marked_pids | tr '\n' ' ') "
    for comm in slurmctld slurmd; do
        for pid in $(live_pids "$comm"); do
            [[ "$ours" == *" $pid "* ]] && continue
            die "a $comm not started by this script is running (pid $pid); stop it first"
        done
    done
}

# ----------------------------------------------------------------- actions ---

all_daemons() { echo munged slurmctld "${NODES[@]/#/slurmd-}"; }

# True if everything we need is running and both nodes respond.
cluster_up() {
    local n
    for n in slurmctld "${NODES[@]/#/slurmd-}"; do daemon_alive "$n" || return 1; done
    # munged: ours must be alive; if we reused a foreign one it must still answer
    if [[ -e "$(pidfile munged)" ]]; then daemon_alive munged || return 1
    elif [[ -z "$(live_pids munged)" ]]; then return 1; fi
    munge_works || return 1
    nodes_in "$UP_STATES"
}

# Internal (`__launch`): start munged, slurmctld, and one slurmd per node. Runs
# as the child of the reaper, output in LOG_DIR/launch.out.
cmd_launch() {
    start_munged
    # slurmctld -c: clean start, forget jobs and node states of earlier runs.
    start_daemon slurmctld /usr/sbin/slurmctld -c
    local n
    for n in "${NODES[@]}"; do
        start_daemon "slurmd-$n" /usr/sbin/slurmd -N "$n"
    done
}

cmd_start() {
    need_root
    mkdir -p "$LOG_DIR" "$(dirname "$RUN_DIR")"
    lock
    ensure_packages

    # Already running? Then there is nothing to do.
    if cluster_up; then
        say "already running (nodes: $(node_states | tr '\n' ' '))"
        return 0
    fi
    # Leftovers of an earlier run (stale pid files, half-dead daemons): clean up.
    if compgen -G "$RUN_DIR/*.pid" >/dev/null || [[ -n "$(marked_pids)" ]]; then
        say "found leftovers of an earlier run; cleaning up first"
        do_stop quiet
    fi
    check_foreign

    make_dirs
    ensure_munge_key
    write_conf

    # Start the daemons: under the reaper when python3 is there (see REAPER_PY),
    # else directly. The reaper is detached (setsid, stdio not ours), so callers
    # such as `out=$(slurm-local.sh start)` do not hang on it.
    local self rcfile="$RUN_DIR/launch.rc" launch_log="$LOG_DIR/launch.out" rc=""
    self="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"
    rm -f "$rcfile" "$(pidfile reaper)"
    : >"$launch_log"
    if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -I -c 'import ctypes' 2>/dev/null; then
        printf '%s' "$REAPER_PY" >"$RUN_DIR/reaper.py"
        setsid env "$MARK" /usr/bin/python3 -I "$RUN_DIR/reaper.py" "$(pidfile reaper)" "$rcfile" \
            bash "$self" __launch </dev/null >>"$launch_log" 2>&1 9>&- &
        local i
        for i in $(seq 1 600); do      # up to 60 s; each daemon start is bounded by 10 s
            [[ -s "$rcfile" ]] && break
            if (( i > 20 )) && ! daemon_alive reaper; then
                [[ -s "$rcfile" ]] || { rc=1; echo "the reaper died" >>"$launch_log"; }
                break
            fi
            sleep 0.1
        done
        [[ -n "$rc" ]] || rc="$(tr -dc '0-9' <"$rcfile" 2>/dev/null || echo 1)"
        [[ -n "$rc" ]] || rc=1
    else
        warn "no usable /usr/bin/python3: starting without reaper (exited daemons may linger as zombies)"
        rc=0
        env "$MARK" bash "$self" __launch </dev/null >>"$launch_log" 2>&1 9>&- || rc=$?
    fi
    rm -f "$rcfile"
    if [[ "$rc" == 0 ]]; then
        grep "^$PROG: " "$launch_log" || true     # pass on the launch's own messages
    else
        grep -v "^$PROG: error: " "$launch_log" >&2 || true
        local err; err="$(grep "^$PROG: error: " "$launch_log" | tail -n 1 | sed "s/^$PROG: error: //")"
        fail "${err:-the daemons failed to start (exit $rc)}"
    fi

    # Wait (bounded) until sinfo shows both nodes idle.
    local deadline n; deadline=$(( $(date +%s) + WAIT_SECS ))
    until nodes_in idle; do
        for n in $(all_daemons); do
            if [[ "$n" == munged && ! -e "$(pidfile munged)" ]]; then continue; fi
            daemon_alive "$n" || fail "$n died during start-up"
        done
        if (( $(date +%s) >= deadline )); then
            echo "$PROG: sinfo says:" >&2; node_states >&2
            fail "nodes ${NODES[*]} not idle after ${WAIT_SECS}s"
        fi
        sleep 0.2
    done
    say "up in $(elapsed)s: nodes ${NODES[*]} idle in partition debug; pids in $RUN_DIR, logs in $LOG_DIR"
}

# Stop what we started. With "quiet", used by start to clear leftovers.
do_stop() {
    local quiet="${1:-}" n pid pids=() ids comm

    # 1. Cancel all jobs (they run on our nodes) and wait for them to end
    #    (SIGTERM, SIGKILL after KillWait=5 s), so that slurmstepd cleans up
    #    the job processes before slurmd goes away.
    if daemon_alive slurmctld; then
        ids="$(timeout 10 squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)"
        if [[ -n "${ids// /}" ]]; then
            [[ -n "$quiet" ]] || say "cancelling jobs: $ids"
            # shellcheck disable=SC2086
            timeout 10 scancel $ids 2>/dev/null || true
            local deadline=$(( $(date +%s) + 15 ))
            while [[ -n "$(timeout 10 squeue -h -o '%A' 2>/dev/null || true)" ]] && (( $(date +%s) < deadline )); do
                sleep 0.2
            done
        fi
    fi

    # 2. The slurmd's and slurmctld, by their recorded pids.
    for n in "${NODES[@]/#/slurmd-}" slurmctld; do
        if daemon_alive "$n"; then pids+=("$(read_pid "$n")"); fi
    done
    if (( ${#pids[@]} )); then
        [[ -n "$quiet" ]] || say "stopping slurm daemons (pids ${pids[*]})"
        terminate 10 "${pids[@]}"
    fi

    # 3. Any other slurm process of ours still around (slurmstepd, or daemons
    #    whose pid file was lost), found by the marker variable.
    local strays=()
    for pid in $(marked_pids); do
        comm="$(proc_comm "$pid")"
        [[ "$comm" == munged || "$comm" == fanstore-reaper ]] || strays+=("$pid")
    done
    if (( ${#strays[@]} )); then
        [[ -n "$quiet" ]] || say "stopping leftover slurm processes (pids ${strays[*]})"
        terminate 5 "${strays[@]}"
    fi

    # 4. munged (ours only: a munged we found running is left alone).
    pids=()
    if daemon_alive munged; then pids+=("$(read_pid munged)"); fi
    for pid in $(marked_pids); do
        [[ "$(proc_comm "$pid")" == munged ]] || continue
        [[ " ${pids[*]} " == *" $pid "* ]] || pids+=("$pid")
    done
    if (( ${#pids[@]} )); then
        [[ -n "$quiet" ]] || say "stopping munged (pid ${pids[*]})"
        terminate 10 "${pids[@]}"
    fi

    # 5. Job processes that outlived their job: proctrack/linuxproc loses track
    #    of a process whose parent exits (e.g. `daemon &` in a batch script that
    #    then ends), so Slurm never kills it. Such orphans were re-parented to
    #    the reaper (their nearest subreaper ancestor): stop them too.
    pids=()
    if daemon_alive reaper; then pids+=("$(read_pid reaper)"); fi
    for pid in $(marked_pids); do [[ " ${pids[*]} " == *" $pid "* ]] || pids+=("$pid"); done
    strays=()
    for pid in "${pids[@]}"; do
        # shellcheck disable=SC2207
        strays+=($(children_of "$pid"))
    done
    if (( ${#strays[@]} )); then
        [[ -n "$quiet" ]] || say "stopping processes left behind by jobs (pids ${strays[*]})"
        terminate 5 "${strays[@]}"
    fi

    # 6. The reaper exits by itself once it has reaped its last child.
    if (( ${#pids[@]} )) && ! wait_gone 5 "${pids[@]}"; then
        terminate 5 "${pids[@]}"
    fi

    # 7. Forget the pid files.
    for n in $(all_daemons) reaper; do rm -f "$(pidfile "$n")"; done
}

cmd_stop() {
    need_root
    lock
    if ! compgen -G "$RUN_DIR/*.pid" >/dev/null && [[ -z "$(marked_pids)" ]]; then
        say "not running"
        return 0
    fi
    do_stop
    say "stopped ($(elapsed)s)"
}

# One line per daemon (name, pid, alive/dead), then sinfo. Exit 0 iff all up.
cmd_status() {
    local n pid rc=0
    for n in $(all_daemons) reaper; do
        pid="$(read_pid "$n")"
        if [[ -z "$pid" ]]; then
            if [[ "$n" == munged && -n "$(live_pids munged)" ]] && munge_works; then
                printf '%-10s %-8s %s\n' "$n" "-" "alive (not started by this script)"
            else
                printf '%-10s %-8s %s\n' "$n" "-" "not running"
                [[ "$n" == reaper ]] || rc=1
            fi
        elif daemon_alive "$n"; then
            printf '%-10s %-8s %s\n' "$n" "$pid" alive
        else
            printf '%-10s %-8s %s\n' "$n" "$pid" dead
            [[ "$n" == reaper ]] || rc=1     # the reaper is a helper, not a daemon
        fi
    done
    if (( rc == 0 )) && ! munge_works; then echo "munge -n | unmunge fails"; rc=1; fi
    if daemon_alive slurmctld; then
        timeout 10 sinfo -N -o '%N %P %T %c' 2>&1 || rc=1
        nodes_in "$UP_STATES" || rc=1
    else
        echo "sinfo: slurmctld is not running"; rc=1
    fi
    echo "pid files: $RUN_DIR  logs: $LOG_DIR"
    return "$rc"
}

case "${1:-}" in
    start)    cmd_start ;;
    stop)     cmd_stop ;;
    status)   cmd_status ;;
    __launch) IN_LAUNCH=1; need_root; cmd_launch ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
