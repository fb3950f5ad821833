"""`cx-plan --measure`: the ranked candidates run on this machine, measured beside their predictions."""
