"""DIFF (differential attention) retrofit, the conversion side: `layer` (the per-head norm
initialisation, the config fields) and `convert` (`--to diff`). The modules a converted model
runs on are in `attnkit.adapters.diff`."""
