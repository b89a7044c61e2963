"""The fine-tune recipe schema (`attnkit finetune --config`): sections as dataclasses + value checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.training.config import load_recipe

TRAINABLE_MODES = ("new", "attention", "full", "lora")
SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "no", "bf16", "fp16")
CACHE_DTYPES = ("bf16", "fp16", "fp32")
FROZEN_DTYPES = ("checkpoint", "fp32")


@dataclass
class NeedleSection:
    """Recall needles planted into the training rows (`attnkit.needles`); validation rows stay plain."""

    spacing: list[int] = field(default_factory=list)  # [lo, hi] tokens between needles; empty: none
    distance: list[int] = field(default_factory=lambda: [140, 400])  # [lo, hi] tokens to the question


@dataclass
class DataSection:
    source: str = "python"  # any source spec of attnkit.data (python, python+site, file/folder, hf:NAME)
    seq_len: int = 256
    tokens: int = 100_000  # healing tokens seen in total (all processes); sets the number of steps
    val_tokens: int = 16_384  # held-out tokens (validation split) for the validation loss
    seed: int = 0
    needles: NeedleSection = field(default_factory=NeedleSection)


@dataclass
class LoraSection:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    modules_to_save: list[str] = field(default_factory=list)  # trained in full (e.g. new norms)
    merge: bool = True  # merge adapters into the weights at the end (plain HF checkpoint)


@dataclass
class TrainSection:
    trainable: str = "new"  # new | attention | full | lora
    patterns: list[str] = field(default_factory=list)  # regexes over parameter names, for `new`
    lora: LoraSection = field(default_factory=LoraSection)
    per_device_batch_size: int = 8
    grad_accum: int = 1
    max_steps: int | None = None  # overrides data.tokens when set
    lr: float = 3.0e-4
    rest_lr: float = 0.0  # trainable new/attention: every other parameter trains too, at this learning rate (0: frozen)
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr_ratio
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 1.0  # 0 disables clipping
    mixed_precision: str = "auto"  # auto (bf16 on GPUs that support it) | no | bf16 | fp16
    chunked_head: bool = True  # cross-entropy without whole [tokens, vocabulary] logits (when no KL needs them)
    frozen_dtype: str = "checkpoint"  # what does not train (teacher, frozen student weights) is held in: checkpoint
    #   (its 16-bit dtype when it has one, computed in fp32: the same numbers, half the bytes) | fp32 (faster on CPU)
    seed: int = 0


@dataclass
class LossSection:
    ce_weight: float = 0.0  # next-token cross-entropy on the data
    kl_weight: float = 1.0  # KL(teacher || student) on logits; needs `teacher`
    temperature: float = 1.0
    hidden_weight: float = 0.0  # relative MSE of every layer's output to the teacher's; needs an in-process teacher


@dataclass
class TeacherCacheSection:
    """Teacher log-probs precomputed once to disk (attnkit/training/teacher_cache.py); no teacher in training."""

    dir: str = ""  # cache folder (built when absent or empty)
    top_k: int | None = 64  # top-k log-probs + ids per position, the rest in one bucket; null: full vocabulary
    dtype: str = "bf16"  # log-probs on disk: bf16 | fp16 | fp32 (token ids are int32)
    rebuild: bool = False  # replace a cache made for another run (teacher, data, T, top_k…) instead of refusing it


@dataclass
class EvalSection:
    every: int = 0  # validation loss every N steps (0: only before and after)
    tasks: str | None = None  # `attnkit eval` tasks before/after, e.g. attnkit-core (null: skip)
    limit: int | None = None  # at most N documents per task
    tasks_periodic: bool = False  # also run `tasks` at every `every` steps (slow), not only before/after


@dataclass
class CheckpointSection:
    every: int = 0  # save the full training state every N steps (0: never)
    keep: int = 2  # newest checkpoints kept


@dataclass
class LogSection:
    every: int = 1  # log line / tracker point every N steps
    tensorboard: bool = True  # needs the optional `tensorboard` package; skipped with a note otherwise


@dataclass
class Recipe:
    model: str = ""  # the student: a converted model folder, Hub id or `reference`
    teacher: str | None = None  # source model; `source` = the model named in attnkit_report.json
    teacher_is_student_ok: bool = False  # a teacher with the student's own weights is refused unless set
    output_dir: str = ""
    run_dir: str | None = None  # checkpoints and logs (default: OUTPUT_DIR.run)
    force: bool = False  # replace a non-empty output_dir
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    loss: LossSection = field(default_factory=LossSection)
    teacher_cache: TeacherCacheSection | None = None  # null: the teacher runs in the training process
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path(self.output_dir + ".run")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of what determines the trajectory; a checkpoint is resumable only under the same one."""
        d = self.to_dict()
        keep = {k: d[k] for k in ("model", "teacher", "data", "train", "loss")}
        if self.teacher_cache is not None:  # top-k targets train differently; the folder and flag do not matter
            keep["teacher_cache"] = {"top_k": self.teacher_cache.top_k, "dtype": self.teacher_cache.dtype}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]



def check_recipe(r: Recipe) -> None:
    """Value checks the type system cannot express."""
    _need(bool(r.model), "model", "is required (a converted model folder, Hub id or `reference`)")
    _need(bool(r.output_dir), "output_dir", "is required")
    _choice(r.train.trainable, TRAINABLE_MODES, "train.trainable")
    _choice(r.train.schedule, SCHEDULES, "train.schedule")
    _choice(r.train.mixed_precision, PRECISIONS, "train.mixed_precision")
    if r.train.trainable == "new":
        _need(bool(r.train.patterns), "train.patterns", "must list parameter-name regexes when trainable is `new`")
    for key, value in [
        ("data.seq_len", r.data.seq_len),
        ("data.tokens", r.data.tokens),
        ("data.val_tokens", r.data.val_tokens),
        ("train.per_device_batch_size", r.train.per_device_batch_size),
        ("train.grad_accum", r.train.grad_accum),
        ("train.lora.r", r.train.lora.r),
        ("checkpoint.keep", r.checkpoint.keep),
        ("log.every", r.log.every),
    ]:
        _need(value > 0, key, f"must be positive, got {value}")
    for key, value in [
        ("train.warmup_steps", r.train.warmup_steps),
        ("eval.every", r.eval.every),
        ("checkpoint.every", r.checkpoint.every),
        ("loss.ce_weight", r.loss.ce_weight),
        ("loss.kl_weight", r.loss.kl_weight),
        ("loss.hidden_weight", r.loss.hidden_weight),
        ("train.max_grad_norm", r.train.max_grad_norm),
        ("train.weight_decay", r.train.weight_decay),
    ]:
        _need(value >= 0, key, f"must be >= 0, got {value}")
    for key in ("spacing", "distance"):
        lo_hi = getattr(r.data.needles, key)
        if key == "spacing" and not lo_hi:
            continue
        _need(len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1], f"data.needles.{key}",
              f"must be two token counts [lo, hi] with 1 <= lo <= hi, got {lo_hi}")
    _need(r.train.max_steps is None or r.train.max_steps > 0, "train.max_steps", "must be positive")
    _need(r.train.lr > 0, "train.lr", f"must be positive, got {r.train.lr}")
    _need(r.train.rest_lr >= 0, "train.rest_lr", f"must be >= 0, got {r.train.rest_lr}")
    _need(r.train.rest_lr == 0 or r.train.trainable in ("new", "attention"), "train.rest_lr",
          f"applies to trainable new or attention (the rest of the model), not {r.train.trainable}")
    _need(0 <= r.train.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    _need(0 < r.train.decay_fraction <= 1, "train.decay_fraction", "must be in (0, 1]")
    _need(len(r.train.betas) == 2, "train.betas", "must hold two numbers")
    _choice(r.train.frozen_dtype, FROZEN_DTYPES, "train.frozen_dtype")
    _need(r.loss.temperature > 0, "loss.temperature", "must be positive")
    _need(r.loss.ce_weight + r.loss.kl_weight + r.loss.hidden_weight > 0, "loss",
          "ce_weight, kl_weight and hidden_weight are all 0: nothing to train on")
    for key in ("kl_weight", "hidden_weight"):
        if getattr(r.loss, key) > 0:
            _need(r.teacher is not None, "teacher", f"is required when loss.{key} > 0 (or set loss.{key}=0)")
    if r.teacher_cache is not None:
        c = r.teacher_cache
        _need(bool(c.dir), "teacher_cache.dir", "is required (a folder for the cached teacher log-probs)")
        _need(c.top_k is None or c.top_k > 0, "teacher_cache.top_k", f"must be positive or null, got {c.top_k}")
        _choice(c.dtype, CACHE_DTYPES, "teacher_cache.dtype")
        _need(r.loss.kl_weight > 0, "teacher_cache", "caches distillation targets: needs loss.kl_weight > 0")
        _need(r.loss.hidden_weight == 0, "loss.hidden_weight",
              "needs the teacher's hidden states, which a teacher_cache does not keep (set it to 0 or drop teacher_cache)")


def _need(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise AttnkitError(f"recipe key {key}: {why}")


def _choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    _need(value in allowed, key, f"{value!r} is not one of {', '.join(allowed)}")


def load_finetune_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Parse, type-check and value-check a fine-tune recipe."""
    recipe = load_recipe(path, Recipe, overrides)
    check_recipe(recipe)
    return recipe
