"""GQA / MHA / MQA -> MLA (a dense DeepSeek-V3 checkpoint), one module per job:

- `layer`: the math of one layer (RoPE plan, balance, joint low-rank factorisation), pure functions;
- `rope`, `refit`, `budget`: RoPE bookkeeping, the NoPE query refit, KV-budget arithmetic;
- `native`: the DeepSeek-V3 target (config and tensor names);
- `source`: the source model streamed one layer at a time;
- `settings`, `metrics`, `report`: validated options, error measures, `attnkit_report.json`;
- `candidates`: measured candidate conversions (`--kv-budget`);
- `choice`: split choices measured on whole conversions, run by one loop; its two rules:
  `heal_choice` (`--choose-by heal`, the least-KL finalists healed briefly, the best kept) and
  `fit_choice` (`--choose-by fit`, a walk along rope_dim to the split of least fitted KL);
- `card`: what the model card says of an output with an MLA part (serving, fine-tuning);
- `convert`: the driver (plan, then execute).
"""

from attnkit.converters.mla.config import MLAConfig
from attnkit.registry import Method

METHODS = (
    Method("mla", title="multi-head latent attention (MLA, DeepSeek-V2/V3 style)",
           help="GQA/MHA/MQA -> a dense DeepSeek-V3 MLA checkpoint (a smaller KV cache)",
           converter="attnkit.converters.mla.convert:convert", configs=(MLAConfig,),
           card="attnkit.converters.mla.card:card_sections", order=0),
)
