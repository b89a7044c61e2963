"""Titans retrofit (sliding-window attention + neural long-term memory, Memory as Gate), the
conversion side: `settings` (checks of --window/--chunk/--memory-*, the config fields, the memory
projections' start from the layer's own), `convert` (`--to titans`) and `card` (the model card's
note on its bounded state). The modules a converted model runs on are in `attnkit.adapters.titans`."""

from attnkit.converters.mla.config import MLAConfig
from attnkit.converters.titans.config import TitansConfig
from attnkit.registry import Method

METHODS = (
    Method("titans", title="sliding-window attention with a neural long-term memory (Titans, Memory as Gate)",
           help="window attention + a neural long-term memory: a cache that stops growing at --window",
           converter="attnkit.converters.titans.convert:convert_titans", configs=(TitansConfig,),
           summary="attnkit.converters.titans.convert:summary", card="attnkit.converters.titans.card:card_sections",
           order=40),
    Method("mla+titans", title="MLA + Titans (sliding-window attention with a neural long-term memory)",
           help="MLA, then Titans on its output", converter="attnkit.converters.titans.convert:convert_mla_titans",
           configs=(MLAConfig, TitansConfig), summary="attnkit.converters.titans.convert:summary",
           card="attnkit.converters.titans.card:card_sections", order=50),
)
