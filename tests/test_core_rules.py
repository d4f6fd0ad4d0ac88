"""The core stages' planning on the run's plan (mfpipe.minisuite.rules, mfpipe.corpus.rules, mfpipe.stats.rules) and
the statistics merge's choice of partials (mfpipe.stats.merge.half_partials), without Snakemake."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from mfpipe.corpus import rules as corpus_rules
from mfpipe.minisuite import rules as minisuite_rules
from mfpipe.stats import rules as stats_rules
from mfpipe.stats.errors import StatsError
from mfpipe.stats.merge import half_partials
from mfpipe.workflow.plan import Plan


class Checkpoints:
    """Snakemake's checkpoints object, as the corpus checkpoint's done jobs give it."""

    def __init__(self, root):
        self.corpus_shards = SimpleNamespace(
            get=lambda corpus, model: SimpleNamespace(output=[f"{root}/corpus/{corpus}/{model}/shards"]))


@pytest.fixture
def plan(tmp_path):
    config = {
        "results": str(tmp_path / "results"),
        "corpus": {"name": "main"},
        "cross_corpora": [{"name": "other"}],
        "stats": {"shards_per_job": 2},
        "models": [{"name": "mini", "source": "minisuite", "revisions": ["step4", "step8"]},
                   {"name": "hub", "source": "hub", "hub_id": "org/hub", "revisions": ["main"]}],
        "minisuite": {"models": [{"name": "mini", "steps": 8}]},
    }
    plan = Plan(config, Path("src"), Checkpoints(tmp_path / "results"))
    for corpus, half, n in (("main", "stats", 5), ("main", "eval", 1), ("other", "stats", 1)):
        d = tmp_path / "results" / "corpus" / corpus / "mini" / "shards" / half
        d.mkdir(parents=True)
        for i in range(n):
            (d / f"shard-{i:05d}.npz").touch()
    return plan


def test_targets(plan):
    R = plan.results
    assert minisuite_rules.targets(plan) == [f"{R}/minisuite/mini/induction.csv", f"{R}/tables/induction.md"]
    assert corpus_rules.targets(plan) == [f"{R}/corpus/main/mini/tracked.json", f"{R}/corpus/main/hub/tracked.json",
                                          f"{R}/tables/coverage_positions.csv", f"{R}/tables/coverage_positions.md",
                                          f"{R}/corpus/main/mini/rank_frequency.csv",
                                          f"{R}/corpus/main/hub/rank_frequency.csv",  # fig:zipf (issue 44 item 5)
                                          f"{R}/tables/zipf_cutoff.csv", f"{R}/tables/zipf_cutoff.md",
                                          f"{R}/figures/zipf.pdf", f"{R}/figures/zipf.png"]
    stores = stats_rules.targets(plan)
    assert stores[:4] == [f"{R}/stats/mini/step8/{ds}.zarr" for ds in ("stats", "eval", "other/stats", "other/eval")]
    assert len(stores) == 8 and all("/step4/" not in s for s in stores)  # the rollout revisions only


def test_datasets_and_their_shards(plan):
    R = plan.results
    assert stats_rules.dataset_parts(plan, "stats") == ("main", "stats")
    assert stats_rules.dataset_parts(plan, "N32/stats") == ("main", "stats")  # a top-N arm: the primary corpus
    assert stats_rules.dataset_parts(plan, "other/eval") == ("other", "eval")
    assert stats_rules.datasets(plan) == ["stats", "eval"] and stats_rules.datasets(plan, "other")[0] == "other/stats"
    wc = SimpleNamespace(model="mini", revision="step4", dataset="stats", i="00002")
    assert stats_rules.stats_groups(plan, wc) == {"00000": ["00000", "00001"], "00002": ["00002", "00003"],
                                                  "00004": ["00004"]}
    assert stats_rules.stats_partials(plan, wc)[-1] == f"{R}/stats/mini/step4/partials/stats/group-00004"
    assert stats_rules.dataset_group_shards(plan, wc) == [
        f"{R}/corpus/main/mini/shards/stats/shard-{j}.npz" for j in ("00002", "00003")]
    other = SimpleNamespace(model="mini", revision="step4", dataset="other/stats", i="00000")
    assert stats_rules.dataset_shards_dir(plan, other) == f"{R}/corpus/other/mini/shards"
    assert stats_rules.shard_ids(plan, other) == ["00000"]
    with pytest.raises(ValueError, match="does not start a run"):
        stats_rules.dataset_group_shards(plan, SimpleNamespace(model="mini", dataset="stats", i="00001"))


def test_half_partials_one_per_shard_in_its_jobs_folder(tmp_path):
    shards = tmp_path / "shards"
    (shards / "stats").mkdir(parents=True)
    for i in range(3):
        (shards / "stats" / f"shard-{i:05d}.npz").touch()
    groups = [tmp_path / "p" / "group-00002", tmp_path / "p" / "group-00000"]
    for g, parts in zip(groups, (["00002"], ["00000", "00001"])):
        for s in parts:
            (g / f"shard-{s}.zarr").mkdir(parents=True)
    got = half_partials(map(str, groups), shards, "stats", "m", "r")
    assert got == [str(tmp_path / "p" / f"group-{g}" / f"shard-{s}.zarr")
                   for g, s in (("00000", "00000"), ("00000", "00001"), ("00002", "00002"))]
    with pytest.raises(StatsError, match="no statistics job folder holds corpus shard shard-00000"):
        half_partials([str(groups[0])], shards, "stats", "m", "r")
    (groups[1] / "shard-00001.zarr").rmdir()
    with pytest.raises(StatsError, match=r"shard-00001.zarr is missing; deleted it with its job's folder"):
        half_partials(map(str, groups), shards, "stats", "m", "r")
    assert not groups[1].exists()  # deleted: the rerun rebuilds the job's folder
    with pytest.raises(StatsError, match="the eval half has no shards"):
        half_partials(map(str, groups), shards, "eval", "m", "r")
