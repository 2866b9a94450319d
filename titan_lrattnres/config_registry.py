"""Named experiments for ``--module titan_lrattnres --config NAME`` (see train_configs/)."""
