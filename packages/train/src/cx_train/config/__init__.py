"""cx-train's flags, config files and the validated `TrainOptions` they become."""
