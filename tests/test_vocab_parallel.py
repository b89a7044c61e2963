"""Vocabulary tables split by rows over 2 gloo processes (`attnkit/training/vocab_parallel.py`) compute what
the whole tables compute: embedding rows bit for bit, whole logits, and the chunked cross-entropy and its
gradient (fp32, tight tolerance), with an odd vocabulary (blocks of unequal size), processes holding unequal
numbers of rows (one none at all), an LM head with and without bias, Gemma's soft-capping and scaled embeddings,
tied tables.

Each rank is its own Python process (a file-based gloo group of 2), like the trainer's processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_fsdp_cpu import fsdp_on_cpu_unavailable

pytestmark = pytest.mark.skipif(fsdp_on_cpu_unavailable() is not None, reason=str(fsdp_on_cpu_unavailable()))

RANK = r'''
import json, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from attnkit.training import chunked_head, vocab_parallel

rank, root = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
out = []
for case, (vocab, width, bias, softcap, tied, rows) in enumerate([
        (37, 8, False, None, False, (5, 3)), (37, 8, True, 3.0, False, (4, 0)), (40, 6, False, None, True, (7, 7)),
        (3, 4, True, None, False, (2, 6))]):
    g = torch.Generator().manual_seed(case)  # the same tables on both ranks; each rank's own rows
    emb = torch.nn.Embedding(vocab, width).to(torch.bfloat16).requires_grad_(False)
    head = torch.nn.Linear(width, vocab, bias=bias).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, width, generator=g))
        head.weight.copy_(emb.weight if tied else torch.randn(vocab, width, generator=g))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    if tied:
        head.weight = emb.weight
    want_w, want_b = head.weight.float().clone(), None if not bias else head.bias.float().clone()
    want_e = emb.weight.float().clone()
    g = torch.Generator().manual_seed(100 * case + rank)
    n = rows[rank]
    ids = torch.randint(0, vocab, (n,), generator=g)
    h = torch.randn(n, width, generator=g)
    y = torch.randint(0, vocab, (n,), generator=g)
    assert vocab_parallel.split_tables([emb, head], "cpu") == (1 if tied else 2)
    assert (emb.weight is head.weight) == tied
    r = {}
    r["emb_equal"] = bool(torch.equal(emb(ids.view(1, -1)), want_e[ids].view(1, n, width)))
    logits = head(h)
    ref = F.linear(h, want_w, want_b)
    r["logits"] = float((logits - ref).abs().max()) if n else 0.0
    # the chunked loss, 2 positions a chunk, against autograd on whole logits
    h1 = h.clone().requires_grad_(True)
    loss = vocab_parallel.next_token_ce_sum(h1, y, head, softcap, 2)
    loss.backward()
    h2 = h.clone().requires_grad_(True)
    z = chunked_head.capped(F.linear(h2, want_w, want_b), softcap)[0]
    loss2 = F.cross_entropy(z, y, reduction="sum")
    loss2.backward()
    r["loss"] = abs(float(loss) - float(loss2))
    r["grad"] = float((h1.grad - h2.grad).abs().max()) if n else 0.0
    with torch.no_grad():
        r["loss_no_grad"] = abs(float(vocab_parallel.next_token_ce_sum(h, y, head, softcap, 3)) - float(loss2))
    r["held"] = emb.weight.to_local().shape[0]
    out.append(r)
# Gemma's scaled embedding (lookup times a bf16 `embed_scale` buffer): split, it computes what its own forward
# computes on the fp32 table FSDP would have gathered, bit for bit
from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding
g = torch.Generator().manual_seed(7)
scaled = Gemma2TextScaledWordEmbedding(37, 8, 0, embed_scale=8 ** 0.5).to(torch.bfloat16).requires_grad_(False)
with torch.no_grad():
    scaled.weight.copy_(torch.randn(37, 8, generator=g))
whole = Gemma2TextScaledWordEmbedding(37, 8, 0, embed_scale=8 ** 0.5).to(torch.bfloat16)
whole.load_state_dict(scaled.state_dict())
whole.float()
whole.embed_scale = scaled.embed_scale  # bf16, as the model's buffers are: its forward casts it to the table's fp32
ids = torch.randint(0, 37, (1, 5 + rank), generator=torch.Generator().manual_seed(rank))
assert vocab_parallel.splittable(scaled) and vocab_parallel.split_tables([scaled], "cpu") == 1
out.append({"scaled_equal": bool(torch.equal(scaled(ids), whole(ids))), "scale_dtype": str(scaled.embed_scale.dtype)})
try:  # an id outside the table is refused on every process, not looked up as zeros
    emb(torch.tensor([[0] if rank == 0 else [-1]]))  # -1 on one process only: both refuse
    out.append("no error")
except IndexError as e:
    out.append(str(e))
dist.destroy_process_group()
print(json.dumps(out))
'''


def test_split_tables_compute_what_whole_tables_compute(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for rank, found in enumerate(results):
        *cases, scaled, refused = found
        assert refused == "token id out of range for an embedding of 3 rows", (rank, refused)
        assert scaled == {"scaled_equal": True, "scale_dtype": "torch.bfloat16"}, (rank, scaled)
        for case, r in enumerate(cases):
            assert r["emb_equal"], (rank, case, r)
            assert r["logits"] < 1e-5 and r["loss"] < 1e-4 and r["loss_no_grad"] < 1e-4 and r["grad"] < 1e-5, (rank, case, r)
    # blocks of torch.chunk's sizes: 37 rows → 19 + 18, 3 rows → 2 + 1
    assert [r["held"] for r in results[0][:-2]] == [19, 19, 20, 2]
    assert [r["held"] for r in results[1][:-2]] == [18, 18, 20, 1]
