"""Step time of a candidate: FLOPs, collectives over the links, the pipeline bubble and the host's share."""
