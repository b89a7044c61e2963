"""`--to mla`'s options (`MLAConfig`): the CLI's MLA group and the API's config. Resolved against the
model's shape into `settings.Settings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnkit.options import option


@dataclass
class MLAConfig:
    """How the cache is compressed (rank, RoPE split), what the output must run in, what is reported."""

    GROUP: ClassVar[str | None] = "MLA (--to mla)"
    kv_lora_rank: int | None = option(None, "latent rank r (default 512, clipped for small models)", metavar="R")
    rope_dim: int | None = option(None, "decoupled RoPE dim d_r, even (default 64, clipped)", metavar="DR")
    rope_method: str = option("rorope", "how RoPE is reduced to d_r dims", choices=("rorope", "partial"))
    rope_score: str | None = option(
        None, "how rorope's components are ranked for the d_r RoPE slots: energy = key energy; loss = the score error "
        "NoPE'ing a component leaves after the query refit (default: loss with exact frequencies, energy on a plain "
        "ladder)", choices=("energy", "loss"))
    target: str = option(
        "engines", "engines: a DeepSeek-V3 checkpoint within what llama.cpp, vLLM and SGLang implement (no attention "
        "biases, interleaved RoPE, a plain RoPE ladder); transformers: exact at full size, runs in transformers only",
        choices=("engines", "transformers"))
    format: str | None = option(
        None, "deepseek_v3: a plain DeepSeek-V3 checkpoint (default for Llama/Qwen2/Mistral/Phi-3; for QK-norm "
        "families the norms are folded to constant scales: lossy, measured); attnkit: MLA with the source's QK norms "
        "applied before compression, exact, custom code (trust_remote_code; default for Qwen3)",
        choices=("attnkit", "deepseek_v3"))
    rope_frequencies: str | None = option(
        None, "ladder (default with --target engines): every k-th source frequency, a plain theta ladder; exact "
        "(default with --target transformers): each kept component at its source frequency (longrope factors); "
        "geometric: plain ladder with folding", choices=("ladder", "exact", "geometric"))
    v_head_dim: int | None = option(
        None, "value head size written, >= head_dim: zero-padded, exact, the cache unchanged (e.g. 128 for a "
        "head_dim-64 source, which vLLM's CUDA prefill kernels need); default head_dim", metavar="N")
    objective: str = option("attention", "latent PCA metric: kv = balanced K/V energy; attention = query-weighted "
                            "keys, o_proj-weighted values", choices=("kv", "attention"))
    report: str = option("steps", "steps: run every conversion step end to end on the held-out text (the per-step "
                         "table); final: only the written model (same tensors; with QK norms folded also the norm "
                         "step), faster", choices=("steps", "final"))
    kv_budget: float | None = option(None, "KV-cache bytes/token <= F x the source's: the (--kv-lora-rank, "
                                     "--rope-dim) split is chosen by measuring candidate conversions on held-out "
                                     "text (least KL; of splits within 1%% of it, the widest RoPE key)", metavar="F")
    engine_sizes: str | None = option(
        None, "with --kv-budget: measure only the splits vLLM's MLA kernels take (rope dim 64, kv_lora_rank + rope "
        "dim 320/512/576; vllm-cpu: 576), the best one within the budget", choices=("vllm", "vllm-cpu"))
    choose_by: str = option(
        "auto", "with --kv-budget: kl = the split of least one-shot KL; fit = with --fit-steps, from the KL choice "
        "along rope_dim to the split whose fitted conversion has the least KL (up to --fit-candidates fitted "
        "conversions); heal = of the --heal-candidates splits of least KL, the one whose short heal (--heal-steps "
        "steps of --heal-recipe) ends at the lowest validation loss (converts and heals each finalist: minutes more "
        "on a small model); auto = fit with --fit-steps (and no --engine-sizes), else kl",
        choices=("auto", "kl", "fit", "heal"))
    heal_recipe: str = option("recipes/heal-mla.yaml", "with --choose-by heal: the healing recipe", metavar="YAML")
    heal_steps: int = option(12, "with --choose-by heal: optimizer steps of each short heal", metavar="N")
    heal_candidates: int = option(3, "with --choose-by heal: how many least-KL splits are healed", metavar="K")
    refit_query: bool = option(True, "least-squares refit of the NoPE query to the source's RoPE'd scores (report "
                               "stage 'refit'; default on, measured better)", negatable=True)
    fit_steps: int = option(
        0, "fit every written attention layer by gradient (Adam, N steps of 4 calibration rows) to the source layer's "
        "output on the calibration rows: a lossy conversion's one-shot loss falls several-fold; minutes on a small "
        "model on CPU, long on a large one (default 0: off)", metavar="N")
    fit_lr: float = option(1e-3, "with --fit-steps: Adam's peak learning rate (cosine decay)", metavar="LR")
    fit_candidates: int = option(4, "with --choose-by fit: at most this many splits converted and fitted",
                                 metavar="K")
    refit_weights: str = option("attention", "distances the refit averages RoPE over: the source's attention mass, "
                                "or uniform over causal pairs", choices=("attention", "uniform"))
