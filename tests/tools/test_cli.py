"""The `tigana` console script as a user runs it."""

import json
import subprocess
import sys


def _tigana(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tigana.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_version() -> None:
    out = _tigana("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("tigana ")


def test_help_lists_bench() -> None:
    out = _tigana("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout


# An install from the wheel has no tigana.tools.testing: this finder, first on the import path, makes it so.
_NO_TESTING_ROOM = """
import sys

class _NoTestingRoom:
    def find_spec(self, name, path=None, target=None):
        if name == "tigana.tools.testing" or name.startswith("tigana.tools.testing."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTestingRoom())
from tigana.tools.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_bench_cases_of_the_testing_room_say_where_they_run_on_an_install_without_it() -> None:
    """``tigana bench sim|faults|nemesis`` (and ``failover``, built on the fault harness) are listed, and on an
    install without the testing room exit 2 with one line saying they run from a checkout; nothing else runs."""
    listed = subprocess.run([sys.executable, "-c", _NO_TESTING_ROOM, "bench", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    for case in ("sim", "faults", "nemesis", "failover"):
        assert case in listed.stdout
        out = subprocess.run([sys.executable, "-c", _NO_TESTING_ROOM, "bench", case], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2, (case, out.stderr)
        assert out.stdout == ""
        assert out.stderr.strip().splitlines() == [
            f"tigana bench {case}: runs from a checkout of the repository: it is built on tigana.tools.testing (the "
            "simulator, the fault harness, the nemesis), testing code that the installed package leaves out; in a "
            "checkout, pip install -e . and run it there"]


def test_bench_sim_runs_from_a_checkout() -> None:
    """In a checkout the testing room is there: ``tigana bench sim`` runs the simulator (one short seed)."""
    out = _tigana("bench", "sim", "--seeds", "1", "--busy", "2")
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert (line["case"], line["seeds"], line["violations"]) == ("sim", 1, 0)
    assert line["steps"] > 0


def test_bench_sim_jobs_report_what_one_process_reports() -> None:
    """``--jobs 2`` runs the seeds in two worker processes; each seed is deterministic wherever it runs, so the
    report is the one process's, timings aside."""
    lines = []
    for jobs in ("1", "2"):
        out = _tigana("bench", "sim", "--seeds", "2", "--busy", "1", "--jobs", jobs)
        assert out.returncode == 0, out.stderr
        lines.append(json.loads(out.stdout.strip().splitlines()[-1]))
    timing = {"jobs", "seconds", "sim_speed", "wall_speed"}
    assert lines[1]["jobs"] == 2 and lines[0]["steps"] > 0
    assert {k: v for k, v in lines[0].items() if k not in timing} == {k: v for k, v in lines[1].items()
                                                                       if k not in timing}
