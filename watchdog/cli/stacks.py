"""`stacks dump` (capture the live ranks' stacks and name the odd one) and `stacks analyze` (saved dumps)."""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from watchdog.act import membership
from watchdog.act.actions import Actions
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error, open_nvml, shown
from watchdog.config import Config, load_config
from watchdog.sample.ranks import Job, RankDiscovery, RankInfo
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.confirm import look_twice
from watchdog.stacks.picture import StackPicture, write_captures
from watchdog.stacks.text import render as render_stacks
from watchdog.vocabulary.model import NodeSnapshot


def print_pictures(pictures: list[StackPicture], as_json: bool) -> None:
    for number, picture in enumerate(pictures):
        if as_json:
            print(json.dumps(picture.to_json()))
        else:
            print(("\n" if number else "") + shown(render_stacks(picture)))


def describe_pids(discovery: RankDiscovery, pids: list[int]) -> tuple[list[RankInfo], list[int]]:
    """The processes named with --pid, and the pids that do not exist."""
    ranks = [r for r in (discovery.describe(pid) for pid in pids) if r is not None]
    return ranks, sorted(set(pids) - {r.pid for r in ranks})


def cmd_stacks_dump(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    discovery = RankDiscovery()
    if args.pid:
        ranks, missing = describe_pids(discovery, args.pid)
        if missing:
            error(f"warning: no such process: {', '.join(map(str, missing))}")
    else:
        found = _ranks_on_gpus(discovery, args.gpu, config)
        if found is None:
            return EXIT_FAILURE
        ranks = found
    if args.job:
        seen = sorted({r.job_key for r in ranks})
        ranks = [r for r in ranks if r.job_key in args.job]
        if not ranks:
            error(f"no ranks of {', '.join(args.job)} found; jobs seen: {', '.join(seen) or 'none'}")
            return EXIT_FAILURE
    if not ranks:
        error("no training ranks found (looked for processes on the GPUs, or with RANK/LOCAL_RANK and WORLD_SIZE "
              "in their environment); name them with --pid")
        return EXIT_FAILURE
    s = config.stacks
    try:
        capturer = StackCapturer.from_config(s)
    except ValueError as exc:
        error(f"{args.config or 'the configuration'}: {exc}")
        return EXIT_USAGE
    jobs = proven_jobs(ranks, config)
    # Each job's evidence waits on its own (the Flight Recorder's dumps, NCCL RAS, a second look where the first
    # shows a hang): all at once, so a machine running several jobs costs the slowest job's wait, not the sum.
    with ThreadPoolExecutor(max_workers=min(8, len(jobs)), thread_name_prefix="job") as pool:
        pictures = list(pool.map(lambda job: look_twice(job, capturer, discovery, s), jobs))
    print_pictures(pictures, args.json)
    if args.out:
        for picture in pictures:
            folder = (Path(args.out) / picture.job.replace(":", "_").replace("/", "_") if len(pictures) > 1
                      else args.out)
            try:
                written = write_captures(folder, picture)
            except OSError as exc:
                error(f"--out {folder}: cannot write there ({exc.strerror or exc}); the stacks are printed above")
                return EXIT_FAILURE
            print(f"wrote {len(written)} files to {folder}", file=sys.stderr)
    if all(c.result != "ok" for p in pictures for c in p.captures):
        return EXIT_FAILURE
    return EXIT_OK


def proven_jobs(ranks: list[RankInfo], config: Config) -> list[Job]:
    """The ranks split into jobs as the daemon splits them: the jobs proven by what their processes cannot
    choose (launcher tree, slurmstepd's cgroup confirmed by Slurm, the pod), then the other processes by the
    job they claim, said as claimed, so a process of another user that claims a job is never in its picture."""
    return membership.pictured(ranks, Actions(config.actions).slurm_job_runs_as)


def _ranks_on_gpus(discovery: RankDiscovery, gpus: list[int] | None, config: Config) -> list[RankInfo] | None:
    """--gpu N / --all: the compute processes NVML lists; without NVML, --all scans for launched ranks."""
    source = open_nvml(config, "--gpu needs NVML. Name the processes with --pid instead." if gpus else None)
    if source is None:
        return None if gpus else discovery.scan()
    try:
        snapshot = source.sample()
    finally:
        source.close()
    if gpus:
        snapshot = NodeSnapshot(snapshot.time_seconds, tuple(g for g in snapshot.gpus if g.index in gpus))
    return discovery.from_snapshot(snapshot) or ([] if gpus else discovery.scan())
