"""DIFF (differential attention) retrofit, the conversion side: `layer` (the per-head norm
initialisation, the config fields) and `convert` (`--to diff`). The modules a converted model
runs on are in `attnkit.adapters.diff`."""

from attnkit.converters.diff.config import DiffConfig
from attnkit.registry import Method

METHODS = (
    Method("diff", title="DIFF differential attention retrofit",
           help="differential attention on every head (logits unchanged at conversion)",
           converter="attnkit.converters.diff.convert:convert_diff", configs=(DiffConfig,), order=20),
)
