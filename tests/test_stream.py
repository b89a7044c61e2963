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
from attnkit.converters.mla.source import embedded, layer_norms, load_layer, open_source, source_pe, through
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
