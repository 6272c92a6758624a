"""The files that take the most CPU, heaviest first, measured with ``make test`` on 2 cores (CPU seconds of the
test process and every process it started, December 2026).

``make test`` runs each file on one pytest-xdist worker and hands files out in collection order
(``--no-loadscope-reorder``; xdist's default orders them by their number of tests). The conftest's
``pytest_collection_modifyitems`` puts these files first: started first, the long files overlap the many short
ones, and neither worker waits out a long file alone at the end of the run."""

HEAVIEST_FIRST = (
    "trainer/test_elastic.py",           # 116 s
    "tools/test_bench_nemesis.py",       # ~85 s (236 s before its clients paused 100 ms between pushes)
    "faults/test_resharding.py",         # 58 s
    "faults/test_fault_suite.py",        # 51 s
    "tools/test_slurm_launch.py",        # 50 s
    "tools/test_bench_cluster.py",       # 40 s
    "faults/test_readme_startup.py",     # 35 s
    "faults/test_failover.py",           # 30 s
    "trainer/test_train_cli.py",         # 30 s
    "faults/test_ha_scheduler.py",       # 28 s
    "sim/test_scenarios.py",             # 28 s
    "trainer/test_launch_env.py",        # 28 s
    "tools/test_admin_cli.py",           # 26 s
    "faults/test_durability.py",         # 20 s
    "trainer/test_loop.py",              # 19 s
)
