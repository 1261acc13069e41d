"""The one renderer of an episode's sentence (watchdog/vocabulary/telling.py): the parts in their order, each said
once."""

from __future__ import annotations

from watchdog.vocabulary.telling import Telling


def test_the_episode_alone_is_its_summary() -> None:
    assert Telling("HANG (critical): GPU 4 idle. Busy spin on GPUs 0-3.").sentence() == \
        "HANG (critical): GPU 4 idle. Busy spin on GPUs 0-3"


def test_the_action_comes_first_then_the_episode_the_doctor_and_what_was_not_seen() -> None:
    told = Telling("HANG (critical): GPU 4 idle", doctor="P2P reads fail between GPUs 0 and 4; set NCCL_P2P_DISABLE=1",
                   notes=("stopping: stacks not captured",), action="ACTED: terminated ranks 0-3 of job run:x after "
                   "2 min 0 s of hang", evidence="/var/lib/stall-watchdog/bundles/b1")
    assert told.sentence() == (
        "ACTED: terminated ranks 0-3 of job run:x after 2 min 0 s of hang; evidence: /var/lib/stall-watchdog/bundles/b1"
        ". HANG (critical): GPU 4 idle. Doctor: P2P reads fail between GPUs 0 and 4; set NCCL_P2P_DISABLE=1"
        ". Not seen: stopping: stacks not captured")


def test_each_part_is_kept_as_a_field_and_said_once() -> None:
    told = Telling("WAITING (warning): GPUs 0-6 wait on GPU 7", doctor="kernel 5.4", action="DRY RUN: would drain n1")
    again = Telling(told.summary.replace("WAITING (warning)", "HANG (critical)"), told.doctor, told.notes,
                    told.action, told.evidence)
    for sentence in (told.sentence(), again.sentence()):
        assert sentence.count("Doctor: kernel 5.4") == 1 and sentence.count("DRY RUN") == 1
    assert told.to_json() == {"summary": told.summary, "doctor": "kernel 5.4", "notes": [], "action": told.action,
                              "evidence": ""}
