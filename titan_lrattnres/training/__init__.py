"""Training: the entry point (``train``), the Trainer subclass (``trainer``), the run summary
(``summary``) and running torchtitan on a machine without an accelerator (``cpu``)."""
