# Loopback ports for the servers that scripts/galera, scripts/nats-cluster, scripts/pooler and
# scripts/pg-ha start; sourced by all four.
#
# A port found free and bound later by a server can be taken in between. Two things keep that
# from failing a run:
#   - The ports come from 26000-32767, outside the kernel's ephemeral range (Linux's default is
#     32768-60999, read from /proc/sys/net/ipv4/ip_local_port_range; a port inside it is
#     skipped). An outbound connection is never given such a port, so the cluster's own
#     connections (a joining node dials the others) and every client of the machine leave them
#     alone. A port in the ephemeral range was how a Galera node once lost its port to another
#     node's outbound connection.
#   - The test harness reserves its ports from 20000-25999 (tests/support/ports.rs), so a test
#     never takes one of these either. What is left is another program binding one of them by
#     number at the same moment: `up` then sees "Address already in use" in a server's log and
#     starts again with other ports (three tries).

CLUSTER_PORTS_LOW=26000
CLUSTER_PORTS_HIGH=32767

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# COUNT distinct ports of the range that nothing listens on and that are outside the ephemeral
# range, from a random start, on one line.
free_ports() { # count
    local count=$1 ephemeral_low=49152 ephemeral_high=65535
    if [ -r /proc/sys/net/ipv4/ip_local_port_range ]; then
        read -r ephemeral_low ephemeral_high </proc/sys/net/ipv4/ip_local_port_range
    fi
    local span=$((CLUSTER_PORTS_HIGH - CLUSTER_PORTS_LOW + 1))
    local port=$((CLUSTER_PORTS_LOW + RANDOM % span)) tried=0 found=()
    while [ "${#found[@]}" -lt "$count" ]; do
        if [ "$tried" -ge "$span" ]; then
            printf 'no %s free loopback ports in %s-%s outside the ephemeral range %s-%s\n' \
                "$count" "$CLUSTER_PORTS_LOW" "$CLUSTER_PORTS_HIGH" "$ephemeral_low" "$ephemeral_high" >&2
            return 1
        fi
        if { [ "$port" -lt "$ephemeral_low" ] || [ "$port" -gt "$ephemeral_high" ]; } && ! port_in_use "$port"; then
            found+=("$port")
        fi
        port=$((port + 1))
        [ "$port" -le "$CLUSTER_PORTS_HIGH" ] || port=$CLUSTER_PORTS_LOW
        tried=$((tried + 1))
    done
    echo "${found[@]}"
}

# Whether one of the given logs says a server could not bind its port.
bind_failed() { # log...
    # The last is how wsrep_sst_rsync says its state-transfer port was taken.
    grep -qsi -e "address already in use" -e "bind on tcp/ip port" \
        -e "has been taken by another program" "$@"
}
