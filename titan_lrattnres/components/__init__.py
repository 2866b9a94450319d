"""Training components built from torchtitan configs: optimizers (``optimizers``, ``muon``), the
z-loss (``zloss``), float8 (``float8``), data (``data``, ``loader``) and checkpoints
(``integrity``, ``convert``)."""
