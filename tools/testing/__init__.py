"""tigana.tools.testing — the testing room: code that tests Tigana, kept out of the installed package (as
TigerBeetle keeps ``src/testing/``). Imported from a checkout (``pip install -e .``), by the tests and by
``tigana bench sim|faults|nemesis`` (and the benchmarks built on them: ``failover``, ``durability``); from an
install without it those exit 2 saying so.

- ``sim``: the deterministic simulator: the real protocol cores over a seeded network, clock and disk;
- ``faults``: the fault harness: kills, pauses, partitions, disks, corruption, hostile requests, a soak;
- ``nemesis``: a cluster started as the README says, under planned operations and faults, with a history checker.
"""
