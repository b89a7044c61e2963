"""The one streaming engine (`converters/stream/engine.py`): the hook runs once per layer in order on that
layer, each layer is freed before the next is read (memory stays at one layer), the MLP is read
as asked, the bar says what the walk is, and `finish_layer` advances the streams exactly as the
decoder layer does, post-norms included (OLMo-2)."""

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

from attnkit.converters.measure import SourceAttention
from attnkit.converters.mla.progress import ConversionProgress
from attnkit.converters.mla.source import (embedded, layer_norms, load_layer, mlp_compute_dtype, open_source, source_pe,
                                           through)
from attnkit.converters.stream.engine import finish_layer, last_layer, stream_layers

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import COMMON, save_model, tokenizer  # noqa: E402

LAYERS = 3


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return open_source(str(save_model(tmp_path_factory.mktemp("stream") / "src", "llama", num_hidden_layers=LAYERS)))


def _on_meta(module: torch.nn.Module) -> bool:
    return all(p.is_meta for p in module.mlp.parameters())


@pytest.mark.parametrize("by_rows", [False, True])
def test_hook_runs_once_per_layer_in_order_and_each_layer_is_freed_before_the_next(src, by_rows):
    gc.disable()  # freed by reference counting, as it must be: a cycle would wait for the collector
    try:
        seen: list[tuple[int, list[weakref.ref]]] = []  # the layer and its MLP (the by-rows wrapper's cycle)

        def alive() -> bool:
            return any(ref() is not None for _, refs in seen for ref in refs)

        def step(layer: int, module: torch.nn.Module) -> int:
            assert not alive(), "the previous layer is still alive"
            assert module.self_attn.layer_idx == layer and not _on_meta(module)
            seen.append((layer, [weakref.ref(module), weakref.ref(module.mlp)]))
            return 10 * layer

        out = stream_layers(src, "cpu", step, by_rows=by_rows)
        assert out == [0, 10, 20] and [layer for layer, _ in seen] == list(range(LAYERS))
        assert not alive()
    finally:
        gc.enable()


@pytest.mark.parametrize("mlp, meta", [("every", [False] * LAYERS), ("deferred", [True] * LAYERS),
                                       ("not last", [False] * (LAYERS - 1) + [True])])
def test_the_mlp_is_read_as_asked(src, mlp, meta):
    assert stream_layers(src, "cpu", lambda layer, module: _on_meta(module), mlp=mlp) == meta


def test_last_layer(src):
    assert [last_layer(src, i) for i in range(LAYERS)] == [False] * (LAYERS - 1) + [True]


def test_the_bar_says_what_the_walk_is(src, capsys):
    stream_layers(src, "cpu", lambda layer, module: None, "src: convert --to gqa")
    assert "src: convert --to gqa" in capsys.readouterr().err
    stream_layers(src, "cpu", lambda layer, module: None)  # no description: no bar
    assert capsys.readouterr().err == ""
    progress = ConversionProgress("src", LAYERS, calib_rows=8, pre_pass=True)
    stream_layers(src, "cpu", lambda layer, module: None, "rope scores", progress=progress)
    progress.close()
    err = capsys.readouterr().err
    assert "src: convert --to mla" in err and f"rope scores, layer {LAYERS}/{LAYERS}" in err


def _olmo2(folder: Path) -> Path:
    """A tiny OLMo-2 (norms after attention and MLP, none before), its norms random (not ones)."""
    torch.manual_seed(0)
    cfg = Olmo2Config(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    model = Olmo2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("with_ref", [False, True])
def test_finish_layer_is_the_decoder_layer_post_norms_included(tmp_path, with_ref):
    src = open_source(str(_olmo2(tmp_path / "src")))
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    pe = source_pe(src, ids.shape[1], "cpu")
    streams = {"source": embedded(src, ids, tmp_path / "source.f32")}
    h_cal = streams["source"].copy(tmp_path / "calib.f32")
    whole = load_layer(src, 0, "cpu")
    with torch.no_grad():
        expected = through(whole, pe)(streams["source"].all())
    module = load_layer(src, 0, "cpu", mlp=False)
    norms = layer_norms(module, src.family)
    assert not isinstance(norms[1], torch.nn.Identity)  # the post-norms are the family's own
    source_attn = lambda x: module.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]  # noqa: E731
    with torch.no_grad():
        ref = SourceAttention.of(source_attn, norms[0], streams["source"], "cpu") if with_ref else None
    finish_layer(module, src, 0, "cpu", norms, source_attn, ref, streams, h_cal)
    for store in (streams["source"], h_cal):
        assert torch.allclose(store.all(), expected, rtol=0, atol=1e-5)


def _native(monkeypatch, amx: bool) -> None:
    """Pretend the CPU does (or does not) multiply bf16 / fp16 natively."""
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: amx, raising=False)


@pytest.mark.parametrize("storage, amx, want", [(torch.float32, True, torch.float32), (torch.bfloat16, True, torch.bfloat16),
                                                (torch.bfloat16, False, torch.float32), (torch.float16, True, torch.float16),
                                                (torch.float16, False, torch.float32)])
def test_the_mlp_multiplies_in_a_16_bit_dtype_only_where_the_cpu_does_it_natively(monkeypatch, storage, amx, want):
    _native(monkeypatch, amx)
    assert mlp_compute_dtype(storage, "cpu") == want


def test_a_bf16_layer_upcast_equals_fp32_bit_for_bit_and_native_is_within_its_rounding(tmp_path, monkeypatch):
    """`--calib-dtype fp32`: the layer's output is the fp32 load's, bit for bit; `auto` on a native CPU: the
    MLP in bf16, the output within bf16's rounding of it (and not equal: the path was taken)."""
    _native(monkeypatch, True)
    path = save_model(tmp_path / "src", "llama", dtype=torch.bfloat16, num_hidden_layers=2)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    outs = {}
    for calib_dtype in ("fp32", "auto"):
        s = open_source(str(path), calib_dtype=calib_dtype)
        assert s.mlp_dtype == (torch.float32 if calib_dtype == "fp32" else torch.bfloat16)
        assert s.calib_note == {"mlp_dtype": str(s.mlp_dtype).removeprefix("torch.")}
        h = embedded(s, ids, tmp_path / f"{calib_dtype}.f32").all()
        with torch.no_grad():
            outs[calib_dtype] = through(load_layer(s, 0, "cpu"), source_pe(s, ids.shape[1], "cpu"))(h)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states[1]  # layer 0 (the last is normed)
    assert torch.equal(outs["fp32"], want)
    rel = float((outs["auto"] - want).norm() / want.norm())
    assert 0 < rel < 1e-2, rel
