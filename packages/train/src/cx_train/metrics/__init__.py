"""What cx-train reports: the progress line, `--metrics` JSON Lines, TensorBoard scalars, memory, MFU and plots."""
