"""Which source configs the MLA converter takes, and the one-line reason for those it refuses."""

import pytest

from attnkit.converters.families import describe
from attnkit.errors import AttnkitError

BASE = {"model_type": "mistral", "max_position_embeddings": 32768, "rope_parameters": {"rope_type": "default"}}


@pytest.mark.parametrize(
    "extra, accepted",
    [
        ({"sliding_window": None}, True),
        ({"sliding_window": 32768}, True),  # a window as long as the context changes nothing
        ({"sliding_window": 4096, "use_sliding_window": False}, True),  # Qwen2-style switch off
        ({"sliding_window": 4096}, False),  # Mistral-7B-v0.1
    ],
)
def test_sliding_window_is_refused_only_when_it_acts(extra, accepted):
    config = {**BASE, **extra}
    if accepted:
        assert describe(config).model_type == "mistral"
    else:
        with pytest.raises(AttnkitError, match="sliding window of 4096 tokens"):
            describe(config)
