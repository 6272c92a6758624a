"""The files that take the most CPU, heaviest first, measured with ``make test`` on 2 cores (CPU seconds of the
test process and every process it started: ``pytest -n auto --dist loadfile --cpu-report FILE``, see conftest.py;
December 7, 2026, on a loaded machine: the figures run high, their order holds). That run had OpenMP's passive
wait in every process, since taken out (it exposes a race in test_predict): test_elastic, the file it moved
most, has the figure of two runs of the file alone without it (126.5 and 133.3); the other files that start
trainers (test_tuned_defaults, test_predict, test_bench_serving...) run a few seconds higher without it.

``make test`` runs each file on one pytest-xdist worker and hands files out in collection order
(``--no-loadscope-reorder``; xdist's default orders them by their number of tests). The conftest's
``pytest_collection_modifyitems`` puts these files first: started first, the long files overlap the many short
ones, and neither worker waits out a long file alone at the end of the run."""

HEAVIEST_FIRST = (
    "trainer/test_elastic.py",              # 130 s
    "faults/test_resharding.py",            # 78 s
    "tools/test_bench_nemesis.py",          # 74 s
    "faults/test_fault_suite.py",           # 55 s
    "tools/test_slurm_launch.py",           # 55 s
    "tools/test_bench_cluster.py",          # 47 s
    "sim/test_simulator.py",                # 42 s
    "tools/test_admin_cli.py",              # 37 s
    "sim/test_scenarios.py",                # 36 s
    "faults/test_readme_startup.py",        # 31 s
    "trainer/test_launch_env.py",           # 31 s
    "faults/test_ha_scheduler.py",          # 30 s
    "trainer/test_train_cli.py",            # 30 s
    "ps/test_checkpoint_cut.py",            # 30 s
    "faults/test_failover.py",              # 25 s
    "faults/test_durability.py",            # 23 s
    "tools/test_bench_serving.py",          # 22 s
    "ps/test_checkpoint.py",                # 20 s
    "trainer/test_predict.py",              # 20 s
)
