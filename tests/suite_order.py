"""The files that take the most CPU, heaviest first, measured with ``make test`` on 2 cores (CPU seconds of the
test process and every process it started: ``pytest -n auto --dist loadfile --cpu-report FILE``, see conftest.py;
December 7, 2026, on a loaded machine: the figures run high, their order holds).

``make test`` runs each file on one pytest-xdist worker and hands files out in collection order
(``--no-loadscope-reorder``; xdist's default orders them by their number of tests). The conftest's
``pytest_collection_modifyitems`` puts these files first: started first, the long files overlap the many short
ones, and neither worker waits out a long file alone at the end of the run."""

HEAVIEST_FIRST = (
    "tools/test_bench_nemesis.py",          # 154 s
    "trainer/test_elastic.py",              # 137 s
    "trainer/test_movielens_auc.py",        # 75 s
    "faults/test_resharding.py",            # 66 s
    "trainer/test_tuned_defaults.py",       # 60 s
    "faults/test_fault_suite.py",           # 60 s
    "tools/test_slurm_launch.py",           # 49 s
    "sim/test_simulator.py",                # 42 s
    "tools/test_admin_cli.py",              # 35 s
    "sim/test_scenarios.py",                # 34 s
    "tools/test_bench_cluster.py",          # 30 s
    "ps/test_checkpoint_cut.py",            # 30 s
    "tools/test_bench_serving.py",          # 28 s
    "trainer/test_launch_env.py",           # 26 s
    "faults/test_failover.py",              # 26 s
    "trainer/test_train_cli.py",            # 25 s
    "faults/test_ha_scheduler.py",          # 24 s
    "trainer/test_predict.py",              # 23 s
    "tools/test_bench_quality.py",          # 23 s
    "faults/test_readme_startup.py",        # 23 s
    "tools/test_bench_train.py",            # 23 s
    "trainer/test_loop.py",                 # 22 s
    "ps/test_checkpoint.py",                # 22 s
    "faults/test_durability.py",            # 21 s
)
