# The messages of scripts/galera, scripts/nats-cluster, scripts/pooler and scripts/pg-ha;
# sourced by all four, before the other files of scripts/lib, which use them.
#
# Every message goes to stderr, prefixed with the script's name (`scripts/galera: ...`): stdout
# holds only what a caller reads (the URLs `up` prints last).

say() { printf 'scripts/%s: %s\n' "${0##*/}" "$*" >&2; }

# Says what is wrong and exits 2, the status of a usage error or of something missing.
die() { say "$*"; exit 2; }
