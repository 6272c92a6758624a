"""``tigana bench table`` runs end to end at toy sizes."""

from __future__ import annotations

import argparse

from tigana.tools.bench import table as bench_table


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_table_prints_one_json_line_per_case(bench_lines) -> None:
    args = _args(bench_table, ["--quick", "--distinct", "5000", "--rows", "3000", "--batch", "512",
                               "--dims", "8", "--repeats", "2"])
    assert bench_table.run(args) == 0
    lines = bench_lines()
    cases = [line["case"] for line in lines]
    assert cases == ["table.lookup", "table.lookup_or_insert", "table.update_rowwise_adagrad",
                     "hashtable.lookup", "table.capacity", "table.push_during_snapshot"]
    for line in lines:
        assert {"case", "unit", "value", "peer", "peer_value", "ratio"} <= set(line)
        assert line["value"] > 0 and line["peer_value"] > 0
    assert lines[-2]["rows_resident"] == 3000 and lines[0]["dim"] == 8
    # the RSS figures ride along (at a toy size freed memory is reused and they may read 0)
    assert {"rss_bytes_per_row", "peer_rss_bytes_per_row"} <= set(lines[-2]) and "dict" in lines[-2]["peer"]
    assert "randn" in lines[1]["peer"]  # lookup_or_insert's own limit, not the lookup's
    assert lines[-1]["rows"] == 3000 and lines[-1]["pushes_during"] >= 5
