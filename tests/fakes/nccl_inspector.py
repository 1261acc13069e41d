"""NCCL Inspector's log lines, as its profiler plugin writes them (NCCL's plugins/profiler/inspector, v4.0 lines):
the plugin needs NCCL and GPUs these machines lack, so tests write its lines for the ranks that stand in."""

from __future__ import annotations

import json


def line(rank: int, sn: int, exec_us: int, verbose: bool = False, host: str = "node-a") -> str:
    """One collective as the plugin writes it (one JSON object a line)."""
    perf: dict[str, object] = {"coll": "AllReduce", "coll_sn": sn, "coll_msg_size_bytes": 17179869184,
                               "coll_exec_time_us": exec_us, "coll_timing_source": "kernel_gpu",
                               "coll_algobw_gbs": 277.210914, "coll_busbw_gbs": 485.119099}
    if verbose:
        perf["event_trace_sn"] = {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
            {"channel_id": 0, "kernel_start_sn": 3, "kernel_stop_sn": 48, "kernel_record_sn": 47}]}
    return json.dumps({"header": {"id": "0x7f8c496ae9f661", "comm_name": "DP Group 0", "rank": rank, "n_ranks": 8,
                                  "nnodes": 1},
                       "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "",
                                    "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": 1748030377748202,
                                    "hostname": host, "pid": 1639453},
                       "coll_perf": perf}, separators=(",", ":")) + "\n"
