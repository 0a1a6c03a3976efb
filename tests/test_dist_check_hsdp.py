"""The peer-loss train-hsdp case on CPU (gloo): an FSDP2 HSDP job (2 replicas x 2 shards) loses a rank.

gloo runs the whole case for real: the 2-D DeviceMesh built from the job's own groups, FSDP2
``fully_shard`` on it, the surviving replica moving its shards into a 1-D job and training on alone,
the partner and a replacement forming a new world with the survivors, the shards sent over gloo's
broadcast, and every rank's parameters checked bitwise against a one-process replay. gloo has no
abort, so rank 0 waits out the replicate group's 5 s timeout (its partner is stuck in its own
replica): the times here are not the GPU's (docs/records/README.md has those).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch_peer_watcher")

from torch_dist_check.peerloss import cases as peerloss  # noqa: E402
from torch_dist_check.peerloss import runner  # noqa: E402
from torch_dist_check.peerloss import hsdp, hsdp_worker  # noqa: E402
from torch_dist_check.report.results import PASS  # noqa: E402


def test_the_replay_combines_replica_gradients_as_hsdp_and_learns() -> None:
    import torch

    model, losses, digests = hsdp_worker.replay(16, 1234, torch.device("cpu"), [4, 4, 2, 2, 4] * 4)
    assert all(len(step) == world for step, world in zip(losses, [4, 4, 2, 2, 4] * 4))
    assert sum(losses[-1]) < sum(losses[0])
    # The same schedule replays to the same bits; another schedule (the same batches, other
    # per-rank rows) to other bits: the digest sees the topology of every step.
    assert hsdp_worker.replay(16, 1234, torch.device("cpu"), [4, 4, 2, 2, 4] * 4)[2] == digests
    assert hsdp_worker.replay(16, 1234, torch.device("cpu"), [4] * 20)[2][19] != digests[19]


def test_train_hsdp_is_a_case_of_its_own_with_median_and_worst_goals() -> None:
    cases = peerloss.cases_for("gloo", ["train-hsdp"], ["p2p"], ["allreduce"], ["on", "off"])
    assert [c.name for c in cases] == ["peerloss/gloo/train-hsdp/watcher"]
    summary = {"first_step_s": {"median": 0.4, "worst": 0.9, "n": 10}}
    assert peerloss.goals_met(summary, cases[0]) == {"first_step_s": True, "first_step_s_median": True}
    summary = {"first_step_s": {"median": 0.6, "worst": 0.9, "n": 10}}
    assert peerloss.goals_met(summary, cases[0]) == {"first_step_s": True, "first_step_s_median": False}


@pytest.mark.heavy
def test_an_hsdp_job_on_gloo_trains_on_alone_and_heals_bitwise_equal_to_the_replay() -> None:
    # Five processes importing torch: 5.7 s alone on an idle 2-core machine (rank 0 no longer waits out the
    # replicate group's 5 s timeout); heavy, to keep the default run short.
    settings = peerloss.PeerLossSettings(init_timeout_s=90, recover_timeout_s=60, runs=1, train_width=64, train_steps_after=2)
    [result] = runner.run_cases(peerloss.cases_for("gloo", ["train-hsdp"], ["p2p"], ["allreduce"], ["on"]), settings)
    assert result.status == PASS, result.reason + " " + str(result.details.get("runs"))
    [run] = result.details["runs"]
    assert run["phase"] in peerloss.TRAIN_PHASES
    assert run["params_equal"] and run["replay_equal"] and run["alone_replay_equal"] and run["loss_worst_rel"] == 0.0
    assert run["agree_after_steps"] == 0 and run["alone_steps"] >= 1
    assert 0 < run["exception_s"] <= run["first_step_s"] and run["transfer_s"] <= run["join_s"]
    # The survivor's verdict and its settle's split, as the train cases report them.
    assert 0 < run["detected_s"] <= run["exception_s"] and 0 <= run["judged_s"] <= run["abort_s"], run
    for figure in ("first_step_s", "join_s", "transfer_s"):
        assert figure in result.details["summary"]
    # The join's split: every stage, in order, none negative, adding up to the join (issue 55).
    split = run["join_split"]
    assert list(split) == [name for name, _ in hsdp.JOIN_STAGES] and min(split.values()) >= 0
    assert abs(sum(split.values()) - run["join_s"]) < 0.01, (split, run["join_s"])
    assert set(run["join_by_role"]) == set(hsdp.TRAINERS)
