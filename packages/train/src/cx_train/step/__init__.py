"""cx-train's training step: optimizer and schedule, accumulation and clipping, evaluation, a clean Ctrl-C."""
