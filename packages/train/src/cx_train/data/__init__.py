"""cx-train's data: the embedded grammar text and the user's own (`--data`), tokenised once into a cache and read
in a world-size-independent order."""
