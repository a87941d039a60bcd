"""The btnode command line (installed as the `btnode_cli` package; the folder is cli/)."""
