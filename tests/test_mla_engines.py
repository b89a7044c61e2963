"""The engine export (`--target engines`): each exact piece is exact, the lossy one is measured, and
the output is what llama.cpp / vLLM / SGLang can load (no biases, interleaved RoPE, plain ladder,
q_lora_rank set, an explicit LM head) and safe to fine-tune with plain PEFT."""

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from attnkit.cli import main
from attnkit.converters.mla import layer as mla
from attnkit.converters.mla.engines import (KvbRefit, anchor_row, engine_attention_tensors, interleave,
                                            ladder_stride, ladder_theta, latent_rows, norm_spread,
                                            normalised_latent, steady_mix)
from attnkit.converters.mla.native import deepseek_config
from attnkit.converters.mla.rope import target_rope

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder, save_model  # noqa: E402

SRC = {"num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8}


def _attention(cfg, tensors, x, T):
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        attn = DeepseekV3Attention(cfg, 0)
    attn.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True, assign=True)
    pe = DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(T)[None])
    with torch.no_grad():
        return attn(x, position_embeddings=pe, attention_mask=None)[0]


@settings(max_examples=12, deadline=None)
@given(H=st.sampled_from([2, 4]), d=st.sampled_from([4, 8]), half=st.integers(1, 4), seed=st.integers(0, 99))
def test_interleaved_rope_rows_are_the_same_function(H, d, half, seed):
    """rope_interleave: true with permuted RoPE rows == the rotate-half layout (exact)."""
    torch.manual_seed(seed)
    D, d_r, m, T = 16, 2 * half, 6, 7
    shape = mla.Shape(D, H, H, d)
    rope = {"rope_type": "default", "rope_theta": 100.0}
    plain = deepseek_config(SRC, shape, d_r, m, None, rope, "float32")
    plain.attention_bias = False
    t = {"q_proj.weight": torch.randn(H * (d + d_r), D), "kv_a_proj_with_mqa.weight": torch.randn(m + d_r, D),
         "kv_a_layernorm.weight": torch.rand(m) + 0.5, "kv_b_proj.weight": torch.randn(H * 2 * d, m),
         "o_proj.weight": torch.randn(D, H * d)}
    q = t["q_proj.weight"].view(H, d + d_r, D)
    moved = dict(t, **{"q_proj.weight": torch.cat([q[:, :d], torch.stack([interleave(q[h, d:]) for h in range(H)])], 1)
                       .reshape(-1, D),
                       "kv_a_proj_with_mqa.weight": torch.cat([t["kv_a_proj_with_mqa.weight"][:m],
                                                               interleave(t["kv_a_proj_with_mqa.weight"][m:])])})
    inter = deepseek_config(SRC, shape, d_r, m, None, rope, "float32")
    inter.attention_bias, inter.rope_interleave = False, True
    x = torch.randn(2, T, D)
    a, b = _attention(plain, t, x, T), _attention(inter, moved, x, T)
    # relative to the output's size: random weights give outputs ~30 and sharp softmaxes, where fp32
    # rounding of the two summation orders reached 7.6e-5 absolute (7e-7 relative) and failed an atol
    assert float((a - b).norm() / a.norm()) < 5e-6


@settings(max_examples=12, deadline=None)
@given(d=st.sampled_from([8, 16, 64]), slots=st.integers(1, 8), theta=st.sampled_from([1e4, 5e5]))
def test_ladder_is_the_source_frequencies_every_k_pairs(d, slots, theta):
    d_r = 2 * min(slots, d // 2)
    for k in range(1, d // 2 + 1):
        if k * (d_r // 2 - 1) >= d // 2:
            break
        cfg = deepseek_config(SRC, mla.Shape(16, 2, 2, d), d_r, 4, None,
                              {"rope_type": "default", "rope_theta": ladder_theta(theta, k, d, d_r)}, "float32")
        inv, att = target_rope(cfg)
        src = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        assert att == 1.0 and torch.allclose(inv, src[torch.arange(d_r // 2) * k], rtol=1e-5)


def test_ladder_stride_follows_the_scores():
    d, d_r = 16, 4  # two slots: pairs 0 and k
    scores = torch.zeros(d // 2, 2)
    scores[0, 0], scores[5, 1] = 1.0, 0.9
    assert ladder_stride([scores], d, d_r) == 5
    assert all(ladder_stride([torch.rand(d // 2, 2)], d, 2 * s) >= 1 for s in range(1, 5))


@settings(max_examples=10, deadline=None)
@given(D=st.sampled_from([8, 32]), H=st.sampled_from([1, 4]), seed=st.integers(0, 99))
def test_q_latent_of_rank_D_is_exact(D, H, seed):
    """q_a_proj = diag(1/g), q_a_layernorm = g: the q latent's RMS is 1 for every token, so the
    DeepSeek q path equals the plain query map of the normed input."""
    torch.manual_seed(seed)
    g = torch.rand(D, dtype=torch.float64) + 0.2
    x = torch.randn(3, 5, D, dtype=torch.float64) * 10
    xt = g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # the layer's input norm
    d, d_r, m = 4, 2, 3
    shape = mla.Shape(D, H, H, d)
    p = mla.MLAParams(q_w=torch.randn(H, d + d_r, D, dtype=torch.float64), q_b=None,
                      lat_w=torch.randn(m, D, dtype=torch.float64), lat_b=None, pe_w=torch.randn(d_r, D, dtype=torch.float64),
                      pe_b=None, kvb_w=torch.randn(H, 2 * d, m, dtype=torch.float64), kvb_b=None,
                      o_w=torch.randn(D, H * d, dtype=torch.float64), o_b=None, inv_freq=torch.ones(1), scale=1.0)
    t = engine_attention_tensors(p, shape, g, latent_rows(p.lat_w, torch.randn(D, dtype=torch.float64)),
                                 torch.randn(H, 2 * d, m + 1))
    q_a = xt @ t["q_a_proj.weight"].T
    q = (t["q_a_layernorm.weight"] * normalised_latent(q_a)) @ t["q_b_proj.weight"].T
    ref = torch.einsum("hed,btd->bthe", p.q_w, xt)
    ref = torch.cat([ref[..., :d], interleave(ref[..., d:].movedim(-1, 0)).movedim(0, -1)], -1).reshape(3, 5, -1)
    assert torch.allclose(q, ref, rtol=1e-6, atol=1e-6)


def test_kv_b_refit_is_exact_when_the_norm_is_a_constant_scale():
    torch.manual_seed(0)
    m, H, d = 5, 2, 3
    c = torch.randn(400, m, dtype=torch.float64)
    n = torch.cat([c, torch.ones(400, 1, dtype=torch.float64)], 1) * 0.37  # anchor constant, rms fixed
    kvb = torch.randn(H, 2 * d, m, dtype=torch.float64)
    refit = KvbRefit(m)
    refit.add(c[:200], n[:200])
    refit.add(c[200:], n[200:])
    B = refit.solve(kvb)
    assert torch.allclose(torch.einsum("hem,tm->the", B, n), torch.einsum("hem,tm->the", kvb, c), atol=1e-8)
    assert refit.relative_error(kvb, B) < 1e-12


def test_kv_b_refit_error_is_the_residual_over_the_rows():
    """relative_error from the accumulated moments equals the residual computed row by row, for any B
    (not only the solution), also when the caller passes the shared c^T c."""
    torch.manual_seed(1)
    m, H, d, T = 6, 3, 2, 300
    c = torch.randn(T, m, dtype=torch.float64)
    n = normalised_latent(torch.cat([c, 2.0 + 0.1 * torch.randn(T, 1, dtype=torch.float64)], 1))
    kvb = torch.randn(H, 2 * d, m, dtype=torch.float64)
    refit = KvbRefit(m)
    refit.add(c[:100], n[:100])
    refit.add(c[100:], n[100:], c[100:].T @ c[100:])
    for B in (refit.solve(kvb), torch.randn(H, 2 * d, m + 1, dtype=torch.float64)):
        target = torch.einsum("hem,tm->the", kvb, c)
        direct = (torch.einsum("hem,tm->the", B, n) - target).pow(2).sum() / target.pow(2).sum()
        assert abs(refit.relative_error(kvb, B) - float(direct)) < 1e-9 * max(1.0, float(direct))


def test_anchor_is_the_steadiest_direction_at_its_ratio():
    torch.manual_seed(0)
    D, N = 12, 5000
    x = torch.randn(N, D, dtype=torch.float64) + torch.linspace(2, 0, D, dtype=torch.float64)  # a DC part
    aug = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    moment = aug.T @ aug / N
    lat_w = torch.randn(4, D, dtype=torch.float64)
    v = anchor_row(moment, lat_w, 4.0)
    a = x @ v
    cv = float(a.std() / a.mean())
    assert all(cv <= float((x @ w).std() / (x @ w).mean().abs()) + 1e-9 for w in torch.randn(50, D, dtype=torch.float64))
    data = (x @ lat_w.T).pow(2).sum(1).mean().sqrt()
    assert abs(float(a.mean() / data) - 4.0) < 1e-6


def test_steady_mix_makes_the_norm_steady_and_is_invertible():
    """Latents whose norm varies a lot only because one channel is badly scaled: the mix finds the
    scaling (the quadratic form that is constant), within the condition number it allows."""
    torch.manual_seed(0)
    N, r = 4000, 6
    dirs = torch.randn(N, r, dtype=torch.float64)
    steady = dirs / dirs.norm(dim=-1, keepdim=True)  # |.| = 1 for every token
    A = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64))[0] @ torch.diag(torch.linspace(1, 3, r, dtype=torch.float64))
    z = steady @ A.T  # a fixed mix away from steady: |z| varies
    T = steady_mix(z)
    assert norm_spread(z) > 0.1
    assert norm_spread(z @ T.T) < 0.02 * norm_spread(z)
    sv = torch.linalg.svdvals(T)
    assert abs(float(sv.max()) - 1) < 1e-9 and float(sv.max() / sv.min()) < 10


def test_steady_mix_keeps_its_best_point_when_an_svd_fails(monkeypatch):
    """A line-search step can go where fp32's SVD does not converge (seen on reference-mha at 281/26):
    the mix is then the best point evaluated before it, finite and no worse than no mix, not a traceback."""
    torch.manual_seed(0)
    N, r = 4000, 6
    dirs = torch.randn(N, r, dtype=torch.float64)
    z = (dirs / dirs.norm(dim=-1, keepdim=True)) * torch.linspace(1, 3, r, dtype=torch.float64)
    real, calls = torch.linalg.svdvals, {"n": 0}

    def failing(t):
        calls["n"] += t.dtype == torch.float32  # the fit's fp32 calls, not the final fp64 normalisation
        if calls["n"] > 6 and t.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real(t)

    monkeypatch.setattr(torch.linalg, "svdvals", failing)
    T = steady_mix(z)
    monkeypatch.setattr(torch.linalg, "svdvals", real)
    assert calls["n"] > 6 and torch.isfinite(T).all()
    assert norm_spread(z @ T.T) < norm_spread(z)  # the steps before the failure are kept


def test_steady_mix_beyond_its_channels_shares_one_scale():
    """Channels past the freely mixed ones get one common scale: enough when they are steady among
    themselves but on another scale than the mixed ones."""
    torch.manual_seed(1)
    N = 4000
    a = torch.randn(N, 2, dtype=torch.float64)
    b = torch.randn(N, 6, dtype=torch.float64)
    steady = torch.cat([a, b], 1) / torch.cat([a, b], 1).norm(dim=-1, keepdim=True)
    z = steady * torch.tensor([3.0, 3.0] + [1.0] * 6, dtype=torch.float64)  # the rest 3x too small
    T = steady_mix(z, channels=2)
    assert norm_spread(z @ T.T) < 0.05 * norm_spread(z)
    assert torch.count_nonzero(T[2:, 2:] - torch.diag(T[2:, 2:].diagonal())) == 0  # the rest: one scale
    assert torch.allclose(T[2:, 2:].diagonal(), T[2, 2].expand(6))


def test_mixed_latent_rows_give_the_mixed_latent():
    torch.manual_seed(2)
    m, D = 4, 7
    lat_w, anchor, T = (torch.randn(m, D, dtype=torch.float64), torch.randn(D, dtype=torch.float64),
                        torch.randn(m + 1, m + 1, dtype=torch.float64))
    x = torch.randn(9, D, dtype=torch.float64)
    z = torch.cat([x @ lat_w.T, (x @ anchor)[:, None]], 1)
    assert torch.allclose(x @ latent_rows(lat_w, anchor, T).T, z @ T.T, atol=1e-10)
    assert torch.equal(latent_rows(lat_w, anchor), torch.cat([lat_w, anchor[None]]))


@pytest.fixture(scope="module")
def engine_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    calib = calib_folder(root / "calib")
    src = save_model(root / "src", "llama")
    out = root / "out"
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), "--calib-tokens", "256",
                 "--calib-seq-len", "32", "--eval-tokens", "128", "--rope-dim", "8", "--kv-lora-rank", "25"]) == 0
    return src, out


def test_engine_output_is_what_engines_load(engine_out):
    from safetensors import safe_open

    src, out = engine_out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_interleave"] is True and cfg["attention_bias"] is False and cfg["q_lora_rank"] == 64
    rope = cfg["rope_parameters"]  # the plain ladder as DeepSeek writes RoPE (vLLM-CPU mis-rotates `default`)
    assert rope["rope_type"] == "yarn" and rope["factor"] == 1.0 and cfg["tie_word_embeddings"] is False
    assert rope["original_max_position_embeddings"] == cfg["max_position_embeddings"]
    assert cfg["n_routed_experts"] > cfg["n_group"] and cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" in index and not [n for n in index if n.endswith(".bias")]
    with safe_open(str(out / index["model.layers.0.self_attn.kv_b_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.kv_b_proj.weight").abs().max() < 1e4  # well inside f16
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["target"]["form"] == "engines" and report["target"]["constant_channel"] is False
    assert "llama.cpp" in report["load"]["needs"] and report["settings"]["rope_frequencies"] == "ladder"
    native = {s["name"]: s for s in report["steps"]}["native"]
    assert not native["exact"] and native["logits_rel_err_mean"] > 0  # the lossy latent norm is measured
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())


def test_exact_frequencies_need_the_transformers_target(tmp_path, capsys):
    assert main(["convert", "--to", "mla", "reference", "-o", str(tmp_path / "o"), "--rope-frequencies", "exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target transformers" in err[0] and not (tmp_path / "o").exists()


def _one_step_loss_change(path: Path, lora: bool, lr: float) -> float:
    """Relative change of the training loss on one batch of held-out Python after one AdamW step
    (plain PEFT LoRA on every attention projection, or full fine-tuning)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from attnkit.data import pack_tokens

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = pack_tokens(AutoTokenizer.from_pretrained(path), "python", "validation", 256, 2 * 256, 1)
    if lora:
        targets = ["q_b_proj", "q_a_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        present = {n.split(".")[-1] for n, _ in model.named_modules()}
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[t for t in targets if t in present]))
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        before = float(model(input_ids=ids, labels=ids).loss)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(params, lr=lr).step()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss) / before - 1


@pytest.fixture(scope="module")
def reference_forms(tmp_path_factory):
    """The reference at 29.7 % of its KV cache in both forms (small calibration: a fixture, not a measurement)."""
    root = tmp_path_factory.mktemp("forms")
    for target in ("engines", "transformers"):
        assert main(["convert", "--to", "mla", "reference", "-o", str(root / target), "--kv-lora-rank", "28",
                     "--rope-dim", "48", "--calib-tokens", "2048", "--calib-seq-len", "256", "--eval-tokens", "512",
                     "--target", target]) == 0
    return root


@pytest.mark.slow
@pytest.mark.parametrize("lora, lr", [(True, 1e-3), (True, 1e-4), (False, 1e-3), (False, 1e-4)])
def test_one_plain_optimizer_step_does_not_diverge(reference_forms, lora, lr):
    """No channel or weight of the engine form makes one AdamW step of plain PEFT LoRA or full
    fine-tuning wreck the model; the transformers form's constant channel does (the control).
    LoRA: within 5 % (the issue's bound). Full fine-tuning moves every weight by lr and may fit or
    unfit the batch by several percent (the source model: -4 % and -11 %); it must not diverge."""
    change = _one_step_loss_change(reference_forms / "engines", lora, lr)
    assert abs(change) < 0.05 if lora else change < 0.25
    assert _one_step_loss_change(reference_forms / "transformers", lora, lr) > 0.5


def test_engine_sizes_are_reported_with_the_backends_that_take_them():
    from attnkit.converters.mla.engines import engine_support

    llama3_8b = engine_support(512, 64, 128, 128, "engines")  # DeepSeek-V3's own sizes
    assert all(v.startswith("yes") for v in llama3_8b.values())
    small = engine_support(28, 48, 64, 64, "engines")
    assert small["llama.cpp"] == "yes" and small["vLLM CUDA"].startswith("no") and "d_r 64" in small["vLLM CUDA"]
    assert "76" in small["vLLM CPU"] and small["vLLM CPU"].startswith("no") and "VLLM_MLA_DISABLE" in small["vLLM CPU"]
    # 448 + 64 = 512 runs on CUDA's MLA path, not on the CPU backends (576 only)
    mid = engine_support(448, 64, 64, 128, "engines")
    assert mid["vLLM CUDA"] == "yes" and mid["vLLM CPU"].startswith("no")
    assert engine_support(512, 64, 64, 64, "engines")["vLLM CPU"].startswith("yes")
    assert all(v.startswith("no") for k, v in engine_support(512, 64, 128, 128, "transformers").items()
               if k != "transformers")
    assert "longrope" in engine_support(512, 64, 128, 128, "transformers", "exact")["vLLM"]
    assert "longrope" not in engine_support(512, 64, 128, 128, "transformers", "geometric")["vLLM"]


def test_vllm_splits_are_the_cached_sizes_its_kernels_take():
    from attnkit.converters.mla.engines import vllm_splits

    assert vllm_splits(1024, 961, 64) == [(512, 64), (448, 64), (256, 64)]  # MHA 8 x 64: every size fits
    assert vllm_splits(1024, 961, 64, cpu=True) == [(512, 64)]
    assert vllm_splits(576, 961, 64) == [(512, 64), (448, 64), (256, 64)]
    assert vllm_splits(575, 961, 64) == [(448, 64), (256, 64)]
    assert vllm_splits(256, 193, 64) == []  # the reference's 30 %: no size fits
    assert vllm_splits(1024, 961, 32) == []  # a RoPE dim cap below 64


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits


@pytest.mark.parametrize("target", ["engines", "transformers"])
def test_padded_value_heads_are_the_same_model(engine_out, tmp_path, target):
    """--v-head-dim 2*head_dim: zero V rows in kv_b_proj and zero o_proj columns, same logits, same cache."""
    src, engine_plain = engine_out
    calib = engine_plain.parent / "calib"
    args = ["--calib", str(calib), "--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128",
            "--rope-dim", "8", "--kv-lora-rank", "25", "--target", target]
    plain = engine_plain
    if target != "engines":
        plain = tmp_path / "plain"
        assert main(["convert", "--to", "mla", str(src), "-o", str(plain), *args]) == 0
    padded = tmp_path / "padded"
    head_dim = json.loads((plain / "config.json").read_text())["v_head_dim"]
    assert main(["convert", "--to", "mla", str(src), "-o", str(padded), *args, "--v-head-dim", str(2 * head_dim)]) == 0
    cfg = json.loads((padded / "config.json").read_text())
    report = json.loads((padded / "attnkit_report.json").read_text())
    assert cfg["v_head_dim"] == 2 * head_dim == report["target"]["v_head_dim"] and cfg["qk_nope_head_dim"] == head_dim
    assert report["kv_cache_bytes_per_token"] == json.loads((plain / "attnkit_report.json").read_text())["kv_cache_bytes_per_token"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    a, b = _logits(plain, ids), _logits(padded, ids)
    assert float((a - b).norm() / a.norm()) < 1e-5


def test_value_heads_are_padded_never_cut(tmp_path, capsys):
    assert main(["convert", "--to", "mla", "reference", "-o", str(tmp_path / "o"), "--v-head-dim", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--v-head-dim must be >= head_dim 64" in err[0] and not (tmp_path / "o").exists()


def test_padding_values_makes_head_dim_64_sizes_vllm_prefill_sizes():
    from attnkit.converters.mla.engines import engine_support

    assert engine_support(448, 64, 64, 64, "engines")["vLLM CUDA"].startswith("no")  # (64, 64) is no prefill pair
    assert engine_support(448, 64, 64, 128, "engines")["vLLM CUDA"] == "yes"  # r + d_r = 512; (64, 128) is one
