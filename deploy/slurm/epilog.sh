#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/stall-watchdog.sh): when a job ends, ask this
# node's daemon for a last dump of it (POST /v1/dump {"slurm_job_id": ...}). The daemon writes one only
# where an episode of the job is open or just resolved: a job killed by its time limit or by the NCCL
# watchdog during a hang keeps the stacks of its last look. Any other job costs one quick 404.
# An epilog that fails drains the node, so this always exits 0 and says what happened in the log.
#
# slurmd gives an epilog Slurm's variables only, so what it needs is found at fixed places by default:
#   STALL_WATCHDOG_URL         the daemon (default http://127.0.0.1:9944, export.listen_address)
#   STALL_WATCHDOG_TOKEN_FILE  the dump token (default /etc/stall-watchdog/dump.token, where it exists: the
#                              file the daemon's dump.token_file holds, docs/deploy.md, "Run it with Slurm")
#   STALL_WATCHDOG_TIMEOUT     seconds to wait for the dump (default 45)
url=${STALL_WATCHDOG_URL:-http://127.0.0.1:9944}
timeout=${STALL_WATCHDOG_TIMEOUT:-45}
token_file=${STALL_WATCHDOG_TOKEN_FILE:-/etc/stall-watchdog/dump.token}

say() {
    echo "stall-watchdog epilog (job ${SLURM_JOB_ID:-?}): $*" >&2
    command -v logger >/dev/null 2>&1 && logger -t stall-watchdog-epilog -- "job ${SLURM_JOB_ID:-?}: $*"
    return 0
}

case ${SLURM_JOB_ID:-} in
    ''|*[!0-9]*) say "no numeric SLURM_JOB_ID: nothing to ask"; exit 0 ;;
esac
if ! command -v curl >/dev/null 2>&1; then
    say "curl is not installed: no last dump"
    exit 0
fi

set -- -sS -o /dev/null -w '%{http_code}' --max-time "$timeout" -X POST \
    -H 'Content-Type: application/json' --data "{\"slurm_job_id\": \"$SLURM_JOB_ID\"}"
if [ -r "$token_file" ]; then
    # The header from a file, so the token never shows in the process list.
    header=$(mktemp) || exit 0
    trap 'rm -f "$header"' EXIT
    printf 'Authorization: Bearer %s\n' "$(head -n 1 "$token_file")" > "$header"
    set -- "$@" -H "@$header"
fi
code=$(curl "$@" "$url/v1/dump" 2>/dev/null) || code=${code:-000}
case $code in
    200) say "last dump written by the stall-watchdog daemon (see its incident bundles)" ;;
    404) : ;;  # no open episode of this job on this node: the usual case
    000) say "the stall-watchdog daemon at $url could not be reached or did not answer within ${timeout}s" ;;
    401|403) say "the stall-watchdog daemon refused the dump (HTTP $code): put the token of its dump.token_file in $token_file (docs/deploy.md: Run it with Slurm)" ;;
    *) say "the stall-watchdog daemon answered HTTP $code" ;;
esac
exit 0
