"""cx-train's model (the reference GPT, a preset, a folder or a config.json) and the plugin that trains it."""
