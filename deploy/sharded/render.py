"""Writes the two sharded setups for fleets too large for one Prometheus (docs/fleet-scale.md), each from the
same scrape job, so a fact has one home:

    prometheus/shard-N.yml   Prometheus 2.42 shards: each scrapes the nodes whose address hashes (hashmod) to
                             its buckets, every node kept by REPLICATION shards, and remote-writes what the
                             rules read to the global view (every global, an HA pair)
    prometheus/global.yml    the global view: a Prometheus that receives the shards' writes (run it with
                             --web.enable-remote-write-receiver), merges the replicas' samples of a series
                             (out_of_order_time_window) and evaluates deploy/prometheus/rules.yml
    victoriametrics/scrape.yml  the one scrape configuration of every vmagent of a cluster
                             (-promscrape.cluster.*), which writes to VictoriaMetrics; vmalert evaluates the
                             same rules.yml there (the command lines are in docs/fleet-scale.md)

    python deploy/sharded/render.py          # rewrite them (3 shards, replication 2)
    python deploy/sharded/render.py --check  # exit 1 if any is out of date (the tests run this)
    python deploy/sharded/render.py --out /etc/prometheus/sharded --shards 4 \
        --global http://prom-g1:9090/api/v1/write --global http://prom-g2:9090/api/v1/write \
        --alertmanager am1:9093 --nodes-files '/etc/prometheus/nodes/*.json'   # your own, elsewhere

The shipped files name their peers as placeholders (global-a:9090, alertmanager:9093, the file_sd folder of
the node list): render your own with the options, rather than edit them by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
HEADER = "# Made by deploy/sharded/render.py: edit that, then run it. docs/fleet-scale.md says how to run it.\n"
SHARDS, REPLICATION = 3, 2
GLOBALS = ("http://global-a:9090/api/v1/write", "http://global-b:9090/api/v1/write")
ALERTMANAGERS = ("alertmanager:9093",)
NODES_FILES = "/etc/prometheus/stall-watchdog-nodes/*.json"  # file_sd: [{"targets": ["gpu-node-0001:9944", ...]}]
RULES = "/etc/prometheus/stall-watchdog-rules.yml"  # deploy/prometheus/rules.yml
# What the rules read (deploy/prometheus/rules.yml), the only series the shards send on: the global view holds
# the job-wide join, not every reading (the dashboards read the shards).
RULE_INPUTS = ("up|stall_watchdog_(job_(state|culprit|wait_ratio|wait_samples|nccl_ratio)|job_first_(wait|nccl)_ratio|"
               "episode_alert_info|actions_total|build_info|"
               "last_sample_timestamp_seconds|component_up|alerts_total|bundles_total)")


def scrape_job(nodes_files: str = NODES_FILES) -> dict[str, Any]:
    """The scrape job every shard and every vmagent runs: every node's watchdog, from a file_sd list."""
    return {"job_name": "stall-watchdog", "file_sd_configs": [{"files": [nodes_files]}]}


def buckets(shard: int, shards: int, replication: int) -> list[int]:
    """The hashmod buckets shard `shard` keeps: its own and the next replication - 1, so that each bucket is
    kept by `replication` shards and any replication - 1 of them may stop."""
    if not 0 <= shard < shards or not 1 <= replication <= shards:
        raise ValueError(f"shard {shard} of {shards} with replication {replication}: out of range")
    return sorted({(shard + k) % shards for k in range(replication)})


def shard_config(shard: int, shards: int = SHARDS, replication: int = REPLICATION, globals_: tuple[str, ...] = GLOBALS,
                 nodes_files: str = NODES_FILES, interval: str = "1m") -> dict[str, Any]:
    """One Prometheus shard. Its external label `prometheus_shard` gives it scrape times of its own (Prometheus
    seeds each target's offset with them): two shards that scraped a node at the same millisecond would send
    two samples at one timestamp, and the global view refuses the whole batch that holds the second. The label
    is dropped again on the way out: the replicas of a series are one series in the global view, where their
    samples interleave."""
    job = scrape_job(nodes_files)
    job["relabel_configs"] = [
        {"source_labels": ["__address__"], "modulus": shards, "target_label": "__tmp_hash", "action": "hashmod"},
        {"source_labels": ["__tmp_hash"], "regex": "|".join(map(str, buckets(shard, shards, replication))),
         "action": "keep"},
    ]
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "external_labels": {"prometheus_shard": str(shard)}},
        "scrape_configs": [job],
        "remote_write": [{"url": url, "write_relabel_configs": [
            {"source_labels": ["__name__"], "regex": RULE_INPUTS, "action": "keep"},
            {"regex": "prometheus_shard", "action": "labeldrop"}]} for url in globals_],
    }


def global_config(alertmanagers: tuple[str, ...] = ALERTMANAGERS, rules: str = RULES,
                  interval: str = "1m") -> dict[str, Any]:
    """The global view: no scrapes of its own; the rules over every shard's nodes, alerts to Alertmanager."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        # Two shards scrape each node at their own moments: their samples of one series arrive out of order.
        "storage": {"tsdb": {"out_of_order_time_window": "10m"}},
        "rule_files": [rules],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]},
    }


def vmagent_config(nodes_files: str = NODES_FILES, interval: str = "1m") -> dict[str, Any]:
    """The scrape configuration of every vmagent in a cluster: the cluster flags say which targets each keeps."""
    return {"global": {"scrape_interval": interval}, "scrape_configs": [scrape_job(nodes_files)]}


def files(out: Path = HERE, shards: int = SHARDS, replication: int = REPLICATION,
          globals_: tuple[str, ...] = GLOBALS, alertmanagers: tuple[str, ...] = ALERTMANAGERS,
          nodes_files: str = NODES_FILES, rules: str = RULES, interval: str = "1m") -> dict[Path, str]:
    configs = {out / "prometheus" / f"shard-{n}.yml": shard_config(n, shards, replication, globals_, nodes_files,
                                                                   interval) for n in range(shards)}
    configs[out / "prometheus" / "global.yml"] = global_config(alertmanagers, rules, interval)
    configs[out / "victoriametrics" / "scrape.yml"] = vmagent_config(nodes_files, interval)
    return {path: HEADER + yaml.safe_dump(config, sort_keys=False, width=120) for path, config in configs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a shipped file is out of date")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: the shipped files)")
    parser.add_argument("--shards", type=int, default=SHARDS, help=f"Prometheus shards (default {SHARDS}); every "
                        "shard must run: each keeps only its own and the next buckets")
    parser.add_argument("--replication", type=int, default=REPLICATION,
                        help=f"shards that scrape each node (default {REPLICATION})")
    parser.add_argument("--global", dest="globals_", action="append", metavar="URL",
                        help="a global view's remote-write URL (repeat for each; default: global-a and global-b)")
    parser.add_argument("--alertmanager", action="append", metavar="HOST:PORT", help="repeat for each")
    parser.add_argument("--nodes-files", default=NODES_FILES, help="the file_sd files listing the nodes")
    parser.add_argument("--rules", default=RULES, help="where the globals read deploy/prometheus/rules.yml")
    parser.add_argument("--interval", default="1m", help="scrape and evaluation interval (default 1m)")
    args = parser.parse_args()
    if not 1 <= args.replication <= args.shards:
        parser.error(f"--replication must be between 1 and --shards ({args.shards})")
    if args.check:
        stale = [str(path) for path, text in files().items() if not path.exists() or path.read_text() != text]
        if stale:
            print("out of date (run python deploy/sharded/render.py): " + ", ".join(stale), file=sys.stderr)
            return 1
        print("the shipped files are up to date")
        return 0
    chosen = files(args.out, args.shards, args.replication, tuple(args.globals_ or GLOBALS),
                   tuple(args.alertmanager or ALERTMANAGERS), args.nodes_files, args.rules, args.interval)
    for path, text in chosen.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
