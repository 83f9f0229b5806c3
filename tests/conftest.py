"""Shared test settings: small thread counts (CI has 2 cores), a local Ray bound to loopback,
and no inherited RAY_ADDRESS (a developer's cluster must not be joined by the tests; the tests
that join one set it themselves)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("RAY_ADDRESS", None)
