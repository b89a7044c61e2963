"""DEX (differential extension) retrofit, the conversion side: `heads` (head scores and selection,
the config fields) and `convert` (`--to dex` and `--to mla+dex`). The modules a converted model
runs on are in `attnkit.adapters.dex`."""
