"""Where a run runs: the device mesh and shardings, joining processes, storage on disk and buckets, what
clip_jax wrote (ownership), checkpoints, stop signals, other packages' internals (version-checked), GPU facts and
XLA:GPU compiles without a GPU."""
