# The server processes of scripts/galera, scripts/nats-cluster, scripts/pooler and
# scripts/pg-ha: started detached, found, measured and stopped; sourced by all four, after
# say.bash.
#
# A server is known by its pid file, DIR/NAME.pid, and by the directory DIR its command line
# names (its configuration lies there): a pid whose process has ended, or was reused by another
# program, is "not running". A server may end at any moment, between a test and a read too: a
# pid file or a /proc file gone in between means "not running", quietly, never an error.

# Whether process `pid` runs, with `dir`/ on its command line (a zombie has an empty one).
running() { # pid dir
    [ -n "$1" ] && { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null | grep -qF -- "$2/"
}

# The pid in DIR/NAME.pid (its first line, as in PostgreSQL's postmaster.pid), or nothing.
pid_of() { # dir name
    head -n 1 "$1/$2.pid" 2>/dev/null || true
}

# Whether the server whose pid is in DIR/NAME.pid runs from DIR.
server_runs() { # dir name
    running "$(pid_of "$1" "$2")" "$1"
}

# The resident memory of process `pid` in kB (VmRSS), 0 once it is gone.
rss_kb() { # pid
    { awk '/^VmRSS/ { rss = $2 } END { print rss + 0 }' <"/proc/$1/status"; } 2>/dev/null || echo 0
}

# Runs `command` detached (a session of its own, no terminal, immune to hangups), its output
# appended to `log`, from `dir`: never from the caller's working directory, which a server
# running as another account may not be allowed to enter (a checkout under /root, or in a
# directory made by `mktemp -d`). $! is its pid.
detach() { # dir log command...
    local dir=$1 log=$2
    shift 2
    (cd "$dir" && exec setsid nohup "$@" >>"$log" 2>&1 </dev/null) &
}

# `detach`, as the account `user`: through runuser when that is not the current one.
detach_as() { # user dir log command...
    local user=$1 dir=$2 log=$3
    shift 3
    if [ "$user" = "$(id -un)" ]; then
        detach "$dir" "$log" "$@"
    else
        detach "$dir" "$log" runuser -u "$user" -- "$@"
    fi
}

# Waits (up to 10 s) until the detached `pid` has exec'd its server, or ended: before that its
# command line is this script's, which `running` does not recognise, and a busy machine would
# see a server that exited.
wait_exec() { # pid dir
    local deadline=$((SECONDS + 10))
    while [ -r "/proc/$1/cmdline" ] && ! running "$1" "$2" && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.05
    done
}

# Waits until `pid` no longer runs from `dir`; fails if it still does at `deadline` (a value of
# $SECONDS).
wait_gone() { # pid dir deadline
    while running "$1" "$2"; do
        [ "$SECONDS" -lt "$3" ] || return 1
        sleep 0.1
    done
}

# Stops the servers of `dir` whose pids are in DIR/NAME.pid: `signal` to each that runs, then
# up to `grace` seconds in all for them to end, then SIGKILL to any still running.
stop_servers() { # signal grace dir name...
    local signal=$1 grace=$2 dir=$3 name pid
    shift 3
    for name in "$@"; do
        pid=$(pid_of "$dir" "$name")
        if running "$pid" "$dir"; then
            kill "-$signal" "$pid" 2>/dev/null || true
        fi
    done
    local deadline=$((SECONDS + grace))
    for name in "$@"; do
        pid=$(pid_of "$dir" "$name")
        wait_gone "$pid" "$dir" "$deadline" && continue
        say "$name ($pid) did not stop on SIG$signal within $grace s; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    done
}
