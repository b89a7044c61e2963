"""The FSDP teacher built on the meta device, sharded and filled from its checkpoint tensor by tensor
(`attnkit/training/sharded_load.py`) is the model `from_pretrained` loads: the same logits (fp32, exact) for
every real config under tests/data/configs (tied and untied embeddings, biases, fused qkv, softcapping,
llama3 / yarn / longrope RoPE), and no fallback to the whole load. The trainer's FSDP teacher of the same
checkpoint saved in bf16 is held in bf16 and gives the fp32 load's logits and hidden states bit for bit.

Run in a subprocess: `fully_shard` needs a process group (gloo, a world of one), which must not outlive the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mla_fixtures import family_model
from test_fsdp_cpu import fsdp_on_cpu_unavailable
from test_real_configs import NAMES

pytestmark = pytest.mark.skipif(fsdp_on_cpu_unavailable() is not None, reason=str(fsdp_on_cpu_unavailable()))

SCRIPT = r'''
import json, sys, types
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

sys.path.insert(0, sys.argv[2])
from test_real_configs import NAMES, build
from attnkit.training import sharded_load, vocab_parallel
from attnkit.training.models import load_causal_lm
from attnkit.training.teacher import load_fsdp_teacher

root = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
plugin = types.SimpleNamespace(mixed_precision_policy=MixedPrecisionPolicy())
accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"))
out, held = {}, {}
for name in NAMES:
    src = build(name, root / name)
    whole = load_causal_lm(src, False).eval()
    loaded = sharded_load.load_sharded(src, False, torch.device("cpu"),
                                       lambda m: sharded_load.shard_teacher_layers(m, accelerator))
    if loaded is None:
        out[name] = None
        continue
    model, layers = loaded
    ids = torch.randint(0, whole.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((model.eval()(ids).logits - whole(ids).logits).abs().max())
    head = model.get_output_embeddings().weight
    out[name] = {"diff": diff, "layers": layers, "tied": whole.config.tie_word_embeddings,
                 "head_sharded": isinstance(head, DTensor)}
    # the trainer's FSDP teacher of a bf16 checkpoint: held in bf16, the fp32 load's outputs bit for bit
    src16 = root / (name + "-bf16")
    whole.to(torch.bfloat16).save_pretrained(src16)
    want = load_causal_lm(src16, False).eval()
    teacher, _ = load_fsdp_teacher(src16, {}, accelerator)
    with torch.no_grad():
        a, b = teacher(ids, output_hidden_states=True), want(ids, output_hidden_states=True)
    held[name] = {"equal": bool(torch.equal(a.logits, b.logits))
                  and all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states)),
                  "dtypes": sorted({str(p.dtype) for p in teacher.parameters()}),
                  "tables_sharded": [isinstance(m.weight, DTensor) for m in (teacher.get_input_embeddings(),
                                                                           teacher.get_output_embeddings())],
                  "plain": [vocab_parallel.splittable(whole.get_input_embeddings()),
                            vocab_parallel.splittable(whole.get_output_embeddings())],
                  "scaled": type(whole.get_input_embeddings()).__name__ in vocab_parallel.SCALED_EMBEDDINGS}
dist.destroy_process_group()
print(json.dumps({"fp32": out, "bf16": held}))
'''


def test_sharded_teacher_equals_from_pretrained_on_every_real_config(tmp_path):
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(tests)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results, held = (json.loads(done.stdout.strip().splitlines()[-1])[k] for k in ("fp32", "bf16"))
    assert sorted(results) == sorted(NAMES)
    for name, r in results.items():
        assert r is not None, f"{name}: fell back to the whole load (checkpoint names are not the model's)"
        assert r["diff"] == 0.0, (name, r)
        assert r["layers"] == 2, (name, r)
        assert r["head_sharded"] == (not r["tied"]), (name, r)  # untied fp32 LM heads are FSDP units of their own
        # held in bf16 in an fp32 run, the tables are split by vocabulary rows (FSDP would gather them in fp32),
        # tied ones together, Gemma's scaled embeddings too: the same outputs bit for bit
        plain, scaled = held[name].pop("plain"), held[name].pop("scaled")
        assert all(plain) and scaled == name.startswith("google--gemma"), (name, plain, scaled)
        assert held[name] == {"equal": True, "dtypes": ["torch.bfloat16"], "tables_sharded": [True, True]}, \
            (name, held[name])


def _plugin_accelerator(offload: bool = False, mixed_precision: str = "no"):
    import types

    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = types.SimpleNamespace(cpu_offload=CPUOffloadPolicy() if offload else None)
    return types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"),
                                 mixed_precision=mixed_precision)


@pytest.mark.parametrize("tied", [False, True])
def test_frozen_16_bit_embedding_tables_are_split_not_sharded(tied):
    """`sharded_load.vocab_tables`: the student's embeddings and LM head when frozen and held in 16 bits in a run
    that computes in fp32 (FSDP then leaves them to `vocab_parallel`), and not when one trains (tied: neither),
    is fp32, the run computes in bf16, or FSDP offloads its parameters."""
    from attnkit.training import frozen
    from attnkit.training.sharded_load import vocab_tables

    model, _ = family_model("smollm" if tied else "llama")
    model.requires_grad_(False)
    assert vocab_tables(model, _plugin_accelerator()) == []  # fp32: FSDP shards them as before
    frozen.cast_frozen(model, torch.bfloat16)
    found = vocab_tables(model, _plugin_accelerator())
    assert found == [model.get_input_embeddings(), model.get_output_embeddings()]
    assert (found[0].weight is found[1].weight) == tied
    assert vocab_tables(model, _plugin_accelerator(offload=True)) == []
    assert vocab_tables(model, _plugin_accelerator(mixed_precision="bf16")) == []  # gathered in bf16 there, as before
    model.get_output_embeddings().weight.requires_grad_(True)  # a trained head (tied: the embeddings too) stays sharded
    assert vocab_tables(model, _plugin_accelerator()) == ([] if tied else [model.get_input_embeddings()])


def test_a_16_bit_embedding_computes_in_fp32_after_fsdp_swaps_its_class():
    """`frozen.compute_in_fp32` looks a 16-bit embedding's rows up in 16 bits and upcasts them (no fp32 table) also
    when FSDP2's `fully_shard` has swapped the module's class for its subclass `FSDPEmbedding(FSDPModule, Embedding)`."""
    from torch.distributed.fsdp import FSDPModule

    from attnkit.training import frozen

    emb = torch.nn.Embedding(10, 4).to(torch.bfloat16)
    emb.__class__ = type("FSDPEmbedding", (FSDPModule, torch.nn.Embedding), {})  # as fully_shard builds it
    assert frozen.built_class(emb) is torch.nn.Embedding
    holder = torch.nn.Sequential(emb)
    assert frozen.compute_in_fp32(holder) == 1
    out = holder(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.float32 and torch.equal(out, emb.weight[[1, 2, 3]].float()[None])
    assert emb.weight.dtype == torch.bfloat16
