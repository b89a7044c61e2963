"""The engine form's latent norm for one layer, fitted on calibration rows and chosen on rows held aside.

`engines.py` holds the math (the anchor direction, the latent mix, the `kv_b_proj` refit); this module
runs it over a layer's calibration rows. Every choice the engine form makes from data (the anchor's
ratio, whether the mix is kept) is judged on rows the fits did not see: every `HOLD_EVERY`-th row is
held aside. In-sample, the choice can be badly wrong: the anchor is Sigma^-1 mu, the direction whose
projection varies least over the fitting tokens, and when those span fewer directions than the layer
is wide (layer 0 sees one vector per distinct token: 8,192 tokens of code hold fewer distinct tokens than
a 1B model's 2,048 dimensions), that direction is one the calibration text never moved along and held-out
text does. On the Llama-3.2-1B shape at 8,192 calibration tokens the in-sample choice anchored layer 0 at
ratio 8 with a refit error of 1.5e-8 on its own rows; on held-out text that layer's attention error was 18.2
(relative) and the model's KL 0.80. Judged on held rows: no anchor, 0.35 and 0.40 (docs/mla.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnkit.converters.measure import heap_reuse
from attnkit.converters.mla import layer as mla
from attnkit.converters.mla.engines import (ANCHOR_RATIOS, MIX_CHANNELS, KvbRefit, anchor_row, engine_attention_tensors,
                                            latent_rows, norm_spread, normalised_latent, steady_mix)
from attnkit.converters.mla.source import Moment
from attnkit.converters.stream.rowstore import RowStore

HOLD_EVERY = 8  # every 8th calibration row judges the fits of the other seven (none below 8 rows: judged in-sample)
# The rows are read one at a time (`blocks(1)`): the split is per row, so a block is all fit or all held.
MIX_FIT_TOKENS = 16384  # calibration tokens (strided) the engine form's latent mix is fitted on


class Held:
    """Which calibration rows are held aside: every `HOLD_EVERY`-th (rows HOLD_EVERY - 1, 2 HOLD_EVERY - 1, ...)."""

    def __init__(self, rows: int):
        self.every = HOLD_EVERY if rows >= HOLD_EVERY else 0
        self.rows = [i for i in range(rows) if self(i)]

    def __call__(self, row: int) -> bool:
        return bool(self.every) and row % self.every == self.every - 1


class Judged:
    """A `KvbRefit` fitted on the rows not held aside and one over the held rows, which judges it (the same
    object when nothing is held: judged in-sample)."""

    def __init__(self, m: int, held: Held):
        self.fit = KvbRefit(m)
        self.judge = KvbRefit(m) if held.every else self.fit

    def part(self, is_held: bool) -> KvbRefit:
        return self.judge if is_held else self.fit

    def judged_error(self, kvb_w: torch.Tensor) -> float:
        """The relative K/V error, on the held rows, of kv_b fitted on the fit rows."""
        return self.judge.relative_error(kvb_w, self.fit.solve(kvb_w))

    def solve_all(self, kvb_w: torch.Tensor) -> torch.Tensor:
        """kv_b fitted on every row, once the choices are made (fit + held moments summed)."""
        if self.judge is self.fit:
            return self.fit.solve(kvb_w)
        return self.fit.merged(self.judge).solve(kvb_w)


def fit_moment(mom: torch.Tensor, norm1, h_cal: RowStore, held: Held, dev: str) -> torch.Tensor:
    """E[x~ x~^T] of the normed input over the rows not held aside, from the moment over every row
    (`mom`, normalised) less the held rows' sum: a pass over the held rows only."""
    if not held.rows:
        return mom
    stat = Moment(mom.shape[0] - 1, dev)
    with torch.no_grad():
        for i in held.rows:
            stat.add(norm1(h_cal.read(i, i + 1).to(dev)))
    n_all = h_cal.rows * h_cal.row_shape[0]
    held_sum = stat.sum.cpu()
    return (mom * n_all - held_sum) / (n_all - held_sum[-1, -1])


def _ratio_refits(lat: torch.Tensor, norm1, h_cal: RowStore, held: Held, dev: str):
    """One pass over the rows: the refit of every anchor ratio (fit and held parts), and a strided sample
    [N, m + 1] of the fit rows' latents at the unit anchor (what the mix is fitted on)."""
    refits = {ratio: Judged(lat.shape[0] - 1, held) for ratio in ANCHOR_RATIOS}
    fit_rows = h_cal.rows - len(held.rows)
    stride = max(1, -(-fit_rows * h_cal.row_shape[0] // MIX_FIT_TOKENS))
    sample = []
    for lo, b in h_cal.blocks(1):
        c = (norm1(b.to(dev)) @ lat.T).double()  # [1, T, m + 1]: data latent, then the unit anchor
        if not held(lo):
            sample.append(c.reshape(-1, c.shape[-1])[::stride].cpu())
        data = c[..., :-1].reshape(-1, c.shape[-1] - 1).cpu()
        gram = data.T @ data  # the same for every ratio
        for ratio, refit in refits.items():
            refit.part(held(lo)).add(data, normalised_latent(torch.cat([c[..., :-1], ratio * c[..., -1:]], -1)).cpu(), gram)
    return refits, torch.cat(sample)


def _mixed_refit(p: mla.MLAParams, rows: torch.Tensor, norm1, h_cal: RowStore, held: Held, dev: str) -> Judged:
    """The refit of `kv_b_proj` on the normalised latents of the mixed latent rows [m + 1, D]."""
    refit, mixed_lat, data_lat = Judged(p.lat_w.shape[0], held), rows.float().to(dev), p.lat_w.T.to(dev)
    for lo, b in h_cal.blocks(1):
        x = norm1(b.to(dev))
        refit.part(held(lo)).add((x @ data_lat).double().cpu(), normalised_latent((x @ mixed_lat.T).double()).cpu())
    return refit


def engine_tensors(p: mla.MLAParams, shape: mla.Shape, norm1: Callable, mom: torch.Tensor, h_cal: RowStore,
                   dev: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The engine form of one layer: the anchor direction from the fit rows' moment; kv_b refit on the
    normalised latents for every anchor ratio at once (only the anchor's size differs; one pass over the
    rows), the ratio whose refit reconstructs K and V best on the held rows kept. Then the latent is mixed
    to a steadier norm (`steady_mix`, fitted on a strided sample of the fit rows) and refit again; the mix
    is kept when its held-row error is lower. kv_b is finally refit on every row."""
    held = Held(h_cal.rows)
    unit = anchor_row(fit_moment(mom, norm1, h_cal, held, dev), p.lat_w.double(), 1.0)
    refits, z = _ratio_refits(torch.cat([p.lat_w.double(), unit[None]]).float().to(dev), norm1, h_cal, held, dev)
    errors = {ratio: refit.judged_error(p.kvb_w) for ratio, refit in refits.items()}
    ratio = min(ANCHOR_RATIOS, key=lambda r: errors[r])  # the first of equals, as the order of the ratios
    chosen = refits[ratio]
    del refits
    z[:, -1] *= ratio
    with heap_reuse(z.shape[0] * min(z.shape[1], MIX_CHANNELS) * 4):  # hundreds of [N, k] fp32 temporaries
        mix = steady_mix(z)
    rows = latent_rows(p.lat_w, ratio * unit, mix)  # [m + 1, D]
    mixed = _mixed_refit(p, rows, norm1, h_cal, held, dev)
    mixed_err = mixed.judged_error(p.kvb_w)
    info = {"anchor_ratio": ratio, "kv_refit_rel_err_by_ratio": {str(r): e for r, e in errors.items()},
            "norm_spread": {"anchor": norm_spread(z), "mixed": norm_spread(z @ mix.T)},
            "mix_kept": mixed_err < errors[ratio], "held_rows": len(held.rows)}
    if info["mix_kept"]:
        kv_b, err = mixed.solve_all(p.kvb_w), mixed_err
    else:
        rows, kv_b, err = latent_rows(p.lat_w, ratio * unit), chosen.solve_all(p.kvb_w), errors[ratio]
    tensors = engine_attention_tensors(p, shape, norm1.weight.detach().cpu(), rows, kv_b)
    return tensors, {**info, "kv_refit_rel_err": err}
