"""The files that take the most CPU, heaviest first, measured with ``make test`` on 2 cores (CPU seconds of the
test process and every process it started: ``pytest -n auto --dist loadfile --cpu-report FILE``, see conftest.py;
December 8, 2026, on a machine other test runs loaded: the figures run high, by a quarter even for the
simulator's pure-CPU files, and their order holds). Every process ran with OpenMP's passive wait
(``OMP_WAIT_POLICY=PASSIVE``, set in tests/conftest.py).

``make test`` runs each file on one pytest-xdist worker and hands files out in collection order
(``--no-loadscope-reorder``; xdist's default orders them by their number of tests). The conftest's
``pytest_collection_modifyitems`` puts these files first: started first, the long files overlap the many short
ones, and neither worker waits out a long file alone at the end of the run."""

HEAVIEST_FIRST = (
    "tools/test_bench_nemesis.py",          # 102 s
    "faults/test_resharding.py",            # 99 s
    "trainer/test_elastic.py",              # 87 s
    "faults/test_fault_suite.py",           # 86 s
    "tools/test_slurm_launch.py",           # 68 s
    "tools/test_bench_cluster.py",          # 45 s
    "sim/test_scenarios.py",                # 45 s
    "faults/test_failover.py",              # 41 s
    "tools/test_admin_cli.py",              # 41 s
    "trainer/test_launch_env.py",           # 40 s
    "sim/test_simulator.py",                # 39 s
    "trainer/test_train_cli.py",            # 36 s
    "faults/test_durability.py",            # 30 s
    "sim/test_mutations.py",                # 30 s
    "tools/test_bench_serving.py",          # 29 s
    "trainer/test_predict.py",              # 27 s
    "faults/test_readme_startup.py",        # 26 s
    "faults/test_ha_scheduler.py",          # 24 s
    "ps/test_checkpoint_cut.py",            # 21 s
)
