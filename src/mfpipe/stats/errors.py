"""The statistics stage's error: inconsistent input, with a message that says what to change."""


class StatsError(ValueError):
    """Inconsistent input to the statistics pass, with a message that says what to change."""
