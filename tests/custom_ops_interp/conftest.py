"""Triton kernels under TRITON_INTERPRET=1 on CPU tensors. Run as its OWN pytest process:

    PYTHONPATH=. pytest tests/custom_ops_interp

The variable must be set before any ``@triton.jit`` kernel is defined, so it is set here, at
import, before ``custom_ops.kernels`` is imported; it would break torch.compile/opcheck tests,
hence the separate process.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

_LATE = "custom_ops.kernels.common" in sys.modules


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "custom_ops_interp" in str(item.fspath):
            item.add_marker(pytest.mark.interpret)
            if _LATE:
                item.add_marker(
                    pytest.mark.skip(
                        reason="custom_ops.kernels was imported before TRITON_INTERPRET=1; "
                        "run tests/custom_ops_interp in its own pytest process"
                    )
                )
