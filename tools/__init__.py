"""tigana.tools — the ``tigana`` command line (``tigana.tools.cli``) and benchmarks (``tigana.tools.bench``)."""
