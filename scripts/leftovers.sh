#!/usr/bin/env bash
# What a test could leave behind on this machine: a process of this checkout's binaries, a
# network namespace, a mount, a /dev/shm file, a scratch directory (ours, or OpenMPI's session
# directory), a memory cgroup.
#   leftovers.sh snapshot FILE   records what exists now
#   leftovers.sh check FILE      fails, naming each one, if anything appeared since
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="${TMPDIR:-/tmp}"

state() {
    # processes by command line (their pids change); this script's own pipeline excluded
    pgrep -a -f "$root/target/" | cut -d' ' -f2- | sed 's/^/process /' | sort -u || true
    if command -v ip >/dev/null; then ip netns list | awk '{print "netns " $1}'; fi
    # /run/netns itself is iproute2's: the first `ip netns add` on a machine bind-mounts it once
    # and for good (a fresh machine's first suite would count it); the namespaces' own mounts
    # below it still count, as do the namespaces
    awk '$2 != "/run/netns" {print "mount " $2}' /proc/mounts
    find /dev/shm -mindepth 1 -maxdepth 1 -printf 'shm %f\n' 2>/dev/null || true
    find "$tmp" -mindepth 1 -maxdepth 1 \( -name 'ds-*' -o -name 'ds_*' -o -name 'ompi.*' \) -printf 'scratch %p\n' 2>/dev/null || true
    find /sys/fs/cgroup -maxdepth 3 -type d -name 'ds-rs-*' -printf 'cgroup %p\n' 2>/dev/null || true
}

case "${1:-}" in
snapshot) state | sort -u > "$2" ;;
check)
    new="$(state | sort -u | comm -13 "$2" -)"
    if [ -n "$new" ]; then
        echo "error: the tests left these behind:" >&2
        echo "$new" | sed 's/^/  /' >&2
        exit 1
    fi
    echo "leftovers: none (no process, netns, mount, /dev/shm file, scratch dir or cgroup)"
    ;;
*) echo "usage: $0 snapshot|check FILE" >&2; exit 2 ;;
esac
