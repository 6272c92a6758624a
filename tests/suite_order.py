"""The files that take the most CPU, heaviest first, measured with ``make test`` on 2 cores (CPU seconds of the
test process and every process it started: ``TIGANA_CPU_REPORT=FILE make test``, see conftest.py).

``make test`` runs each file on one pytest-xdist worker and hands files out in collection order
(``--no-loadscope-reorder``; xdist's default orders them by their number of tests). The conftest's
``pytest_collection_modifyitems`` puts these files first: started first, the long files overlap the many short
ones, and neither worker waits out a long file alone at the end of the run."""

HEAVIEST_FIRST = (
    "trainer/test_elastic.py",           # 108 s (was 116 s with an undisturbed run beside the kill -9 one)
    "tools/test_bench_nemesis.py",       # 103 s (236 s before its clients paused 100 ms between pushes)
    "faults/test_resharding.py",         # 73 s
    "faults/test_fault_suite.py",        # 64 s
    "tools/test_slurm_launch.py",        # 49 s
    "tools/test_bench_cluster.py",       # 44 s
    "tools/test_admin_cli.py",           # 29 s
    "trainer/test_movielens_auc.py",     # 28 s
    "trainer/test_train_cli.py",         # 27 s
    "sim/test_scenarios.py",             # 27 s
    "trainer/test_launch_env.py",        # 26 s
    "faults/test_readme_startup.py",     # 26 s
    "faults/test_failover.py",           # 25 s
    "tools/test_bench_serving.py",       # 24 s
    "faults/test_ha_scheduler.py",       # 22 s
    "faults/test_domains.py",            # 11-27 s wall run alone under load (not measured with the plugin)
    "trainer/test_predict.py",           # 18 s
    "faults/test_durability.py",         # 18 s
    "trainer/test_loop.py",              # 18 s
)
