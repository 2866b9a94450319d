"""``LRAttnResCheckpointManager`` inside torchtitan's own save: every save gets a complete
checksum record once it has finished (an async one at the next save or at ``wait_and_record``),
and torchtitan's purge (``keep_latest_k``) never removes a checkpoint before the newer one is
recorded. One process, a one-rank gloo group (torchtitan's purge and async save need one)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.titan_lrattnres._tiny import checkpointer
from titan_lrattnres.components import integrity


@pytest.fixture
def world_of_one(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def manager(folder, async_mode: str):
    return checkpointer(folder, interval=2, keep_latest_k=2, async_mode=async_mode)


def complete(step) -> bool:
    return integrity.read_record(step)["complete"]


def test_sync_saves_are_recorded_then_purged(world_of_one, tmp_path):
    ckpt = manager(tmp_path, "disabled")
    folder = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        assert ckpt.save(step)
        assert complete(folder / f"step-{step}") and ckpt.last_saved == str(folder / f"step-{step}")
    ckpt.close()  # the purge thread finishes its queue
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-6"]
    assert all(integrity.problem(folder / f"step-{n}") is None for n in (4, 6))


def test_async_saves_are_recorded_at_the_next_save_and_purged_after(world_of_one, tmp_path):
    ckpt = manager(tmp_path, "async")
    folder = tmp_path / "checkpoint"
    ckpt.save(2)
    ckpt.save(4)  # waits for step 2 and records it; step 4 is under way
    assert complete(folder / "step-2") and not complete(folder / "step-4")
    ckpt.save(6)
    # three step folders, keep 2: step-2 stays while step-6 is unrecorded
    assert complete(folder / "step-4") and not complete(folder / "step-6")
    assert (folder / "step-2").is_dir()
    ckpt.wait_and_record()  # the trainer's end of training
    ckpt.close()
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-6"]
    assert all(integrity.problem(folder / f"step-{n}") is None for n in (4, 6))


def test_config_keeps_model_only_loads_and_says_nothing_without_a_path(caplog, tmp_path):
    """torchtitan's default (a model-only initial load) is kept, and its warning that the
    default does nothing without an initial_load_path is not logged for a run from scratch."""
    import logging

    from titan_lrattnres.components.checkpoint import LRAttnResCheckpointManager

    with caplog.at_level(logging.WARNING):
        scratch = LRAttnResCheckpointManager.Config(enable=True)
    assert scratch.initial_load_model_only is True
    assert "initial_load_model_only" not in caplog.text, caplog.text
    seeded = LRAttnResCheckpointManager.Config(enable=True, initial_load_path=str(tmp_path))
    assert seeded.initial_load_model_only is True
    with pytest.raises(ValueError, match="initial_load_path must be an absolute path"):
        LRAttnResCheckpointManager.Config(enable=True, initial_load_path="relative")
