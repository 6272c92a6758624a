"""``tigana bench scale`` end to end on tiny sizes: real shard daemons and real client processes, every curve,
the JSON lines' keys, positive CPU figures, peers taken from the first point of each curve, nothing left running;
and ``--plot`` without matplotlib fails at once, naming the extra."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tigana.tools import cli
from tigana.tools.bench import scale
from tigana.tools.bench.scale import bench as scale_bench

TINY = ["bench", "scale", "--shards", "1,2", "--clients", "1,2", "--rows", "20k,50k", "--batches", "1024,4096",
        "--base-rows", "20000", "--batch", "2048", "--repeats", "2", "--unit-rows", "16384", "--dim", "8"]
KEYS = {"case", "unit", "value", "peer", "peer_value", "ratio", "curve", "shards", "clients", "rows", "batch",
        "unique_ids", "dim", "wire", "optimizer", "zipf", "staleness", "repeats", "quick", "full",
        "client_cpu_s_per_m", "server_cpu_s_per_m", "rows_timed"}
AXIS = {"shards": "shards", "clients": "clients", "rows": "rows", "batch": "batch"}


def _children() -> set[int]:
    """Live descendants of this process (zombies too: a child not reaped is one left behind)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            data = stat.read_bytes()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(data[data.rindex(b")") + 2:].split()[1])
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - out
        out |= frontier
    return out


def test_bench_scale_prints_every_curve(bench_lines, tmp_path):
    before = _children()
    assert cli.main(TINY) == 0
    lines = bench_lines()
    assert _children() <= before  # every shard daemon and client process stopped

    curves = [d for d in lines if d["case"] != "scale.rows.memory"]
    expected = {(f"scale.{c}.{k}", u, x) for c, xs in (("shards", (1, 2)), ("clients", (1, 2)),
                                                         ("rows", (20000, 50000)), ("batch", (1024, 4096)))
                for k in ("pull", "push", "step") for u in ("rows/s", "cpu_s/M rows") for x in xs}
    assert {(d["case"], d["unit"], d[AXIS[d["curve"]]]) for d in curves} == expected
    assert len(curves) == len(expected)
    for d in curves:
        assert set(d) >= KEYS, KEYS - set(d)
        assert d["value"] > 0 and d["peer_value"] > 0, d  # CPU of the client processes is always counted
        assert abs(d["ratio"] - d["value"] / d["peer_value"]) <= 2e-3 * d["ratio"]
        assert d["dim"] == 8 and d["wire"] == "fp32" and d["optimizer"] == "adagrad" and d["repeats"] == 2
        assert d["client_cpu_s_per_m"] > 0 and d["server_cpu_s_per_m"] >= 0
        if d["unit"] == "cpu_s/M rows":
            assert d["value"] == pytest.approx(d["client_cpu_s_per_m"] + d["server_cpu_s_per_m"], rel=2e-3, abs=1e-3)
        first = min(x[2] for x in expected if x[0] == d["case"])  # the peer is the first point of the curve
        peer = next(e for e in curves if e["case"] == d["case"] and e["unit"] == d["unit"]
                    and e[AXIS[d["curve"]]] == first)
        assert d["peer_value"] == peer["value"]
        if d[AXIS[d["curve"]]] == first:
            assert d["ratio"] == 1.0
    # the daemons did the server half of the work: their CPU shows over a curve's points
    assert sum(d["server_cpu_s_per_m"] for d in curves if d["unit"] == "cpu_s/M rows") > 0
    # the clients curve ran 2 client processes: twice the rows of 1 in each timed repeat
    pulls = {d["clients"]: d["rows_timed"] for d in curves if d["case"] == "scale.clients.pull"}
    assert pulls[2] == 2 * pulls[1]

    memory = [d for d in lines if d["case"] == "scale.rows.memory"]
    assert [d["rows"] for d in memory] == [20000, 50000]
    for d in memory:
        assert d["unit"] == "bytes/row" and d["value"] > 8 * 4 * 2  # at least weights and Adagrad's accumulator


def test_plot_needs_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match=r"tigana\[plot\]"):
        cli.main([*TINY, "--plot", str(tmp_path / "scale.png")])
    assert not (tmp_path / "scale.png").exists()


def test_plot_draws_the_four_curves(tmp_path):
    pytest.importorskip("matplotlib")
    lines = []
    for curve, xs in (("shards", (1, 2, 4)), ("clients", (1, 2, 4)), ("rows", (10**6, 10**7)),
                      ("batch", (4096, 65536))):
        for kind in ("pull", "push", "step"):
            for unit, value in (("rows/s", 3e6), ("cpu_s/M rows", 0.3)):
                for x in xs:
                    lines.append({"case": f"scale.{curve}.{kind}", "unit": unit, "value": value, "curve": curve,
                                  "shards": 2, "clients": 1, "rows": 10**6, "batch": 65536, "dim": 64, "zipf": 1.05,
                                  AXIS[curve]: x})
    scale.plot(lines, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_size_that_does_not_fit_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(scale_bench, "_mem_available", lambda: 8 << 30)
    before = _children()
    with pytest.raises(SystemExit, match=r"100,000,000 resident rows at dim 64 need about 57\.6 GB"):
        cli.main(["bench", "scale", "--full", "--curves", "rows"])
    assert _children() == before


def test_bench_scale_tiered_spills_most_rows_and_stays_within_its_budget(bench_lines) -> None:
    """``--tiered`` at toy size: a 4 MiB budget per daemon holds about a third of 200k rows, the rest live in
    the spill files, while the daemons snapshot every half second; every case has its measured peer, the RSS line
    names the budget and counts the snapshots, and nothing is left running."""
    before = _children()
    argv = ["bench", "scale", "--tiered", "--tiered-rows", "200k", "--memory-budget", "4MiB", "--ram-rows", "50k",
            "--tiered-dim", "8", "--quick", "--repeats", "1", "--snapshot-every", "0.5"]
    assert cli.main(argv) == 0
    by = {d["case"]: d for d in bench_lines()}
    assert set(by) == {"scale.tiered.insert", "scale.tiered.pull", "scale.tiered.push", "scale.tiered.rss",
                       "scale.tiered.disk"}
    for d in by.values():
        assert d["value"] > 0 and d["peer_value"] > 0 and d["rows"] == 200_000 and d["memory_budget"] == 4 << 20
        assert d["snapshot_every"] == 0.5
    rss = by["scale.tiered.rss"]
    assert rss["snapshots"] >= 2  # a benchmark, not a test: that they ran, not how much memory they took
    # ``value`` (the largest anonymous RSS) is rounded to 4 significant digits by ``emit``; the parameters are
    # exact, so a flat RSS (max == median) once read as value < median: compare within that rounding
    peak = rss["value"] * (1 + 5e-4)
    assert rss["rss_with_file_pages"] * (1 + 5e-4) >= rss["value"] and peak >= rss["anon_median"]
    assert rss["anon_median"] > rss["anon_at_start"] > 0
    assert rss["rss_samples"] > 10 and rss["peer_value"] == pytest.approx((4 << 20) + rss["anon_at_start"], rel=1e-3)
    disk = by["scale.tiered.disk"]
    assert disk["rows_spilled"] > disk["rows_resident"] > 0
    assert disk["rows_spilled"] + disk["rows_resident"] == 200_000
    assert 0 < by["scale.tiered.pull"]["ram_hit_rate"] < 1
    assert _children() <= before
