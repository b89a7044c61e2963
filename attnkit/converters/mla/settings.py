"""Validated settings of `attnkit convert --to mla`, with defaults clipped for small models."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnkit.converters.common import StreamSettings, stream_fields
from attnkit.converters.mla.budget import budget_values, max_rank
from attnkit.converters.mla.layer import Shape
from attnkit.errors import AttnkitError

DEFAULT_RANK, DEFAULT_ROPE_DIM = 512, 64


@dataclass(kw_only=True)
class Settings(StreamSettings):
    kv_lora_rank: int  # latent channels in the cache, including a constant channel (transformers target)
    rope_dim: int
    rope_method: str
    rope_frequencies: str
    objective: str
    src_itemsize: int
    refit_query: str = "attention"  # off | attention | uniform: distance weights of the query refit
    rope_score: str = "energy"  # energy | loss: how the RoPE components kept are ranked (`layer.rope_scores`)
    kv_budget: float | None = None  # fraction of the source's KV bytes; the split is then measured
    target: str = "transformers"  # engines: within llama.cpp / vLLM / SGLang; transformers: exact there only
    v_head_dim: int = 0  # value head size written (>= head_dim, zero-padded); 0 before resolve_settings
    format: str = "deepseek_v3"  # deepseek_v3 | attnkit (QK norms before the latent, custom code)
    report: str = "steps"  # steps: every step measured end to end; final: the written model only
    engine_sizes: str | None = None  # vllm | vllm-cpu: --kv-budget chooses among the splits those kernels take
    fit_steps: int = 0  # Adam steps fitting each written attention layer to the source's output (`fit.py`)
    fit_lr: float = 1e-3
    PRIVATE: ClassVar[tuple[str, ...]] = (*StreamSettings.PRIVATE, "src_itemsize")

    @property
    def norm_channel(self) -> bool:
        """Whether one latent channel serves the latent norm: its constant (transformers target) or its
        anchor (engine target); the attnkit format has no latent norm."""
        return self.format != "attnkit"

    @property
    def data_rank(self) -> int:
        """Latent channels that carry data (`norm_channel`: all but one)."""
        return self.kv_lora_rank - self.norm_channel


def rope_cap(shape: Shape, frequencies: str) -> int:
    """Largest --rope-dim: every (virtual head, frequency) component with exact frequencies; one
    component per frequency on a plain ladder."""
    return shape.G * shape.d if frequencies == "exact" else shape.d


def resolve_settings(args: argparse.Namespace, shape: Shape, src_dtype: torch.dtype, family=None) -> Settings:
    if shape.d % 2:
        raise AttnkitError(f"head_dim {shape.d} is odd: rotate-half RoPE needs an even head dim")
    fmt = output_format(args, family)
    # the attnkit format rotates k_pe with the source's own tables: any component, exact frequencies
    target = "transformers" if fmt == "attnkit" else getattr(args, "target", None) or "transformers"
    if fmt == "attnkit" and args.rope_frequencies not in (None, "exact"):
        raise AttnkitError("--format attnkit rotates the shared RoPE key at the source's own frequencies; "
                           f"--rope-frequencies {args.rope_frequencies} applies to --format deepseek_v3 only")
    frequencies = args.rope_frequencies or ("ladder" if target == "engines" else "exact")
    if target == "engines" and frequencies == "exact":
        raise AttnkitError("--rope-frequencies exact writes longrope factors, which llama.cpp and vLLM do not apply "
                           "to DeepSeek models; use it with --target transformers, or ladder/geometric")
    cap = rope_cap(shape, frequencies)
    budget = getattr(args, "kv_budget", None)
    if fmt == "attnkit" and getattr(args, "v_head_dim", None):
        raise AttnkitError("--v-head-dim is not available with --format attnkit (its values are not padded for engines)")
    if budget is not None and family is not None and family.by_layer_type:
        raise AttnkitError(f"--kv-budget is not available for {family.model_type} (RoPE and windows per layer type); "
                           "give --kv-lora-rank and --rope-dim")
    engine_sizes = getattr(args, "engine_sizes", None)
    if engine_sizes is not None and (budget is None or target != "engines"):
        raise AttnkitError("--engine-sizes restricts the splits --kv-budget measures to what an engine's MLA kernels "
                           "take; give it with --kv-budget and --target engines")
    if budget is not None:
        _check_budget(args, shape, budget)
    if args.rope_dim is None:
        rope_dim = min(DEFAULT_ROPE_DIM, cap)
    else:
        rope_dim = args.rope_dim
        where = "G*head_dim" if frequencies == "exact" else f"head_dim, --rope-frequencies {frequencies}"
        if rope_dim <= 0 or rope_dim % 2 or rope_dim > cap:
            raise AttnkitError(f"--rope-dim must be even and in 2..{cap} ({where} of this model), got {rope_dim}")
    top = max_rank(shape, rope_dim) - (fmt == "attnkit")  # no latent-norm channel to count
    if args.kv_lora_rank is None:
        rank = min(DEFAULT_RANK, top)
    else:
        rank = args.kv_lora_rank
        if rank < 2 or rank > top:
            raise AttnkitError(
                f"--kv-lora-rank must be in 2..{top} (2*G*head_dim - rope_dim"
                f"{'' if fmt == 'attnkit' else ' + 1 norm channel'}), got {rank}"
            )
    v_head_dim = getattr(args, "v_head_dim", None) or shape.d
    if v_head_dim < shape.d:
        raise AttnkitError(f"--v-head-dim must be >= head_dim {shape.d} (values are zero-padded, never cut), got {v_head_dim}")
    refit = getattr(args, "refit_weights", "attention") if getattr(args, "refit_query", True) else "off"
    fit_steps, fit_lr = getattr(args, "fit_steps", 0) or 0, getattr(args, "fit_lr", 1e-3)
    if fit_steps < 0 or not fit_lr > 0:
        raise AttnkitError(f"--fit-steps must be >= 0 and --fit-lr > 0, got {fit_steps} and {fit_lr}")
    return Settings(
        kv_lora_rank=rank, rope_dim=rope_dim, rope_method=args.rope_method, rope_frequencies=frequencies,
        objective=getattr(args, "objective", None) or "attention", **stream_fields(args, src_dtype),
        src_itemsize=torch.empty(0, dtype=src_dtype).element_size(),
        refit_query=refit, rope_score=rope_score_for(getattr(args, "rope_score", None), args.rope_method, frequencies, refit),
        kv_budget=budget, target=target, v_head_dim=v_head_dim, format=fmt, report=getattr(args, "report", "steps"),
        engine_sizes=engine_sizes, fit_steps=fit_steps, fit_lr=fit_lr,
    )


def rope_score_for(asked: str | None, method: str, frequencies: str, refit: str) -> str:
    """--rope-score, or the default: `loss` where it was measured better (rorope components at their
    exact frequencies, which the loss also chooses between; docs/mla.md), `energy` elsewhere (on a
    plain ladder the frequencies are fixed and the two were within 0.3 %)."""
    if asked is None:
        return "loss" if method == "rorope" and frequencies == "exact" and refit != "off" else "energy"
    if asked == "loss" and (method != "rorope" or refit == "off"):
        raise AttnkitError("--rope-score loss ranks rorope components by what the query refit leaves of their "
                           "rotation; it needs --rope-method rorope and the refit (drop --no-refit-query)")
    return asked


def output_format(args: argparse.Namespace, family) -> str:
    """--format, or the default: attnkit for a QK-norm source (exact), deepseek_v3 otherwise."""
    fmt = getattr(args, "format", None)
    if family is None or family.qk_norm is None:
        return "deepseek_v3"  # without QK norms the attnkit format is the DeepSeek-V3 one
    if fmt is None:
        return "attnkit"
    if fmt == "deepseek_v3" and family.native_refusal:
        raise AttnkitError(f"cannot write {family.model_type} as a plain DeepSeek-V3 checkpoint: {family.native_refusal}; "
                           "use --format attnkit")
    return fmt


def _check_budget(args: argparse.Namespace, shape: Shape, budget: float) -> None:
    if args.kv_lora_rank is not None or args.rope_dim is not None:
        raise AttnkitError("--kv-budget chooses --kv-lora-rank and --rope-dim itself; give either the budget or the two ranks")
    if not 0 < budget <= 1:
        raise AttnkitError(f"--kv-budget must be a fraction in (0, 1], got {budget}")
    if budget_values(shape, budget) < 4:
        raise AttnkitError(f"--kv-budget {budget} leaves {budget_values(shape, budget)} cached values per token "
                           f"and layer; MLA needs at least 4 (2 RoPE + 2 latent channels)")

