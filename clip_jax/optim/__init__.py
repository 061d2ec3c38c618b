"""Optimizers: AdamW with OpenCLIP's decay mask and schedule, StableAdamW, LiT tower locking."""
