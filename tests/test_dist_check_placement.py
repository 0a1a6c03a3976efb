"""torch_dist_check.harness.placement: where ranks and peer-loss workers run when a node has fewer GPUs than slots.

Pure logic (GPU count, slots, NCCL version, sharing -> seats or a skip), so it is tested without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from torch_dist_check.harness import placement  # noqa: E402
from torch_dist_check.harness.placement import GPU_PER_RANK, HOST_IDS, MULTI_RANK_GPU, UNPLACED, place  # noqa: E402

STOCK = (2, 28, 9)
NEW = (2, 30, 7)


@pytest.mark.parametrize("sharing", placement.SHARING)
def test_enough_gpus_keep_one_gpu_per_slot_and_set_nothing(sharing):
    seats = place(2, [0, 1, 1, 1], STOCK, sharing, "node1")
    assert seats.kind == GPU_PER_RANK and seats.skip is None
    assert [s.device for s in seats.seats] == [0, 1, 1, 1]
    assert all(not s.env for s in seats.seats)


def test_two_ranks_on_one_gpu_through_the_network_get_one_host_id_each_with_any_nccl():
    for version in (STOCK, NEW, None):
        seats = place(1, range(2), version, "net", "node1.tdc")
        assert seats.kind == HOST_IDS and seats.skip is None
        assert [s.device for s in seats.seats] == [0, 0]
        ids = [s.env[placement.HOSTID_ENV] for s in seats.seats]
        assert len(set(ids)) == 2 and all(i.startswith("node1.tdc.") for i in ids)


def test_every_process_of_a_peerloss_case_gets_its_own_host_id():
    # two-world: survivor, victim, live, replacement (slots 0, 1, 1, 1) on one GPU
    seats = place(1, [0, 1, 1, 1], STOCK, "net", "h")
    assert len({s.env[placement.HOSTID_ENV] for s in seats.seats}) == 4
    assert {s.device for s in seats.seats} == {0}


def test_in_node_sharing_needs_nccl_2_30_and_says_so_otherwise():
    seats = place(1, range(2), NEW, "node", "h")
    assert seats.kind == MULTI_RANK_GPU
    assert all(s.env == {placement.MULTI_RANK_ENV: "1"} and s.device == 0 for s in seats.seats)
    refused = place(1, range(2), STOCK, "node", "h")
    assert refused.kind == UNPLACED
    assert "NCCL >= 2.30.0, loaded 2.28.9" in refused.skip and placement.MULTI_RANK_ENV in refused.skip
    assert "loaded unknown" in place(1, range(2), None, "node", "h").skip


def test_three_slots_on_two_gpus_share_round_robin():
    seats = place(2, [0, 1, 2], STOCK, "net", "h")
    assert seats.kind == HOST_IDS and [s.device for s in seats.seats] == [0, 1, 0]


def test_no_gpu_is_a_skip_with_the_reason():
    seats = place(0, range(2), STOCK, "net", "h")
    assert seats.skip == "no CUDA device is visible"


def test_the_description_names_the_placement_for_report_and_json():
    seats = place(1, range(2), STOCK, "net", "h")
    doc = seats.describe()
    assert doc["kind"] == HOST_IDS and doc["gpus"] == 1 and doc["processes"] == 2 and doc["devices"] == [0, 0]
    assert doc["env"][0] == {"NCCL_HOSTID": "h.0"} and doc["skip"] is None
    assert "one NCCL_HOSTID each" in seats.summary()


def test_bad_sharing_is_refused():
    with pytest.raises(ValueError, match="sharing must be one of net, node"):
        place(1, range(2), STOCK, "p2p", "h")


def test_peerloss_cases_are_placed_per_transport_on_one_gpu():
    from torch_dist_check.peerloss import cases as peerloss

    def case(kind, transport):
        return peerloss.PeerLossCase(kind, "nccl", transport, "allreduce", True)

    net = peerloss.case_placement(case("two-world", "net"), 1, STOCK)
    # survivor, victim, live peer, replacement: four host ids, all on GPU 0.
    assert net.kind == HOST_IDS and len({s.env[placement.HOSTID_ENV] for s in net.seats}) == 4
    assert peerloss.case_placement(case("single", "p2p"), 1, NEW).kind == MULTI_RANK_GPU
    assert "NCCL >= 2.30.0" in peerloss.case_placement(case("single", "shm"), 1, STOCK).skip
    # Two GPUs keep the survivor on GPU 0 and the rest on GPU 1; shrink's three ranks need a third.
    assert [s.device for s in peerloss.case_placement(case("single", "p2p"), 2, STOCK).seats] == [0, 1, 1]
    assert peerloss.case_placement(case("shrink", "net"), 2, STOCK).kind == HOST_IDS
    assert peerloss.case_placement(case("shrink", "p2p"), 3, STOCK).kind == GPU_PER_RANK
    assert peerloss.case_placement(peerloss.PeerLossCase("single", "gloo", None, "allreduce", True), 0, None) is None


def test_in_node_cases_on_one_gpu_with_an_old_nccl_are_skipped_without_starting_a_process():
    from torch_dist_check.peerloss import cases as peerloss
    from torch_dist_check.peerloss import runner

    cases = peerloss.cases_for("nccl", ["single", "shrink"], ["p2p", "shm"], ["allreduce"], ["on"])
    results = runner.run_cases(cases, peerloss.PeerLossSettings(init_timeout_s=1), gpus=1, nccl_version=STOCK)
    assert [r.status for r in results] == ["skipped"] * len(cases)
    assert all("loaded 2.28.9" in r.reason for r in results)
    assert results[0].details["placement"]["kind"] == UNPLACED


@pytest.mark.parametrize("gpus", [2, 4])
def test_one_rank_per_gpu_on_two_and_four_gpus_sets_nothing(gpus):
    # Issue 40's runs: two ranks on two GPUs, four on four (a Derecho node, mpiprocs=4:ngpus=4).
    seats = place(gpus, range(gpus), STOCK, "net", "h")
    assert seats.kind == GPU_PER_RANK and seats.skip is None
    assert [s.device for s in seats.seats] == list(range(gpus))
    assert all(not s.env for s in seats.seats)
    assert seats.summary() == f"{gpus} processes, one GPU each ({gpus} GPUs)"


def test_four_ranks_on_two_gpus_share_them_with_a_host_id_each_or_in_node_with_nccl_2_30():
    net = place(2, range(4), STOCK, "net", "h")
    assert net.kind == HOST_IDS and [s.device for s in net.seats] == [0, 1, 0, 1]
    assert len({s.env[placement.HOSTID_ENV] for s in net.seats}) == 4
    node = place(2, range(4), NEW, "node", "h")
    assert node.kind == MULTI_RANK_GPU and [s.device for s in node.seats] == [0, 1, 0, 1]
    assert place(2, range(4), STOCK, "node", "h").kind == UNPLACED
