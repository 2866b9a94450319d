"""Hypothesis profiles: ``ci`` (set by .ci/run) replays a fixed, derandomised set of examples so
CI is reproducible; locally (``dev``) every run explores new examples. A failing property prints
the smallest failing case and the blob to reproduce it."""

import os

from hypothesis import settings

settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
