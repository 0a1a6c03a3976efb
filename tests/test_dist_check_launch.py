"""Rank discovery of torch_dist_check on the variables each launcher sets (pure functions, no torch)."""

from __future__ import annotations

import pytest

from torch_dist_check.harness.launch import DEFAULT_PORT, LaunchError, batch_job, discover_rank, first_host, tasks_on_node


def test_torchrun_variables_win_over_mpi_ones():
    env = {
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node7", "MASTER_PORT": "29500", "PMI_RANK": "0", "PMI_SIZE": "8",
    }  # fmt: skip
    info = discover_rank(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("torchrun", 3, 8, 1, 4)
    assert (info.master_addr, info.master_port) == ("node7", 29500)
    assert not info.is_mpi_launch


def test_spawned_ranks_are_labelled_spawn():
    env = {"RANK": "1", "WORLD_SIZE": "2", "TORCH_DIST_CHECK_SPAWNED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000"}
    assert discover_rank(env).launcher == "spawn"


def test_open_mpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n0",
    }  # fmt: skip
    info = discover_rank(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("openmpi", 5, 8, 1, 4)
    assert info.is_mpi_launch
    assert info.master_port == DEFAULT_PORT


def test_mpich_hydra_variables_on_one_node_rendezvous_on_loopback():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = discover_rank(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("mpich", 1, 2, 1)
    assert info.master_addr == "127.0.0.1"


def test_cray_pals_takes_rank_from_pals_and_size_from_pmi():
    env = {"PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PMI_RANK": "6", "PMI_SIZE": "8", "PMI_LOCAL_SIZE": "4", "MASTER_ADDR": "dec0001"}
    info = discover_rank(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("cray-pals", 6, 8, 2, 4)


def test_cray_pals_without_a_size_is_a_launch_error():
    with pytest.raises(LaunchError, match="PMI_SIZE"):
        discover_rank({"PALS_RANKID": "0"})


def test_srun_variables_and_first_node_as_master():
    env = {
        "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "nid[001-002]",
    }  # fmt: skip
    info = discover_rank(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert info.master_addr == "nid001"


def test_a_batch_script_is_not_mistaken_for_an_srun_step():
    # sbatch sets SLURM_PROCID=0 and SLURM_NTASKS, but not SLURM_STEP_NUM_TASKS.
    info = discover_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "nid[001-002]"})
    assert (info.launcher, info.world_size) == ("single", 1)


def test_no_launcher_is_a_single_process():
    info = discover_rank({})
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("single", 0, 1, "127.0.0.1")


def test_multi_node_mpi_job_without_master_addr_has_none():
    info = discover_rank({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "0"})
    assert info.master_addr is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "outside world size"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "2"}, "local rank"),
    ],
)
def test_inconsistent_variables_are_launch_errors(env, message):
    with pytest.raises(LaunchError, match=message):
        discover_rank(env)


@pytest.mark.parametrize(
    "spec, node, expected",
    [("4(x2)", 1, 4), ("4(x2),3", 2, 3), ("2,1", 1, 1), ("8", 0, 8)],
)
def test_slurm_tasks_per_node(spec, node, expected):
    assert tasks_on_node(spec, node) == expected


@pytest.mark.parametrize(
    "nodelist, host",
    [("nid[001-004,007]", "nid001"), ("gpu12,gpu13", "gpu12"), ("node[3-4]-ib", "node3-ib"), ("login1", "login1")],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def _node_file(tmp_path, *hosts: str) -> str:
    path = tmp_path / "nodefile"
    path.write_text("".join(f"{host}\n" for host in hosts))
    return str(path)


def test_a_multi_node_pbs_job_rendezvous_on_the_first_host_of_its_node_file(tmp_path):
    """Derecho: `mpiexec -n 8 -ppn 4` in a job of select=2:mpiprocs=4 (Cray PALS, no MASTER_ADDR)."""
    nodefile = _node_file(tmp_path, *["dec0101"] * 4, *["dec0102"] * 4)
    env = {"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1", "PALS_NODEID": "1", "PMI_SIZE": "8", "PBS_NODEFILE": nodefile}
    info = discover_rank(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("cray-pals", 5, 8, 1, 4)
    assert info.master_addr == "dec0101"
    # MPICH's Hydra in a PBS job: the same fallback.
    hydra = discover_rank({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALNRANKS": "4", "PBS_NODEFILE": nodefile})
    assert hydra.master_addr == "dec0101"


def test_a_pals_node_outside_the_node_file_and_an_unreadable_node_file_are_launch_errors(tmp_path):
    nodefile = _node_file(tmp_path, "dec0101", "dec0101")
    with pytest.raises(LaunchError, match="PALS_NODEID=2 is outside the 1 nodes"):
        discover_rank({"PALS_RANKID": "0", "PALS_NODEID": "2", "PMI_SIZE": "2", "PBS_NODEFILE": nodefile})
    with pytest.raises(LaunchError, match="cannot read PBS_NODEFILE"):
        discover_rank({"PMI_RANK": "0", "PMI_SIZE": "2", "PBS_NODEFILE": str(tmp_path / "gone")})


def test_the_batch_job_is_named_for_the_report(tmp_path):
    nodefile = _node_file(tmp_path, "pbsnode", "pbsnode")
    assert batch_job({"PBS_JOBID": "12.pbsnode", "PBS_QUEUE": "workq", "PBS_NODEFILE": nodefile}) == {
        "system": "pbs", "job_id": "12.pbsnode", "queue": "workq", "hosts": ["pbsnode", "pbsnode"],
    }  # fmt: skip
    assert batch_job({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"})["system"] == "slurm"
    assert batch_job({}) is None
