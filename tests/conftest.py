"""Suite-wide settings.

Hypothesis runs derandomized (examples derived from each test's source), with
no example database, so a run never depends on an earlier run or on luck:
the same checkout gives the same examples on every machine.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ds4quant",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ds4quant")
