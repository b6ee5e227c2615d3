# The directory DIR that `up` of scripts/galera, scripts/nats-cluster, scripts/pooler and
# scripts/pg-ha keeps its servers in, and the record of the last one `up` made itself; sourced
# by all four, after say.bash.
#
# `up` without DIR makes a new temporary directory, ${TMPDIR:-/tmp}/idem-<script>.XXXXXX, and
# records it in $LAST, ${TMPDIR:-/tmp}/idem-<script>.last; the other commands without DIR use
# the one recorded there, and `down` forgets it as it removes it.

LAST="${TMPDIR:-/tmp}/idem-${0##*/}.last"

# The absolute path of the directory `up` runs in: DIR, made if missing, or a new temporary
# directory, recorded in $LAST.
up_dir() { # [dir]
    local dir=${1:-}
    if [ -z "$dir" ]; then
        dir=$(mktemp -d "${TMPDIR:-/tmp}/idem-${0##*/}.XXXXXX")
        printf '%s\n' "$dir" >"$LAST"
    fi
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

# DIR, or the directory of the last `up` without one.
dir_or_last() { # [dir]
    if [ -n "${1:-}" ]; then
        printf '%s\n' "$1"
    else
        cat "$LAST" 2>/dev/null || die "no DIR given and no earlier 'up' recorded in $LAST"
    fi
}

# Removes $LAST if it records `dir`, which `down` has just removed.
forget_last() { # dir
    [ "$(cat "$LAST" 2>/dev/null || true)" != "$1" ] || rm -f "$LAST"
}
