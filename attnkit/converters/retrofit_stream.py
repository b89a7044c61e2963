"""The in-place retrofits (`--to dex | diff | titans | mla+…`) streamed one decoder layer at a time.

A retrofit keeps every source tensor and adds a few per layer, so its output is the source's
weights plus the new modules' — nothing needs the whole model in memory. Two passes over the
layers, each holding one layer (fp32) and the hidden states of a few rows:

1. calibration: the calibration rows through each layer with the entropy-recording attention
   (`calibration.py`), the held-out rows through the source layer (SDPA);
2. rewrite: each layer again, with the method's modules installed and initialised from the
   statistics of pass 1 (DEX's head choice needs every layer's scores first); the held-out rows
   through it, its tensors (source + new) written as they are.

The logits of both held-out streams give the report's error and perplexities; the config, the
modeling code and the generation config are written as `save_pretrained` would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch

from attnkit.converters.calibration import (BLOCK_BYTES, TOKENS_PER_BATCH, CalibrationStats, attention_token_bytes,
                                            calibration_attention, rows_per_batch)
from attnkit.converters.measure import measure_streams
from attnkit.converters.mla.source import Source, embedded, layer_window, lm_head_name, source_pe, through
from attnkit.converters.stream.engine import stream_layers
from attnkit.io.checkpoint import ShardedWriter
from attnkit.converters.stream.rowstore import RowStore

# (attention module of one layer, after install; calibration stats) -> None: set the new weights
InitLayerFn = Callable[[torch.nn.Module, dict], None]


def window_of(src: Source, module: torch.nn.Module, layer: int) -> int | None:
    """The sliding window `layer` attends through (None: every earlier token), as transformers' masks
    apply it: per layer type (Gemma-3), per module (Qwen2's sliding layers) or from the config (Mistral)."""
    if src.family.by_layer_type:
        return layer_window(src, layer)
    window = getattr(module.self_attn, "sliding_window", None)
    if window is None and src.family.sliding_window == "config":
        window = getattr(src.hf_config, "sliding_window", None)
    return int(window) if window else None


def causal_mask(length: int, window: int | None, device, always: bool = False) -> torch.Tensor | None:
    """Boolean [1, 1, T, T] mask, True = attend: causal, within `window` when given. None where SDPA's
    own causal flag computes the same (no window inside T), unless `always` (the calibration
    attention function takes its mask from here)."""
    if not always and (window is None or window >= length):
        return None
    pos = torch.arange(length, device=device)
    delta = pos[:, None] - pos[None, :]  # [T, T] query - key
    keep = delta >= 0
    if window is not None:
        keep &= delta < window
    return keep[None, None]


def _layer_io(src: Source, module: torch.nn.Module, layer: int, length: int, device, calibrating: bool = False):
    pe = source_pe(src, length, device, layer)
    return through(module, pe, causal_mask(length, window_of(src, module, layer), device, always=calibrating))


def held_rows_per_batch(config, length: int, tokens_per_batch: int = TOKENS_PER_BATCH) -> int:
    """Rows per batch of a held-out stream (SDPA): at most `tokens_per_batch` tokens, and at most one
    block (calibration.BLOCK_BYTES) of fp32 attention weights [rows, H, T, T]. SDPA's CPU math path
    materialises those whole; it is the path a DeepSeek-V3 layer takes (its value heads are narrower
    than its query/key heads, which the fused kernel does not take): 4 rows of 512 tokens through 32
    heads held 0.33 GB of them."""
    per_row = 4 * int(config.num_attention_heads) * length * length
    return max(1, min(rows_per_batch(length, tokens_per_batch), BLOCK_BYTES // per_row))


@torch.no_grad()
def calibration_pass(src: Source, calib: RowStore, held: RowStore, device,
                     tokens_per_batch: int = TOKENS_PER_BATCH) -> dict:
    """Pass 1: per layer and head, entropy and output RMS on `calib` (advanced through every layer);
    `held` advanced through the source layers. Batches of rows as the whole-model pass
    (`calibration.calibrate`) takes them, sized by the attention's width (`rows_per_batch`), so the
    statistics are those of a whole-model calibration, bit for bit. The held-out rows (SDPA, no
    statistics) in batches of `held_rows_per_batch`."""
    length = calib.row_shape[0]
    stats = CalibrationStats(src.config["num_hidden_layers"], src.hf_config.num_attention_heads)
    rows = rows_per_batch(length, tokens_per_batch, attention_token_bytes(src.hf_config))
    held_rows = held_rows_per_batch(src.hf_config, length, tokens_per_batch)

    def step(layer: int, module: torch.nn.Module) -> None:
        with calibration_attention(stats, src.hf_config, [module.self_attn]):
            calib.map_(_layer_io(src, module, layer, length, device, calibrating=True), rows, device)
        held.map_(_layer_io(src, module, layer, length, device), held_rows, device)

    stream_layers(src, device, step, "calibration", by_rows=True, leave=False)
    return stats.result()


@torch.no_grad()
def rewrite_pass(src: Source, config, family_name: str, init_layer: InitLayerFn | None, stats: dict,
                 held: RowStore, writer: ShardedWriter, out_dtype: torch.dtype, device) -> None:
    """Pass 2: each layer with the method's modules (`config.attnkit`) installed and initialised;
    `held` advanced through it; every tensor of the layer written in `out_dtype`."""
    from attnkit.adapters.modeling_attnkit import install_attention

    length = held.row_shape[0]

    def step(layer: int, module: torch.nn.Module) -> None:
        install_attention(module.self_attn, config, family_name)
        if init_layer is not None:
            init_layer(module.self_attn, stats)
        module.to(device).eval()
        held.map_(_layer_io(src, module, layer, length, device), held_rows_per_batch(config, length), device)
        for name, tensor in module.state_dict().items():
            writer.add(f"{src.prefix}{layer}.{name}", tensor.to(out_dtype))

    stream_layers(src, device, step, "rewrite", by_rows=True, leave=False)


def held_out_metrics(src: Source, before: RowStore, after: RowStore, held_ids: torch.Tensor, device) -> dict:
    """Logits error, KL and perplexities of the retrofitted stream against the source's (closes both)."""
    ppl_before, metrics = _measure(src, {"source": before, "after": after}, ("after",), held_ids, device)
    return {**metrics["after"], "ppl_before": ppl_before}


def _measure(src: Source, streams: dict[str, RowStore], stages: tuple[str, ...], ids: torch.Tensor, device):
    """`measure_streams` on final hidden states, with the source's final norm and head."""
    final_norm = src.ckpt.get(src.family.final_norm + ".weight", dtype=torch.float32, device=device)
    return measure_streams(src, streams, stages, ids, final_norm, lm_head_name(src), device)


@torch.no_grad()
def streamed_ppl(src: Source, ids: torch.Tensor, scratch: Path, device) -> float:
    """Perplexity of the model `src` on rows `ids` [N, T], a layer at a time (the user's model before
    `mla+…`, whose retrofit runs on the MLA conversion)."""
    store = embedded(src, ids, scratch / "ppl.f32")
    rows = held_rows_per_batch(src.hf_config, ids.shape[1])
    stream_layers(src, device, lambda layer, module: store.map_(_layer_io(src, module, layer, ids.shape[1], device),
                                                                rows, device), by_rows=True)
    return _measure(src, {"source": store}, (), ids, device)[0]


def write_config(src: Source, config, model_class: type, out_dtype: torch.dtype, folder: Path) -> None:
    """config.json (with `auto_map`), the modeling code beside it and generation_config.json, as the
    whole model's `save_pretrained` writes them."""
    from transformers import GenerationConfig
    from transformers.dynamic_module_utils import custom_object_save

    config.dtype = str(out_dtype).replace("torch.", "")
    config.architectures = [model_class.__name__]
    custom_object_save(model_class.__new__(model_class), folder, config=config)  # reads only the class
    config.save_pretrained(folder)
    try:
        generation = GenerationConfig.from_pretrained(src.path)
    except OSError:  # no generation_config.json: the one from_pretrained derives from the config
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(folder)


def retrofit_config(src: Source, config_class: type, fields: dict):
    """The source config as the retrofit's config class, with the method's `attnkit` block."""
    config = copy.deepcopy(src.hf_config)
    config.__class__ = config_class
    config.attnkit = fields
    return config


def open_streams(src: Source, calib: torch.Tensor, held: torch.Tensor, scratch: Path) -> tuple[RowStore, RowStore]:
    """Embedded calibration and held-out rows in scratch files."""
    return embedded(src, calib, scratch / "calib.f32"), embedded(src, held, scratch / "held.f32")


# ---------------------------------------------------------------- measured on a one-layer twin


def _layer_groups(config) -> dict[str | None, list[int]]:
    """Layers grouped by what their cache depends on: the layer type where the config has them."""
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    groups: dict[str | None, list[int]] = {}
    for i, kind in enumerate(types[: config.num_hidden_layers]):
        groups.setdefault(kind, []).append(i)
    return groups


def one_layer_twin(config, model_class: type, layer: int) -> torch.nn.Module:
    """A randomly initialised one-layer model with `layer`'s attention shape and cache (fp32): what a
    cache holds depends on the shapes and the method's settings, never on the weights' values. Its
    vocabulary and MLP are shrunk: they hold no cache."""
    twin = copy.deepcopy(config)
    twin.num_hidden_layers = 1
    twin.vocab_size = min(int(config.vocab_size), 256)
    if getattr(twin, "intermediate_size", None):
        twin.intermediate_size = 8
    if getattr(twin, "layer_types", None):
        twin.layer_types = [config.layer_types[layer]]
    spec = getattr(config, "attnkit", None)
    if spec is not None:  # per-layer lists of the method's block: this layer's entry
        twin.attnkit = {k: ([v[layer]] if isinstance(v, list) and len(v) == config.num_hidden_layers else v)
                        for k, v in spec.items()}
    twin.tie_word_embeddings = False
    with torch.device("cpu"):
        return model_class(twin).float().eval()


def per_layer_measure(config, model_class: type, measure: Callable[[torch.nn.Module], object]) -> list:
    """`measure(twin)` for each distinct layer type, as one entry per layer of the model."""
    out: list = [None] * config.num_hidden_layers
    for layers in _layer_groups(config).values():
        value = measure(one_layer_twin(config, model_class, layers[0]))
        for i in layers:
            out[i] = value
    return out
