"""cx-train's checkpoints: model, optimizer, schedule and trainer state committed as one unit, verified on resume."""
