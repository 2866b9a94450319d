"""Triton kernels under TRITON_INTERPRET=1 on CPU tensors. Run as its OWN pytest process:

    PYTHONPATH=. pytest tests/custom_ops_interp

The variable must be set before any ``@triton.jit`` kernel is defined, so it is set here, at
import, before ``custom_ops.kernels`` is imported; it would break torch.compile/opcheck tests,
hence the separate process.

Every test here runs with NaN-filled fresh buffers (``nan_filled_buffers``): the launchers'
``torch.empty`` / ``empty_like`` / ``new_empty`` outputs start as NaN, so an element a kernel
should write but does not fails the comparison with the reference instead of passing on
whatever the allocator returned.
"""

import functools
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# custom_ops.kernels loaded WITHOUT the interpreter (imported by an earlier test module of the
# same process while TRITON_INTERPRET was unset): its kernels cannot run on CPU tensors here.
_LATE = (
    "custom_ops.kernels.common" in sys.modules
    and not sys.modules["custom_ops.kernels.common"].INTERPRET
)


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


def _nan_filled(make):
    @functools.wraps(make)
    def fresh(*args, **kwargs):
        out = make(*args, **kwargs)
        if out.is_floating_point() and out.numel():
            out.fill_(float("nan"))
        return out

    return fresh


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    """``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return NaN-filled floats."""
    monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _nan_filled(torch.Tensor.new_empty))
