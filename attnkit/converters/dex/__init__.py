"""DEX (differential extension) retrofit, the conversion side: `heads` (head scores and selection,
the config fields) and `convert` (`--to dex` and `--to mla+dex`). The modules a converted model
runs on are in `attnkit.adapters.dex`."""

from attnkit.converters.dex.config import DexConfig
from attnkit.converters.mla.config import MLAConfig
from attnkit.registry import Method

METHODS = (
    Method("dex", title="DEX differential extension", help="DEX on selected heads (logits unchanged at conversion)",
           converter="attnkit.converters.dex.convert:convert_dex", configs=(DexConfig,),
           summary="attnkit.converters.dex.convert:summary", order=10),
    Method("mla+dex", title="MLA + DEX differential extension", help="MLA, then DEX on its output",
           converter="attnkit.converters.dex.convert:convert_mla_dex", configs=(MLAConfig, DexConfig),
           summary="attnkit.converters.dex.convert:summary", order=30),
)
