"""Operating a run: metrics writers (TensorBoard, the progress line), W&B, device telemetry, the run report."""
