"""tigana.tools — the ``tigana`` command line (``tigana.tools.cli``) and benchmarks (``tigana.tools.bench``).

``tigana.tools.testing`` (the simulator, the fault harness, the nemesis) is testing code: in a checkout, not in
the installed package."""
