"""The text loader of every named config: one data order at any data-parallel world size.

torchtitan 0.3.0's ``HuggingFaceTextDataLoader`` hands rank r the r-th contiguous slice of the
documents (``datasets.distributed.split_dataset_by_node``) and packs each slice on its own. A
2-rank run then trains on other sequences than one process at the same global batch, and its
loader state is one entry per rank (``dp_rank_<r>``) that torchtitan refuses to load at another
world size ("dataloader resharding is not supported yet").

``GlobalOrderDataLoader`` instead packs the whole document stream on every rank, exactly as one
process does, and gives rank r sequences ``r, r + W, r + 2W, ...`` of it (W = data-parallel
ranks). At local batch B, step k's batches of the W ranks together are the stream's sequences
``[kBW, (k+1)BW)``: the batch one process draws at local batch BW (in another order inside the
batch; the loss is a sum over tokens, so only the rounding of the sum can differ). After every
step all ranks hold the same state (the stream position after whole rounds of W sequences),
which the checkpoint stores once; any world size resumes from it at the same place in the
stream, so a run can move between world sizes at a fixed global batch without a skipped or
repeated sequence. With W = 1 the order is torchtitan's.

Cost: each rank tokenizes and packs the whole stream and keeps 1/W of it, W times the tokenizer
work of torchtitan's sharding (one process's worth per rank: small next to a training step at
the sizes this project runs; an offline-tokenized corpus would remove it).

Checkpoint entry: ``{"dp_rank_0": JSON {"format", "dataset"}, "world_size": W}``. The key is the
one torchtitan's loader writes for rank 0, so a checkpoint of a one-process run made before
this loader (a pickle of the StatefulDataLoader state, the same stream order) still resumes;
one made by torchtitan's loader at more ranks is refused (its per-rank slices have no global
position).
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
from dataclasses import dataclass

from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset
from torchtitan.tools.logging import logger

FORMAT = "global_order/1"
_KEY = "dp_rank_0"


class GlobalOrderTextDataset(HuggingFaceTextDataset):
    """torchtitan's packed text stream, unsharded; yields every ``dp_world_size``-th sequence
    starting at ``dp_rank``. Samples: ``({"input": [T], "positions": [T]}, labels [T])`` int64."""

    def __init__(self, *, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dp_rank=0, dp_world_size=1, **kwargs)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def __iter__(self):
        stream = super().__iter__()
        while True:
            # Draw a whole round before yielding, so the state between yields is the same on
            # every rank.
            round_ = list(itertools.islice(stream, self.dp_world_size))
            if len(round_) < self.dp_world_size:
                return  # finite stream (validation): every rank drops the same part round
            yield round_[self.dp_rank]


class _PlainData(pickle.Unpickler):
    """Unpickles containers and scalars only: no class or function is ever looked up."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused: the loader state references {module}.{name}")


class GlobalOrderDataLoader(HuggingFaceTextDataLoader):
    """``HuggingFaceTextDataLoader`` with one data order for every world size (module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        pass

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        dataset = GlobalOrderTextDataset(
            dataset_name=config.dataset,
            dataset_path=config.dataset_path,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=config.infinite,
        )
        ParallelAwareDataloader.__init__(
            self,
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
            batch_size=local_batch_size,
        )
        if config.num_workers:
            # The workers would hold the stream position; the checkpoint reads it from here.
            raise ValueError("GlobalOrderDataLoader runs its dataset in the main process only")

    def state_dict(self) -> dict:
        # The live position, not StatefulDataLoader's snapshot plus batches to replay: a replay
        # counts local batches, which differ in size at another world size.
        state = {"format": FORMAT, "dataset": self.dataset.state_dict()}
        return {_KEY: json.dumps(state).encode(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict or _KEY not in state_dict:
            logger.warning("no data loader state in the checkpoint: the data order restarts")
            return
        blob, saved_world = state_dict[_KEY], state_dict.get("world_size", 1)
        if blob[:1] == b"{":
            state = json.loads(blob)
            if state.get("format") != FORMAT:
                raise ValueError(
                    f"data loader state of format {state.get('format')!r}; "
                    f"this code reads {FORMAT!r}"
                )
            self.dataset.load_state_dict(state["dataset"])
            if saved_world != self.dp_world_size:
                logger.info(
                    f"data order resumed from a checkpoint written at {saved_world} data-"
                    f"parallel ranks, now {self.dp_world_size}"
                )
            return
        if saved_world != 1:
            raise ValueError(
                f"the checkpoint's data loader state was written by torchtitan's per-rank "
                f"loader at {saved_world} ranks (each rank its own slice of the documents); it "
                "has no position in the global order. Resume it with the code that wrote it, "
                "or pass --checkpoint.exclude_from_loading dataloader to restart the data order."
            )
        StatefulDataLoader.load_state_dict(self, _PlainData(io.BytesIO(blob)).load())
