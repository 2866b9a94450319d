"""The paper's ~0.5B grid (docs/method.md §6) for GPU clusters, generated programmatically.

Recipe: ``paper_0p5b`` flavor, seq 2048, global batch 128 sequences = 262,144 tokens,
38,146 steps (10B tokens // 262,144, as the paper's script: 9,999,745,024 tokens), WSD schedule
(2,000 warmup steps, the last 7,629 = round(20%) linear to 0.1x), seed 42.
Optimiser and loss: the paper's (``train_configs.recipe``): Muon (Polar Express, NorMuon,
cautious wd 0.1, lr 1e-3, momentum 0.85 -> 0.95 over 300 steps and back over the last 100) for
every >= 2-D weight but embedding and head, each MLP's ``[w1; w3]`` one matrix (the paper's
fused ``fc1``); AdamW (lr 3e-4, betas (0.9, 0.95), eps 1e-8, wd 0) for the embedding, LM head
and depth queries; gradient clip 1.0; z-loss 1e-5 (validation reports CE, and CE + z).
``paper_*_float8``: the same with torchao rowwise float8 for every attention / MLP projection
(LM head and the embedding's key projection kept in bf16;
``titan_lrattnres.components.float8``). Dataset and tokenizer are set by the user
(``--dataloader.dataset hf_text --dataloader.dataset_path ... --hf_assets_path ...``); the
flavor's vocabulary is cl100k-sized (100,277).

Names: ``paper_baseline``, ``paper_attnres_{full,block4,block8,block16}``,
``paper_sliced_full_r{16..512}``, ``paper_sliced_block{4,8,16}_r64``,
``paper_projected_full_r{16,32,64}``, ``paper_projected_block{4,8,16}_r32``; each also with
the suffix ``_float8``.
"""

from __future__ import annotations

from functools import partial

from titan_lrattnres.components.float8 import Float8Rowwise
from train_configs.common import make_config
from train_configs.recipe import with_paper_recipe

SEQ_LEN = 2048
GLOBAL_BATCH_SEQS = 128  # 262,144 tokens
TOTAL_TOKENS = 10_000_000_000
# the paper's max_steps: floor, not ceiling (38,147 would start the LR decay and the momentum
# cooldown one step late)
STEPS = TOTAL_TOKENS // (SEQ_LEN * GLOBAL_BATCH_SEQS)  # 38,146
SEED = 42  # the paper's


def _grid() -> dict[str, tuple[str, int | None, int]]:
    """name -> (variant, blocks (None = Full), rank)."""
    g: dict[str, tuple[str, int | None, int]] = {"paper_baseline": ("baseline", None, 64)}
    for n in (None, 4, 8, 16):
        g[f"paper_attnres_{'full' if n is None else f'block{n}'}"] = ("attnres", n, 1024)
    for r in (16, 32, 64, 128, 256, 512):
        g[f"paper_sliced_full_r{r}"] = ("sliced", None, r)
    for n in (4, 8, 16):
        g[f"paper_sliced_block{n}_r64"] = ("sliced", n, 64)
    for r in (16, 32, 64):
        g[f"paper_projected_full_r{r}"] = ("projected", None, r)
    for n in (4, 8, 16):
        g[f"paper_projected_block{n}_r32"] = ("projected", n, 32)
    return g


GRID = _grid()


def paper_config(name: str, local_batch_size: int = 4, float8: bool = False):
    variant, blocks, rank = GRID[name]
    config = make_config(
        name=f"{name}_float8" if float8 else name,
        flavor="paper_0p5b",
        variant=variant,
        blocks=blocks,
        rank=rank,
        seq_len=SEQ_LEN,
        local_batch_size=local_batch_size,
        global_batch_size=GLOBAL_BATCH_SEQS,
        steps=STEPS,
        lr=1e-3,
        lr_embed=3e-4,
        lr_head=3e-4,
        lr_query=3e-4,
        warmup_steps=2000,
        decay_ratio=0.2,
        min_lr_factor=0.1,
        dataset="hf_text",
        val_dataset="hf_text_val",
        val_freq=2000,
        val_steps=100,
        checkpoint_interval=1000,
        compile=True,
        cpu=False,
        log_freq=10,
        seed=SEED,
    )
    config.checkpoint.keep_latest_k = 3
    config = with_paper_recipe(config, variant=variant)
    if float8:
        converter = Float8Rowwise.Config(model_compile_enabled=config.compile.enable).build()
        converter.convert(config.model_spec.model)  # in place: Linear configs are nested
    return config


def _named(name: str, float8: bool = False):
    f = partial(paper_config, name, float8=float8)
    f.__name__ = f.__qualname__ = f"{name}_float8" if float8 else name
    f.__doc__ = f"docs/method.md §6 recipe, {GRID[name]} (variant, blocks, rank)" + (
        ", float8 rowwise." if float8 else "."
    )
    return f


CONFIGS = {f.__name__: f for name in GRID for f in (_named(name), _named(name, float8=True))}
