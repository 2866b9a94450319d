"""Training: the Trainer subclass (``trainer``), the run summary (``summary``) and running
torchtitan on a machine without an accelerator (``cpu``). The command is
``titan_lrattnres.train``."""
