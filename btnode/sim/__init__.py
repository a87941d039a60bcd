"""The virtual async simulator: the daemon's round and aggregation code on a virtual clock."""
