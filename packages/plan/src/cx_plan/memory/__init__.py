"""Bytes per rank of a candidate, by component, and whether they fit the device."""
