"""The nn.Modules converted models run on; importing this package registers them with the Auto classes."""

from attnkit.adapters.modeling_attnkit import register as _register_retrofits
from attnkit.adapters.modeling_attnkit_mla import register as _register_latent

_register_retrofits()
_register_latent()
