"""Titans retrofit (sliding-window attention + neural long-term memory, Memory as Gate), the
conversion side: `settings` (checks of --window/--chunk/--memory-*, the config fields, the memory
projections' start from the layer's own) and `convert` (`--to titans`). The modules a converted
model runs on are in `attnkit.adapters.titans`."""
