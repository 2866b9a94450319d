"""Hypothesis profiles: ``ci`` (set by .ci/run) replays a fixed, derandomised set of examples so
CI is reproducible; locally (``dev``) every run explores new examples. A failing property prints
the smallest failing case and the blob to reproduce it."""

import os

import pytest
from hypothesis import settings

settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters empty before the test and reset after it (compile tests
    that count graphs and recompiles: ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
