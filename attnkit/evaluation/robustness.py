"""Four measures of what a differential attention retrofit is claimed to improve, on any causal LM.

* **retrieval among distractors**: the bundled `attnkit-distract-*` lm-eval tasks (a needle among
  look-alike decoys, `tasks/distract.py`), scored per item (`task_correct`) so two models compare item
  by item (`paired`, `mcnemar_p`);
* **activation outliers**: kurtosis and the top-1 % magnitude (99th percentile of |x|) of every
  layer's attention output before `o_proj` and of every decoder layer's output (`outliers`);
* **quantization robustness**: per-row NLL after round-to-nearest weight quantization (`rtn`,
  symmetric, per output channel in groups of 64 inputs) and with keys/values (or an MLA latent)
  quantised to int8 per token (`quantized_weights`, `int8_kv`);
* **long-input noise**: the attention the answer's position pays to the needle's value tokens and to
  the decoys' (`attention_mass`), per layer and head; a second attention map that is subtracted (a
  combine module with `full_lambda` and `ramp`) is subtracted here too.

Each function returns per-item (or per-row) values, so `paired` can put an interval on B − A.
`measure` runs them all on one model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

GROUP = 64
KV_PROJECTIONS = ("k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_a_proj")  # what a cache stores is made here
PROBE = "attnkit_probe"


# ---------------------------------------------------------------- quantization (pure functions)


def rtn(weight: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """Round-to-nearest symmetric fake quantization of a [out, in] weight: one scale per output row
    and group of `group` inputs (max |w| / (2^(bits−1) − 1)); returns the dequantised weight."""
    out_features, in_features = weight.shape
    pad = (-in_features) % group
    w = nn.functional.pad(weight.float(), (0, pad)).view(out_features, -1, group)
    return _round(w, bits).view(out_features, -1)[:, :in_features].to(weight.dtype)


def rtn_rows(x: torch.Tensor, bits: int = 8, group: int = GROUP) -> torch.Tensor:
    """The same along the last dim of an activation [..., D] (one scale per token and group)."""
    d = x.shape[-1]
    pad = (-d) % group
    g = nn.functional.pad(x.float(), (0, pad)).view(*x.shape[:-1], -1, group)
    return _round(g, bits).flatten(-2)[..., :d].to(x.dtype)


def _round(groups: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    return (groups / scale).round().clamp(-qmax - 1, qmax) * scale


def decoder_linears(model: nn.Module) -> list[nn.Linear]:
    """Every nn.Linear inside the decoder layers (embeddings and the LM head are left in full precision)."""
    layers = _layers(model)
    return [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]


@contextmanager
def quantized_weights(model: nn.Module, bits: int, group: int = GROUP) -> Iterator[None]:
    """The decoder layers' linear weights replaced by their `rtn` copies for the block, then restored."""
    saved = []
    with torch.no_grad():
        for lin in decoder_linears(model):
            saved.append((lin, lin.weight.detach().clone()))
            lin.weight.copy_(rtn(lin.weight, bits, group))
    try:
        yield
    finally:
        with torch.no_grad():
            for lin, w in saved:
                lin.weight.copy_(w)


@contextmanager
def int8_kv(model: nn.Module, group: int = GROUP) -> Iterator[int]:
    """Keys and values (an MLA latent: its down-projection) quantised to int8 per token as they are
    made, i.e. what an int8 KV cache stores; yields how many projections were hooked."""
    hooks = [m.register_forward_hook(lambda _m, _inp, out: rtn_rows(out, 8, group))
             for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in KV_PROJECTIONS and isinstance(m, nn.Linear)]
    try:
        yield len(hooks)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def row_nll(model: nn.Module, rows: torch.Tensor, batch: int = 4) -> list[float]:
    """Mean next-token NLL of each row of `rows` [N, T]."""
    out = []
    for ids in rows.split(batch):
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        out.extend(nll.mean(-1).tolist())
    return out


def quantization(model: nn.Module, rows: torch.Tensor) -> dict[str, list[float]]:
    """Per-row NLL: full precision, int8 and int4 weights (RTN, group 64), int8 keys/values."""
    result = {"fp": row_nll(model, rows)}
    for bits in (8, 4):
        with quantized_weights(model, bits):
            result[f"w{bits}"] = row_nll(model, rows)
    with int8_kv(model) as hooked:
        result["kv8"] = row_nll(model, rows) if hooked else []
    return result


# ---------------------------------------------------------------- activation outliers


def kurtosis(x: torch.Tensor) -> float:
    """Pearson kurtosis (4th standardised moment, 3 for a Gaussian) of all elements."""
    x = x.double().flatten()
    c = x - x.mean()
    var = c.pow(2).mean()
    return float(c.pow(4).mean() / var.pow(2)) if var > 0 else 0.0


def top_magnitude(x: torch.Tensor, fraction: float = 0.01) -> float:
    """The magnitude the top `fraction` of |x| reaches or exceeds (its 1 − fraction quantile)."""
    a = x.detach().abs().flatten().float()
    k = max(1, round(a.numel() * (1 - fraction)))
    return float(a.kthvalue(k).values)


@torch.no_grad()
def outliers(model: nn.Module, rows: torch.Tensor) -> dict[str, dict[str, list[list[float]]]]:
    """Per row and layer: kurtosis, top-1 % magnitude and max |x| of the attention output before
    `o_proj` ("attention") and of the decoder layer's output ("hidden"). Lists are [layer][row]."""
    layers = _layers(model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, inp, i=i: seen.__setitem__(i, inp[0]))
             for i, layer in enumerate(layers)]
    stats = {kind: {s: [[] for _ in layers] for s in ("kurtosis", "top1pct", "max")} for kind in ("attention", "hidden")}
    try:
        for ids in rows.split(1):
            out = model(input_ids=ids, output_hidden_states=True)
            for i in range(len(layers)):
                for kind, x in (("attention", seen[i]), ("hidden", out.hidden_states[i + 1])):
                    stats[kind]["kurtosis"][i].append(kurtosis(x))
                    stats[kind]["top1pct"][i].append(top_magnitude(x))
                    stats[kind]["max"][i].append(float(x.abs().max()))
    finally:
        for h in hooks:
            h.remove()
    return stats


# ---------------------------------------------------------------- attention mass on the needle


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """eager attention that keeps each call's last query row of weights on the module ([B, H, S])."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    out, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    module._attnkit_rows.append(weights[:, :, -1].detach().float())
    return out, weights


@contextmanager
def probed(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Every attention module records its maps' last rows while the block runs (eager attention)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, _probe_attention)
    attns = [layer.self_attn for layer in _layers(model)]
    before = model.config._attn_implementation
    configs = {id(c): c for c in [model.config, *(a.config for a in attns if hasattr(a, "config"))]}
    for c in configs.values():
        c._attn_implementation = PROBE
    try:
        yield attns
    finally:
        for c in configs.values():
            c._attn_implementation = before


def effective_row(attn: nn.Module) -> torch.Tensor | None:
    """The last query row of the map the module applies to V, [H, S], normalised to sum 1: the source
    map, or A1 − r·λ·A2 when a combine module subtracts a second map. None if nothing was recorded."""
    rows = getattr(attn, "_attnkit_rows", [])
    if not rows:
        return None
    row = rows[0][0]
    combine = next((m for m in attn.children() if hasattr(m, "full_lambda") and hasattr(m, "ramp")), None)
    if combine is not None and len(rows) > 1:
        scale = float(combine.ramp) * float(combine.full_lambda())
        row = (row - scale * rows[1][0]) / (1.0 - scale)
    return row


def value_positions(tokenizer, context: str, value: str) -> list[int]:
    """Token positions of `context` whose characters overlap the quoted value `"value"`."""
    start = context.index(f'= "{value}"') + 3
    end = start + len(value)
    offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]


@torch.no_grad()
def attention_mass(model: nn.Module, tokenizer, items: list[dict]) -> dict[str, list]:
    """Per item: the attention the last context position (where the answer's first token is predicted)
    pays to the needle's value tokens and to all decoys' value tokens, averaged over heads and
    layers; also per layer [layer][item]. Empty lists if the attention cannot be probed."""
    needle, decoys, per_layer = [], [], []
    with probed(model) as attns:
        for item in items:
            ids = torch.tensor([tokenizer(item["context"], add_special_tokens=False)["input_ids"]])
            for a in attns:
                a._attnkit_rows = []
            model(input_ids=ids)
            rows = [effective_row(a) for a in attns]
            if any(r is None for r in rows):
                return {"needle": [], "decoys": [], "needle_per_layer": []}
            span = value_positions(tokenizer, item["context"], item["needle"][1])
            others = [p for _, v in item["decoys"] for p in value_positions(tokenizer, item["context"], v)]
            layer_needle = [float(r[:, span].sum(-1).mean()) for r in rows]
            per_layer.append(layer_needle)
            needle.append(sum(layer_needle) / len(rows))
            decoys.append(sum(float(r[:, others].sum(-1).mean()) for r in rows) / len(rows))
        for a in attns:
            a._attnkit_rows = []
    return {"needle": needle, "decoys": decoys, "needle_per_layer": [list(x) for x in zip(*per_layer)]}


# ---------------------------------------------------------------- retrieval among distractors


def task_correct(model: nn.Module, tokenizer, tasks: list[str], limit: int | None = None) -> dict[str, list[int]]:
    """lm-eval's per-item `acc` (1/0, in document order) for bundled multiple-choice tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from attnkit.evaluation.scoring import SharedPrefixLM
    from attnkit.evaluation.tasks import HERE

    lm = SharedPrefixLM(pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=1024)
    manager = TaskManager(include_path=str(HERE), include_defaults=False)  # the bundled tasks only
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  log_samples=True, verbosity="ERROR", bootstrap_iters=0)
    return {t: [int(s["acc"]) for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in tasks}


# ---------------------------------------------------------------- paired statistics


def mcnemar_p(a: list[int], b: list[int]) -> float:
    """McNemar's exact two-sided p on the discordant pairs of two 0/1 vectors."""
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    m = only_a + only_b
    tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2**m if m else 1.0
    return min(1.0, 2 * tail)


def paired(a: list[list[float]], b: list[list[float]], resamples: int = 2000, seed: int = 0) -> dict:
    """B − A over seeds × items (a[s][i], b[s][i]: seed s of each arm on item i, the same items).

    The mean difference; its 95 % interval from a two-level percentile bootstrap (seeds drawn with
    replacement, then items, the same items for every drawn seed), so both seed and item noise count;
    `mde80`: the smallest true difference a two-sided 5 % test would detect with 80 % power
    ((1.96 + 0.84) × the bootstrap standard error)."""
    diffs = [[y - x for x, y in zip(sa, sb)] for sa, sb in zip(a, b)]
    seeds, n = len(diffs), len(diffs[0])
    rng = random.Random(seed)
    boot = []
    for _ in range(resamples):
        drawn = [diffs[rng.randrange(seeds)] for _ in range(seeds)]
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(sum(d[i] for d in drawn for i in idx) / (seeds * n))
    boot.sort()
    mean = sum(map(sum, diffs)) / (seeds * n)
    se = math.sqrt(sum((x - sum(boot) / resamples) ** 2 for x in boot) / (resamples - 1))
    return {"difference": mean, "ci95": [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]],
            "se": se, "mde80": 2.8 * se, "seeds": seeds, "items": n}


# ---------------------------------------------------------------- runner


def measure(model: nn.Module, tokenizer, rows: torch.Tensor, tasks: list[str], limit: int | None = None,
            mass_task: str | None = None, mass_items: int | None = None) -> dict:
    """All four measures on one model (eval mode, fp32): per-item / per-row values; the attention mass
    on the first `mass_items` items of `mass_task` (a task whose items name their needle and decoys)."""
    from attnkit.evaluation.tasks import items

    model.eval()
    result = {"distract": task_correct(model, tokenizer, tasks, limit), "nll": quantization(model, rows),
              "outliers": outliers(model, rows)}
    if mass_task is not None:
        result["mass"] = attention_mass(model, tokenizer, items(mass_task, mass_items))
    return result


def _layers(model: nn.Module) -> nn.ModuleList:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers
