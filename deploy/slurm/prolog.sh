#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/stall-watchdog.sh): the node's checks before a
# job starts. Slurm drains a node whose prolog exits non-zero, so this exits 1 only when the doctor found
# an error (NVML that cannot start on a node whose PCI bus, /dev or /proc/driver/nvidia shows NVIDIA GPUs:
# a driver that does not work, so no job could use them), with STALL_WATCHDOG_STRICT=1 on a
# warning too (broken P2P, ACS on, an InfiniBand port down...). A node with no NVIDIA GPU at all passes. A
# doctor that could not run (exit 1 or 2) is said in the log, never a reason to drain.
#
#   STALL_WATCHDOG   the command (default: stall-watchdog on PATH, else /opt/stall-watchdog/bin/...)
STALL_WATCHDOG=${STALL_WATCHDOG:-$(command -v stall-watchdog || echo /opt/stall-watchdog/bin/stall-watchdog)}
strict=
[ "${STALL_WATCHDOG_STRICT:-0}" = 1 ] && strict=--strict

say() {
    # slurmd does not keep a prolog's output: the system log does.
    echo "stall-watchdog prolog (job ${SLURM_JOB_ID:-?}): $*" >&2
    command -v logger >/dev/null 2>&1 && logger -t stall-watchdog-prolog -- "job ${SLURM_JOB_ID:-?}: $*"
    return 0
}

findings=$("$STALL_WATCHDOG" doctor $strict 2>&1)
status=$?
case $status in
    0) exit 0 ;;
    3|4)
        say "doctor found $( [ $status = 4 ] && echo an error || echo a warning ): draining $(hostname)"
        printf '%s\n' "$findings" | while IFS= read -r line; do say "$line"; done
        exit 1 ;;
    *)
        say "the doctor could not run (exit $status); not draining: $(printf '%s' "$findings" | tail -n 1)"
        exit 0 ;;
esac
