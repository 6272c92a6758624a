"""Where a rank sits: torchrun's and SLURM's variables, --ranks-per-node, and refusals that name the variable."""

from __future__ import annotations

import pytest

from tigana.trainer.distributed import DistEnv, read_env


def test_torchrun_variables() -> None:
    env = read_env(environ={"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert env == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
                          master_addr="10.0.0.1", master_port=1234)
    assert env.num_nodes == 2 and not env.is_leader
    assert env.node_ranks == [4, 5, 6, 7] and env.leader_ranks == [0, 4]


def test_slurm_fallback() -> None:
    env = read_env(environ={"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                            "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1",
                            "SLURM_JOB_NODELIST": "gpu[07-08]", "MASTER_PORT": "29400"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 1, 2, 1)
    assert env.master_addr == "gpu07" and env.master_port == 29400


def test_single_process_and_simulated_nodes() -> None:
    assert read_env(environ={}) == DistEnv()
    env = read_env(ranks_per_node=2, environ={"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                                               "LOCAL_RANK": "2", "GROUP_RANK": "0"})
    assert (env.local_rank, env.local_world_size, env.node_rank, env.is_leader) == (0, 2, 1, True)


@pytest.mark.parametrize(("environ", "ranks_per_node", "message"), [
    ({"RANK": "4", "WORLD_SIZE": "4"}, None, "RANK=4"),
    ({"RANK": "0", "WORLD_SIZE": "6"}, 4, "WORLD_SIZE=6"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, None, "RANK"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, None,
     "contiguous"),
    ({}, 0, "ranks_per_node"),
])
def test_inconsistent_values_are_refused(environ, ranks_per_node, message) -> None:
    with pytest.raises(ValueError, match=message):
        read_env(ranks_per_node=ranks_per_node, environ=environ)
