"""The statistics stage's error: inconsistent input, with a message that says what to change."""


class StatsError(ValueError):
    """Inconsistent input to the statistics pass, with a message that says what to change."""


class PartialError(StatsError):
    """A per-shard partial that cannot be merged (unreadable, damaged, or not what its shard's job wrote); ``path``
    names it and ``why`` says what is wrong, so the merge can delete it and have the rerun rebuild it."""

    def __init__(self, path, why: str):
        self.path, self.why = str(path), why
        super().__init__(f"statistics partial {path} {why}; delete it and rerun the stats_shard step")
