"""mfpipe.workflow.costs: the run's benchmark files summed by rule and stage."""

import pandas as pd
import pytest

from mfpipe.workflow.costs import cost_tables, costs_markdown, read_benchmarks

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def bench(path, s, rss, cpu):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + f"{s}\t0:00:{int(s):02d}\t{rss}\t1\t1\t1\t0\t0\t50\t{cpu}\n")


def test_costs_by_rule_and_stage(tmp_path):
    b = tmp_path / "benchmarks"
    bench(b / "stats_shard" / "stats" / "m" / "r" / "stats" / "shard-0.tsv", 10.0, 500, 9.0)
    bench(b / "stats_shard" / "stats" / "m" / "r" / "stats" / "shard-1.tsv", 14.0, 700, 13.0)
    bench(b / "stats_merge" / "stats" / "m" / "r" / "stats" / "merge.tsv", 4.0, 300, 2.0)
    bench(b / "substitution" / "substitution" / "m" / "r.tsv", 20.0, 900, 38.0)
    (b / "figure_x").mkdir()
    (b / "figure_x" / "short.tsv").write_text(HEADER + "0.5\t0:00:00\tNA\tNA\tNA\tNA\tNA\tNA\tNA\tNA\n")
    jobs = read_benchmarks(b)
    assert len(jobs) == 5 and set(jobs["rule"]) == {"stats_shard", "stats_merge", "substitution", "figure_x"}
    assert jobs.loc[jobs["rule"] == "substitution", "job"].item() == "substitution/m/r"
    by_rule, by_stage = cost_tables(jobs, {"stats_shard": "stats", "stats_merge": "stats",
                                           "substitution": "substitution"})
    shard = by_rule.set_index("rule").loc["stats_shard"]
    assert shard["jobs"] == 2 and shard["wall_s"] == pytest.approx(24.0) and shard["max_s"] == 14.0
    assert shard["max_rss_mb"] == 700 and shard["cores"] == pytest.approx(22.0 / 24.0)
    st = by_stage.set_index("stage")
    assert st.loc["stats", "wall_s"] == pytest.approx(28.0) and st.loc["substitution", "cores"] == pytest.approx(1.9)
    assert st.loc["figure_x", "wall_s"] == pytest.approx(0.5)  # a rule without a stage is its own
    assert by_stage["share"].sum() == pytest.approx(1.0) and by_stage["wall_s"].is_monotonic_decreasing
    md = costs_markdown(by_rule, by_stage)
    assert "48 s over 5 jobs" in md and "## By stage" in md and "| stats | 3 | 28 |" in md


def test_no_benchmarks_is_an_empty_table(tmp_path):
    jobs = read_benchmarks(tmp_path)
    assert isinstance(jobs, pd.DataFrame) and jobs.empty
    by_rule, by_stage = cost_tables(jobs, {})
    assert by_rule.empty and by_stage.empty
