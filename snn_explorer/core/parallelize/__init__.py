"""One module per parallelism, each a function that shards a model in place (``apply_ddp``,
``apply_fsdp2``, ``apply_tp``, ``apply_pp``, activation checkpointing); :func:`~..distribute.apply`
composes them as a plan says."""
