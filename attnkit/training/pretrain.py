"""`attnkit pretrain`: train the bundled reference model (tokenizer + small GQA Llama).

The model has to be *pretrained* — random weights have no low-rank structure, so quality kept by a
conversion can only be measured on a model that learnt something. The corpus is the Python standard
library, which every machine with Python has, split by file (attnkit.data), so anyone can rebuild it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnkit.data import iter_documents, pack_tokens
from attnkit.errors import AttnkitError
from attnkit.training.config import load_recipe
from attnkit.training.measure import validation_loss

SPECIAL = "<|endoftext|>"


@dataclass
class TokenizerSpec:
    vocab_size: int = 8192
    min_frequency: int = 2


@dataclass
class ModelSpec:
    model_type: str = "llama"  # any causal-LM model_type of transformers with these fields (llama, qwen3, ...)
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 16384
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True


@dataclass
class TrainSpec:
    seq_len: int = 256
    batch_size: int = 32
    tokens: int = 5_013_504
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    autocast_bf16: bool = True
    eval_every: int = 100
    eval_rows: int = 64
    save_every: int = 50
    device: str = "auto"
    threads: int = 0
    long_seq_len: int = 1024       # the last `long_fraction` of steps trains on longer windows
    long_fraction: float = 0.15    # (same tokens per step) so the model is usable at 1K context

    @property
    def long_start(self) -> int:
        return self.steps - int(round(self.steps * self.long_fraction))

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.seq_len * self.batch_size))


@dataclass
class PretrainRecipe:
    run_dir: str = "runs/reference"
    export_dir: str = "attnkit/assets/reference"
    corpus: str = "python"
    seed: int = 0
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    export_dtype: str = "bf16"


def train_tokenizer(corpus: str, spec: TokenizerSpec):
    """Byte-level BPE on the training split; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in iter_documents(corpus, "train")), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL, unk_token=SPECIAL, pad_token=SPECIAL
    )


def build_model(spec: ModelSpec, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in asdict(spec).items() if k not in ("rope_theta", "model_type")}
    try:
        config = AutoConfig.for_model(
            spec.model_type,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_act="silu",
            **fields,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        )
    except ValueError as e:
        raise AttnkitError(f"model.model_type {spec.model_type!r}: {e}") from None
    return AutoModelForCausalLM.from_config(config)


def _check_export_dir(folder: Path, run_dir: Path | None = None, corpus: str | None = None) -> None:
    """Only an earlier `attnkit pretrain` export may be replaced (it carries training_summary.json);
    never one that is, is inside or contains the run folder or the corpus (the export replaces it)."""
    from attnkit.io.checkpoint import check_output_dir

    if run_dir is not None:
        check_output_dir(folder, True, (run_dir,), what="the run folder (run_dir)")
    if corpus and corpus not in ("python", "python+site") and Path(corpus).expanduser().exists():
        check_output_dir(folder, True, (Path(corpus).expanduser(),), what="the corpus")
    if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not (folder / "training_summary.json").is_file())):
        raise AttnkitError(f"export_dir {folder} exists and is not an earlier pretrain export; choose an empty folder")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise AttnkitError("train.device is cuda but no CUDA device is available")
    return torch.device(name)


def _tokens(recipe: PretrainRecipe, tokenizer, run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed train / validation rows, cached in the run folder."""
    cache = run_dir / "tokens.pt"
    if cache.is_file():
        data = torch.load(cache)
        return data["train"], data["validation"]
    seq = recipe.train.seq_len
    train = pack_tokens(tokenizer, recipe.corpus, "train", seq, seed=recipe.seed)
    val = pack_tokens(tokenizer, recipe.corpus, "validation", seq, seed=recipe.seed)
    torch.save({"train": train, "validation": val}, cache)
    return train, val


def evaluate_loss(model, rows: torch.Tensor, device, batch: int = 16) -> float:
    """Mean next-token cross-entropy over `rows` [n, L] (the healing trainer's own measure)."""
    total, count = validation_loss(model, rows, batch, device)
    return total / count


def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass(frozen=True)
class Batches:
    """Which rows each step trains on, fixed by the seed so that a resumed run sees the same batches: the
    rows in a new random order each epoch, then, for the last `long_fraction` of steps, k neighbouring rows
    (consecutive chunks of one packed stream) joined into one long row, `batch_size // k` of them a step."""

    train_rows: torch.Tensor  # [n, seq_len]
    order: torch.Tensor  # row indices, epoch after epoch
    k: int  # rows per long row
    groups: int  # long rows available
    long_rows: torch.Tensor  # [groups, k * seq_len]
    long_order: torch.Tensor
    long_batch: int
    batch_size: int
    long_start: int  # the first step on long rows

    @classmethod
    def plan(cls, recipe: PretrainRecipe, train_rows: torch.Tensor) -> Batches:
        t = recipe.train
        needed = t.steps * t.batch_size
        generator = torch.Generator().manual_seed(recipe.seed)
        epochs = math.ceil(needed / len(train_rows))
        order = torch.cat([torch.randperm(len(train_rows), generator=generator) for _ in range(epochs)])
        k = max(1, t.long_seq_len // t.seq_len)
        groups = len(train_rows) // k
        long_rows = train_rows[: groups * k].reshape(groups, k * t.seq_len)  # [groups, k*seq_len]
        long_order = torch.randperm(groups, generator=generator)
        long_batch = max(1, t.batch_size // k)
        return cls(train_rows, order, k, groups, long_rows, long_order, long_batch, t.batch_size, t.long_start)

    def at(self, step: int) -> torch.Tensor:
        """The input ids of optimizer step `step` (0-based): [batch_size, seq_len] or [long_batch, k*seq_len]."""
        if step < self.long_start:
            return self.train_rows[self.order[step * self.batch_size : (step + 1) * self.batch_size]]
        j = (step - self.long_start) * self.long_batch
        return self.long_rows[self.long_order[j % self.groups : j % self.groups + self.long_batch]]


def train(recipe: PretrainRecipe) -> dict:
    """Pretrain according to `recipe` (resuming from RUN_DIR's checkpoint if any), export EXPORT_DIR and
    return the training summary."""
    t = recipe.train
    run_dir, device = _open_run_dir(recipe)
    tokenizer = _tokenizer(recipe, run_dir)
    train_rows, val_rows = _tokens(recipe, tokenizer, run_dir)
    print(f"corpus: {train_rows.numel():,} train tokens, {val_rows.numel():,} validation tokens; {t.steps} steps")

    torch.manual_seed(recipe.seed)
    model = build_model(recipe.model, tokenizer).to(device)
    optimizer, scheduler = _optimizer(model, t)
    rows = Batches.plan(recipe, train_rows)
    ckpt_path = run_dir / "checkpoint.pt"
    step, log = _resume(ckpt_path, model, optimizer, scheduler)
    started = _train_steps(t, model, optimizer, scheduler, rows, val_rows[: t.eval_rows], device, ckpt_path, step, log)
    (run_dir / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    summary = _summary(recipe, model, train_rows, val_rows, device, rows.k, started)
    export(model, tokenizer, recipe, summary)
    return summary


def _open_run_dir(recipe: PretrainRecipe) -> tuple[Path, torch.device]:
    """Refuse an export folder the export may not replace, a missing device or RUN_DIR of another recipe
    before half an hour of training; then create RUN_DIR and stamp it with the recipe."""
    t = recipe.train
    _check_export_dir(Path(recipe.export_dir), Path(recipe.run_dir), recipe.corpus)  # before half an hour of training
    run_dir = Path(recipe.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if t.threads:
        torch.set_num_threads(t.threads)
    device = _device(t.device)
    recipe_json = json.dumps(asdict(recipe), sort_keys=True)
    saved_recipe = run_dir / "recipe.json"
    if saved_recipe.is_file() and json.loads(saved_recipe.read_text()) != json.loads(recipe_json):
        raise AttnkitError(f"{run_dir} holds a run with a different recipe; choose another run_dir")
    saved_recipe.write_text(recipe_json)
    return run_dir, device


def _tokenizer(recipe: PretrainRecipe, run_dir: Path):
    """The run's tokenizer: trained on the corpus once, then read back from RUN_DIR/tokenizer."""
    tok_dir = run_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(tok_dir)
    print("training the tokenizer …")
    tokenizer = train_tokenizer(recipe.corpus, recipe.tokenizer)
    tokenizer.save_pretrained(tok_dir)
    return tokenizer


def _optimizer(model, t: TrainSpec):
    """AdamW (weight decay on matrices only) and the cosine schedule with warmup down to min_lr_ratio."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(0.9, 0.95),
    )
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, t.warmup_steps, t.steps, min_lr_rate=t.min_lr_ratio)
    return optimizer, scheduler


def _resume(ckpt_path: Path, model, optimizer, scheduler) -> tuple[int, list]:
    """The step and log to continue from: the checkpoint's (its states loaded into the three), else 0 and []."""
    if not ckpt_path.is_file():
        return 0, []
    ckpt = torch.load(ckpt_path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    print(f"resuming from step {ckpt['step']}")
    return ckpt["step"], ckpt["log"]


def _train_steps(t: TrainSpec, model, optimizer, scheduler, rows: Batches, val_eval: torch.Tensor, device,
                 ckpt_path: Path, step: int, log: list) -> float:
    """The optimizer steps from `step` to the last, appending to `log` (the loss each step, the validation
    loss every `eval_every`) and checkpointing every `save_every`; returns the time training (re)started."""
    bar = tqdm(total=t.steps, initial=step, desc="pretrain", unit="step")
    started, tokens_per_step = time.time(), t.batch_size * t.seq_len
    model.train()
    while step < t.steps:
        x = rows.at(step).to(device)
        with _autocast(device, t.autocast_bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        entry = {"step": step, "loss": round(loss.item(), 4), "lr": scheduler.get_last_lr()[0]}
        if step % t.eval_every == 0 or step == t.steps:
            with _autocast(device, t.autocast_bf16):
                entry["val_loss"] = round(evaluate_loss(model, val_eval, device), 4)
        log.append(entry)
        rate = tokens_per_step * (bar.n + 1 - bar.initial) / max(time.time() - started, 1e-9)
        bar.set_postfix(loss=f"{loss.item():.3f}", val=entry.get("val_loss", ""), tok_s=f"{rate:,.0f}")
        bar.update(1)
        if step % t.save_every == 0 or step == t.steps:
            _save_checkpoint(ckpt_path, model, optimizer, scheduler, step, log)
    bar.close()
    return started


def _save_checkpoint(ckpt_path: Path, model, optimizer, scheduler, step: int, log: list) -> None:
    """Model, optimizer and schedule states with the step and log, replacing the last checkpoint atomically."""
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
         "scheduler": scheduler.state_dict(), "step": step, "log": log},
        tmp,
    )
    tmp.replace(ckpt_path)


def _summary(recipe: PretrainRecipe, model, train_rows: torch.Tensor, val_rows: torch.Tensor, device, k: int,
             started: float) -> dict:
    """The trained model's loss on the whole validation split in fp32, at seq_len and in k×seq_len windows,
    with what it was trained on: training_summary.json and the model card's figures."""
    t = recipe.train
    val_loss = evaluate_loss(model, val_rows, device)  # whole validation split, fp32
    kv = len(val_rows) // k
    val_long = val_rows[: kv * k].reshape(kv, k * t.seq_len)
    val_loss_long = evaluate_loss(model, val_long, device, batch=4)
    return {
        "corpus": recipe.corpus,
        "train_tokens_available": int(train_rows.numel()),
        "tokens_seen": int(t.steps * (t.batch_size * t.seq_len)),
        "steps": t.steps,
        "validation_tokens": int(val_rows.numel()),
        "validation_loss": round(val_loss, 4),
        "validation_perplexity": round(math.exp(val_loss), 3),
        f"validation_perplexity_{k * t.seq_len}": round(math.exp(val_loss_long), 3),
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "seconds": round(time.time() - started, 1),
    }


def export(model, tokenizer, recipe: PretrainRecipe, summary: dict) -> None:
    from attnkit.io.checkpoint import atomic_output_dir

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[recipe.export_dtype]
    with atomic_output_dir(recipe.export_dir, force=True) as tmp:
        model.to("cpu", dtype).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_summary.json").write_text(json.dumps({**summary, "recipe": asdict(recipe)}, indent=2) + "\n")
        (tmp / "README.md").write_text(_card(recipe, summary, type(model).__name__, model.config.model_type))
    print(json.dumps(summary, indent=2))


def _card(recipe: PretrainRecipe, s: dict, model_class: str = "LlamaForCausalLM", model_type: str = "llama") -> str:
    from attnkit.card.names import scrub  # a local corpus path by its folder name: the card is public

    m, corpus = recipe.model, scrub(recipe.corpus)
    kind = "mha" if m.num_key_value_heads == m.num_attention_heads else "mqa" if m.num_key_value_heads == 1 else "gqa"
    return f"""---
library_name: transformers
tags: [attnkit, reference-model, {model_type}, {kind}]
---
# attnkit reference model

A small {kind.upper()} `{model_class}` trained by `attnkit pretrain` (its recipe is in training_summary.json) so that
attnkit can measure the quality a conversion keeps without downloading anything.

* Architecture: {m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} query heads,
  {m.num_key_value_heads} KV heads, head_dim {m.head_dim}, MLP {m.intermediate_size}, RoPE θ={m.rope_theta:g},
  max positions {m.max_position_embeddings} (trained at {recipe.train.seq_len} tokens; quality beyond that is not claimed),
  tied embeddings, {s['params']:,} parameters, stored as {recipe.export_dtype}.
* Tokenizer: byte-level BPE, {recipe.tokenizer.vocab_size} tokens, trained on the same training split.
* Corpus: `{corpus}` — the Python standard library's source files, split train/validation by a hash
  of each file's path (attnkit.data, {100 - 5} % / 5 %).
* Training: {s['steps']} steps × {recipe.train.batch_size} × {recipe.train.seq_len} tokens = {s['tokens_seen']:,} tokens
  ({s['train_tokens_available']:,} distinct training tokens; the last {recipe.train.long_fraction:.0%} of steps
  in {recipe.train.long_seq_len}-token windows), AdamW lr {recipe.train.lr:g} cosine, on {s['device']},
  {s['seconds'] / 60:.0f} minutes.
* Validation (whole validation split, {s['validation_tokens']:,} tokens, {recipe.train.seq_len}-token windows):
  loss {s['validation_loss']}, validation ppl **{s['validation_perplexity']}**; in
  {recipe.train.long_seq_len}-token windows: validation ppl {s[f"validation_perplexity_{recipe.train.long_seq_len}"]}.
"""


def main(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.config, PretrainRecipe, args.overrides)
    train(recipe)
    return 0
