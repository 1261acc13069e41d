"""The job-wide view: `stall-watchdog coordinate` asks Prometheus where a training job runs, asks each of
those nodes' daemons for a dump (POST /v1/dump) at once, and merges the answers into one job verdict.

    nodes.py        Prometheus's HTTP API (which daemons run the job, and which ranks each) and the fan-out
                    to them (only the daemons' scrape job and the allow-list get the node token)
    answers.py      one node's answer read at the edge into typed evidence, or said malformed
    job_verdict.py  the answers merged, each believed only for its own node: the odd rank named with its
                    node, pid, GPU and activity
    job_bundle.py   the job bundle (job.json, nodes/, report.html)
    service.py      the HTTP service Alertmanager posts the job-level alerts to
"""
