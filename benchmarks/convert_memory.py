"""Peak memory and wall time of `attnkit convert` (every method) on a Llama-3.2-1B- or 3.1-8B-shaped random model.

    python benchmarks/convert_memory.py [--work /tmp/attnkit-mem] [--layers 16] [--calib-tokens 8192]
    python benchmarks/convert_memory.py --method mla,gqa,dex,diff,titans,mla+dex,mla+titans [--source DIR]
    python benchmarks/convert_memory.py --shape 8b --work /tmp/attnkit-mem8b --extra "--report final"

`--shape 8b` builds Llama-3.1-8B's shape from its published config.json (tests/data/configs/, every field
kept; 16 GB bf16, untied head), one tensor at a time.

`--source DIR` measures an existing checkpoint instead of building the 1B shape (e.g. a small model with a
16K-position config). Each method runs with the arguments in METHOD_ARGS (sized from the source's config).

The source checkpoint (sharded bf16 safetensors, tied embeddings, llama3 RoPE scaling) is built
tensor by tensor, never whole. The conversion runs in a child process that reports its own peak
RSS (VmHWM, `attnkit.evaluation.peak`; getrusage of children would include this process's peak).
The result (JSON) is printed and written beside --work; `--results FILE` also merges each run into FILE
(a run replaces the earlier one of the same source and command), which `benchmarks/plot_convert_memory.py`
draws: wall time and peak RSS against the source's parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

LLAMA_32_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=1, eos_token_id=2,
)


CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "data" / "configs"


def shape_config(shape: str, layers: int | None):
    """The LlamaConfig of a shape: the 1B dict above, or Llama-3.1-8B's published config.json. The token
    ids are the small benchmark tokenizer's (its vocabulary is 4,096; the embedding keeps the real size)."""
    from transformers import LlamaConfig

    if shape == "1b":
        fields = dict(LLAMA_32_1B)
    else:
        fields = json.loads((CONFIGS / "meta-llama--Llama-3.1-8B.json").read_text())
        fields.update(bos_token_id=1, eos_token_id=2)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return LlamaConfig(**fields)


def build_source(folder: Path, cfg) -> int:
    """Write the random bf16 checkpoint tensor by tensor (never more than one in memory); returns its bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from attnkit.data import iter_documents
    from attnkit.io.checkpoint import ShardedWriter

    layers = cfg.num_hidden_layers
    folder.mkdir(parents=True, exist_ok=True)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)
    D, I, H, G, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    writer = ShardedWriter(folder, max_shard_bytes=1 << 30)
    writer.add("model.embed_tokens.weight", rnd(cfg.vocab_size, D))
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj.weight": (H * d, D), "self_attn.k_proj.weight": (G * d, D),
                  "self_attn.v_proj.weight": (G * d, D), "self_attn.o_proj.weight": (D, H * d),
                  "mlp.gate_proj.weight": (I, D), "mlp.up_proj.weight": (I, D), "mlp.down_proj.weight": (D, I)}
        for name, shape in shapes.items():
            writer.add(p + name, rnd(*shape))
        writer.add(p + "input_layernorm.weight", torch.ones(D, dtype=torch.bfloat16))
        writer.add(p + "post_attention_layernorm.weight", torch.ones(D, dtype=torch.bfloat16))
    writer.add("model.norm.weight", torch.ones(D, dtype=torch.bfloat16))
    if not cfg.tie_word_embeddings:
        writer.add("lm_head.weight", rnd(cfg.vocab_size, D))
    writer.close()
    texts = [doc.text for _, doc in zip(range(300), iter_documents("python", "train"))]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def method_args(method: str, config: dict) -> list[str]:
    """The convert arguments each method is measured with: MLA at ~30 % of the cache, GQA to half the KV
    heads, Titans with a 4096-token window (or a quarter of the context), DEX on every head."""
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or config["hidden_size"] // heads
    total = int(0.3 * 2 * kv * d)
    rope = min(d, max(2, (total // 3) // 2 * 2))
    mla = ["--kv-lora-rank", str(total - rope), "--rope-dim", str(rope)]
    window = ["--window", str(min(4096, config.get("max_position_embeddings", 16384) // 4))]
    return {"mla": mla, "gqa": ["--kv-heads", str(max(1, kv // 2))], "dex": ["--heads", "all"], "diff": [],
            "titans": window, "mla+dex": mla, "mla+titans": mla + window}[method]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/attnkit-mem")
    ap.add_argument("--shape", choices=["1b", "8b"], default="1b", help="the random source's shape (default 1b)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's, 16 or 32)")
    ap.add_argument("--untied", action="store_true", help="an LM head of its own (the 1B shape ties it to the "
                    "embeddings; 8B and larger do not)")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--extra", default="", help="extra convert arguments, space-separated")
    ap.add_argument("--keep", action="store_true", help="keep the source and output checkpoints")
    ap.add_argument("--method", default="mla", help="comma-separated --to methods (default mla)")
    ap.add_argument("--defaults", action="store_true", help="convert with each method's own defaults, not METHOD_ARGS")
    ap.add_argument("--source", default=None, help="an existing checkpoint folder instead of the 1B shape")
    ap.add_argument("--label", default=None, help="the source's name in --results (default: the shape, or the folder)")
    ap.add_argument("--results", default=None, help="merge the runs into this JSON file (e.g. "
                    "benchmarks/results/convert_memory.json)")
    args = ap.parse_args()
    work = Path(args.work)
    src, out = (Path(args.source) if args.source else work / "src"), work / "out"
    work.mkdir(parents=True, exist_ok=True)
    if not (src / "config.json").is_file():
        cfg = shape_config(args.shape, args.layers)
        cfg.tie_word_embeddings = cfg.tie_word_embeddings and not args.untied
        build_source(src, cfg)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    label = args.label or (src.name if args.source else f"llama-{args.shape}-shape")
    shutil.rmtree(out, ignore_errors=True)
    from attnkit.evaluation.peak import run_with_peak

    probe = "import attnkit.converters.mla.convert; print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    import_rss = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout) * 1024
    config = json.loads((src / "config.json").read_text())
    results = []
    for method in args.method.split(","):
        cmd = ["convert", "--to", method, str(src), "-o", str(out), "--force", "--calib-tokens", str(args.calib_tokens),
               *(["--eval-tokens", str(args.eval_tokens)] if method in ("mla", "gqa") else []),
               *([] if args.defaults else method_args(method, config)), *args.extra.split()]
        t0 = time.time()
        code, peak, err = run_with_peak(cmd, quiet=False)
        wall = time.time() - t0
        if code != 0:
            sys.exit(f"{method}: conversion failed: {err}")
        results.append({
            "source": label,
            "source_params": source_params(src),
            "method": method,
            "command": "attnkit " + " ".join(cmd),
            "source_bytes": size,
            "peak_rss_bytes": peak,
            "peak_rss_fraction_of_checkpoint": peak / size,
            "import_only_rss_bytes": import_rss,  # interpreter + torch + transformers + attnkit, nothing converted
            "wall_time_s": round(wall, 1),
            "threads": torch.get_num_threads(),
            "output_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        })
        print(json.dumps(results[-1], indent=2))
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    result = results[0] if len(results) == 1 else {"runs": results}
    (work / "convert_memory.json").write_text(json.dumps(result, indent=2))
    if args.results:  # the folders named as the docs write them
        merge_results(Path(args.results), [{**r, "command": r["command"].replace(str(src), "SRC").replace(str(out), "OUT")}
                                           for r in results])


def source_params(folder: Path) -> int:
    """Parameters of a checkpoint, from its safetensors headers (nothing loaded)."""
    from attnkit.io.checkpoint import LazyCheckpoint

    return sum(math.prod(shape) for shape in LazyCheckpoint(folder).shapes().values())


def merge_results(path: Path, runs: list[dict]) -> None:
    """Add `runs` to the results file; a run replaces the earlier one of the same source and command (a
    method at its defaults and at METHOD_ARGS are two runs)."""
    old = json.loads(path.read_text())["runs"] if path.is_file() else []
    new = {(r["source"], r["command"]) for r in runs}
    kept = [r for r in old if (r["source"], r["command"]) not in new]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": kept + runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
