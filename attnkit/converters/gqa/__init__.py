"""`attnkit convert --to gqa`: fewer KV heads (GQA/MQA) in the source's own architecture."""

from attnkit.converters.gqa.config import GQAConfig
from attnkit.registry import Method

METHODS = (
    Method("gqa", title="grouped-query attention with fewer KV heads (same architecture)",
           help="fewer KV heads (GQA/MQA) in the source's own architecture",
           converter="attnkit.converters.gqa.convert:convert", configs=(GQAConfig,), order=60),
)
