"""`attnkit finetune` / `accelerate launch -m attnkit.finetune`: heal a converted model.

One optimizer step, in plain sight (per process, batch b of rows [b, L]):

    for each of `grad_accum` micro-batches:
        s, h_s = student(rows)                         # logits [b, L, V], layer outputs n × [b, L, D]
        t, h_t = teacher(rows) under no_grad            # (when distilling; no LM head when kl_weight = 0)
        loss = ce_weight·CE(s, rows) + kl_weight·T²·KL(softmax(t/T) ‖ softmax(s/T))
               + hidden_weight·mean_layers ‖h_s − h_t‖² / ‖h_t‖²  (per position)
        backward(loss / grad_accum)                     # DDP all-reduces on the last micro-batch
    clip, AdamW step, LR schedule step

accelerate does the process group, DDP/FSDP/DeepSpeed wrapping, mixed precision, data sharding and
save_state/load_state; this file only wires recipe → model, data, loss, schedule, logs and export.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnkit import __version__
from attnkit.data import pack_tokens
from attnkit.errors import AttnkitError
from attnkit.evaluation.ppl import VALIDATION, validation_text
from attnkit.io.checkpoint import check_output_dir
from attnkit.io.resolve import check_causal_lm
from attnkit.training import batches, chunked_head, frozen, measure, models, sharded_load, state, teacher_cache, trainable
from attnkit.training.export import final_model, gathered_tensors, input_dtype, save_healed
from attnkit.training.losses import heal_loss
from attnkit.training.recipe import Recipe, load_finetune_recipe
from attnkit.training.schedules import broadcast_step, build_scheduler
from attnkit.training.teacher import (check_same_depth, check_teacher, load_fsdp_teacher, load_teacher, same_weights,
                                     teacher_spec)


def main(args: argparse.Namespace) -> int:
    """CLI handler (`attnkit finetune --config FILE [k=v ...]`)."""
    recipe = load_finetune_recipe(args.config, args.overrides)
    run(recipe, config_path=args.config)
    return 0


# ------------------------------------------------------------------ loading


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import is_tensorboard_available

    precision = recipe.train.mixed_precision
    if precision == "auto":  # the launcher's choice if any, else bf16 on GPUs that have it
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or ("bf16" if cuda_bf16 else "no")
    want_tb = recipe.log.tensorboard and is_tensorboard_available()
    cpu = _cpu_launch()
    accelerator = Accelerator(
        mixed_precision=precision,
        log_with="tensorboard" if want_tb else None,
        project_dir=str(recipe.resolved_run_dir),
        step_scheduler_with_optimizer=False,  # one scheduler step per optimizer step, whatever the process count
        cpu=cpu,
    )
    if cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        _fsdp_on_cpu(accelerator)
    note = None
    if recipe.log.tensorboard and not want_tb:
        note = "TensorBoard logging skipped: `pip install tensorboard` (log.jsonl is written anyway)"
    return accelerator, note


def _cpu_launch() -> bool:
    """A multi-process launch (torchrun / `accelerate launch`, WORLD_SIZE > 1) on a machine without a device
    that has a distributed backend. accelerate makes each process a world of one there (accelerate/state.py
    PartialState._prepare_backend: no device type, so DistributedType.NO): N copies training alone, all
    writing OUTPUT_DIR. Run them as one gloo process group instead, as `ACCELERATE_USE_CPU=1` would."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("LOCAL_RANK", "-1")) < 0:
        return False
    if os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
        return True
    try:  # accelerate's own test, the one _prepare_backend makes
        from accelerate.utils.imports import get_distributed_backend, get_torch_accelerator_backend

        device_type, _ = get_torch_accelerator_backend()
        return device_type is None or get_distributed_backend(device_type) is None
    except ImportError:  # older accelerate
        return not torch.cuda.is_available()


def _fsdp_on_cpu(accelerator) -> None:
    """FSDP2 on CPU processes (gloo): what the launcher's FSDP config asked for and accelerate refuses there.

    accelerate turns a launch into DistributedType.FSDP only for device processes (accelerate/state.py
    AcceleratorState.__init__: the FSDP branch sits under `distributed_type in [MULTI_GPU, MULTI_NPU, …]`,
    and a CPU launch is MULTI_CPU), so the config's FSDP settings would silently train under DDP. torch's
    fully_shard itself runs on a CPU device mesh with gloo; this sets the state accelerate would have set
    on GPUs (the plugin built from the launcher's FSDP_* environment), and accelerator.prepare then shards
    through accelerate's own FSDP2 code (fsdp2_prepare_model, activation checkpointing, DCP save/load)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from FSDP_* environment variables, as Accelerator() does
    if plugin.fsdp_version != 2:
        raise AttnkitError("FSDP on CPU processes needs fsdp_version: 2 (torch's fully_shard); "
                           "FSDP1 wraps with CUDA streams (recipes/accelerate/fsdp.yaml is FSDP2)")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def finished_line(out, report: dict) -> str:
    """The last line of a run: where the healed model is and what healing did to the validation perplexity."""
    def ppl(result: dict | None) -> str:
        value = ((result or {}).get("validation") or {}).get("token_perplexity")
        return "?" if value is None else f"{value:.2f}"

    text = report.get("validation_text") or {}
    return (f"attnkit finetune: wrote {out} ({VALIDATION} {ppl(report.get('eval_before'))} -> "
            f"{ppl(report.get('eval_after'))}, {validation_text(text.get('rows'), text.get('seq_len'))})")


# ------------------------------------------------------------------ the run


@dataclass(frozen=True)
class Inputs:
    """The student, OUTPUT_DIR, RUN_DIR and teacher as checked: nothing has been written when one exists."""

    student_path: Path
    config: dict  # the student's config.json
    out: Path  # OUTPUT_DIR, free to write (or to replace, with force)
    run_dir: Path
    latest: Path | None  # the newest complete checkpoint in RUN_DIR: the run resumes from it
    tokenizer: Any
    teacher_name: str | None  # also the quality reference when neither KL nor hidden loss uses it
    teacher_path: Path | None
    teacher_config: dict

    @property
    def trust(self) -> bool:
        return "auto_map" in self.config


@dataclass(frozen=True)
class Data:
    """The rows every process will see, in epoch order, the held-out rows, and what to do with the teacher cache."""

    total_steps: int
    rows_per_step: int  # over all processes and micro-batches
    rows: torch.Tensor  # the distinct training rows [n, L]
    val_rows: torch.Tensor  # [m, L], m a multiple of the process count
    val_distinct: int  # how many of the m rows differ (fewer than m when a short split is repeated)
    dataset: batches.EpochRows
    cache_fp: str | None  # teacher cache: its fingerprint and plan ("build" / reuse), None without one
    cache_plan: str | None


@dataclass(frozen=True)
class Training:
    """The student as `accelerator.prepare` returned it, with what steps it and the gradients it masks."""

    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    params: list  # the trainable parameters after prepare (FSDP2: the sharded DTensors)
    masked: list  # FSDP: (sharded parameter, keep mask) pairs for constant latent channels
    trainable_desc: str
    head: Any = None  # the LM head when the cross-entropy runs over it in chunks (`chunked_head`), else None


def run(recipe: Recipe, config_path: str | None = None) -> dict:
    """Train according to `recipe`, export OUTPUT_DIR, return the finetune report."""
    from accelerate.utils import set_seed

    accelerator, tb_note = make_accelerator(recipe)
    set_seed(recipe.train.seed)
    notes = [tb_note] if tb_note else []
    # Everything that can be refused is checked before anything is written.
    inputs = _check_inputs(accelerator, recipe, config_path)
    data = _plan_data(accelerator, recipe, inputs, notes)
    sharded = _check_sharding(accelerator, recipe, notes)

    teacher, cache = _teacher_or_cache(accelerator, recipe, inputs, data, notes)
    training = _build_student(accelerator, recipe, inputs, data, notes)
    log = _open_run_dir(accelerator, recipe, inputs.run_dir)
    evaluate = Evaluator(accelerator, recipe, training.model, inputs.tokenizer, data.val_rows, sharded, notes,
                         training.head)
    trainer_state = _first_state(accelerator, recipe, inputs.latest, evaluate, teacher, cache, data.val_rows, log)
    if recipe.loss.kl_weight == 0 and recipe.loss.hidden_weight == 0:
        teacher = None  # named only as the quality reference; free it for training
    data_iter = _resume(accelerator, recipe, inputs.latest, training.loader, trainer_state["step"], log)
    began = _train(accelerator, recipe, training, data, teacher, cache, data_iter, trainer_state, log, evaluate,
                   inputs.run_dir)
    report = _report(accelerator, recipe, config_path, inputs, data, training, trainer_state, evaluate, log, began,
                     notes)
    _export(accelerator, recipe, inputs, training.model, sharded, report, log)
    return report


def _check_inputs(accelerator, recipe: Recipe, config_path: str | None) -> Inputs:
    """Resolve the student and the teacher and refuse what cannot work (a missing model, OUTPUT_DIR over an
    input, a foreign RUN_DIR, a teacher with another tokenizer or the student's own weights) before the data
    is read and before anything is written."""
    student_path = models.resolve_student(recipe.model, config_path)
    config = check_causal_lm(student_path)
    trust = "auto_map" in config
    out = check_output_dir(recipe.output_dir, recipe.force, (student_path,))
    run_dir = recipe.resolved_run_dir
    if run_dir.resolve() == out.resolve():
        raise AttnkitError("recipe key run_dir: must differ from output_dir")
    latest = state.open_run_dir(run_dir, recipe.fingerprint(), accelerator.num_processes, accelerator.is_main_process)
    tokenizer = models.load_tokenizer(student_path, trust)
    teacher_name = teacher_spec(recipe, student_path) if recipe.teacher else None  # also the retention reference
    teacher_path, teacher_config = check_teacher(teacher_name, tokenizer, config.get("vocab_size"))
    if teacher_path is not None:
        check_output_dir(recipe.output_dir, recipe.force, (teacher_path,), what="the teacher")  # force would replace it
        if same_weights(teacher_path, student_path) and not recipe.teacher_is_student_ok:
            raise AttnkitError(f"teacher {teacher_name} has the student's own weights: distilling from it teaches "
                               "nothing (set teacher_is_student_ok=true to do it anyway)")
    if recipe.loss.hidden_weight > 0:
        check_same_depth(teacher_name, teacher_config, config)
    return Inputs(student_path, config, out, run_dir, latest, tokenizer, teacher_name, teacher_path, teacher_config)


def _plan_data(accelerator, recipe: Recipe, inputs: Inputs, notes: list) -> Data:
    """Read and pack the training and validation rows, and refuse too little data or a stale teacher cache
    (its fingerprint covers the rows each step will see) while nothing is written yet."""
    world = accelerator.num_processes
    total_steps, rows_per_step = batches.plan_steps(recipe.data, recipe.train, world)
    rows = batches.load_train_rows(inputs.tokenizer, recipe.data, total_steps * rows_per_step)
    batches.check_enough(rows, rows_per_step, recipe.data.source)
    if len(rows) < total_steps * rows_per_step:
        notes.append(f"data: {len(rows)} distinct rows for {total_steps * rows_per_step} rows seen (several epochs)")
    val_rows = pack_tokens(inputs.tokenizer, recipe.data.source, "validation", recipe.data.seq_len,
                           recipe.data.val_tokens, 0)
    val_distinct = len(val_rows)
    if 0 < val_distinct < world:
        notes.append(f"validation: {val_distinct} held-out row(s) for {world} processes, repeated so that each "
                     "process scores as many (the mean loss is unchanged)")
    val_rows = batches.even_validation_rows(val_rows, world)
    dataset = batches.EpochRows(rows, total_steps * rows_per_step, recipe.data.seed)
    cache_cfg, cache_fp, cache_plan = recipe.teacher_cache, None, None
    if cache_cfg is not None and inputs.teacher_path is not None:  # refuse a stale cache before anything is written
        cache_fp = teacher_cache.fingerprint(
            inputs.teacher_path, inputs.tokenizer, inputs.config.get("vocab_size"), recipe.data, rows,
            dataset.used_rows(), recipe.loss.temperature, cache_cfg.top_k, cache_cfg.dtype,
        )
        cache_plan = teacher_cache.plan(Path(cache_cfg.dir), cache_fp, cache_cfg.rebuild)
    return Data(total_steps, rows_per_step, rows, val_rows, val_distinct, dataset, cache_fp, cache_plan)


def _check_sharding(accelerator, recipe: Recipe, notes: list) -> bool:
    """The last refusal (LoRA under FSDP/DeepSpeed); returns whether the student is sharded over the processes."""
    sharded = _is_sharded(accelerator)
    if sharded and recipe.train.trainable == "lora":
        raise AttnkitError("train.trainable: lora under FSDP/DeepSpeed is not supported; use DDP (recipes/accelerate/ddp.yaml)")
    if sharded and recipe.eval.tasks:
        notes.append("eval tasks skipped: they run on one process and need an unsharded model (FSDP/DeepSpeed)")
    return sharded


def _teacher_or_cache(accelerator, recipe: Recipe, inputs: Inputs, data: Data, notes: list):
    """The teacher in memory (under FSDP its decoder layers sharded like the student's), or, with a teacher
    cache, its targets on disk: (teacher, None) or (None, cache). Both None without a teacher."""
    if data.cache_plan is None:
        hold = recipe.train.frozen_dtype == "checkpoint"
        if inputs.teacher_path is None or not _is_fsdp(accelerator):
            return load_teacher(inputs.teacher_path, inputs.teacher_config, accelerator.device, hold), None
        teacher, layers = load_fsdp_teacher(inputs.teacher_path, inputs.teacher_config, accelerator, hold)
        notes.append(f"teacher: {layers} decoder layers sharded over {accelerator.num_processes} processes (FSDP)"
                     if layers else "teacher: replicated on every process (no decoder-layer class to shard by)")
        return teacher, None
    # the teacher runs once (main process, while the others wait), then never again
    cache, cache_note = _open_cache(accelerator, recipe, data.cache_plan, data.cache_fp, data.rows,
                                    data.dataset.used_rows(), data.val_rows, inputs.teacher_path,
                                    inputs.teacher_config, data.total_steps)
    notes.append(cache_note)
    return None, cache


def _build_student(accelerator, recipe: Recipe, inputs: Inputs, data: Data, notes: list) -> Training:
    """Load the student, choose what trains (or wrap it in LoRA), build AdamW, the LR schedule and the data
    loader, and hand all four to `accelerator.prepare` (DDP/FSDP/DeepSpeed wrapping, data sharding)."""
    t = recipe.train
    model, channels, fill_after = _load_student(accelerator, inputs)
    if t.trainable == "lora":
        model = trainable.apply_lora(model, t.lora)
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": t.lr}]
    else:
        chosen = trainable.select_trainable(model, t.trainable, t.patterns)
        groups = trainable.param_groups(model, chosen, t.lr, t.rest_lr)
    protected = trainable.protect_constant_channels(model, channels)
    if protected:
        notes.append(f"{protected} constant MLA latent channel(s) kept frozen (their gradients are zeroed)")
    _hold_frozen(accelerator, t, inputs.student_path, model, fill_after, notes)
    masks = trainable.grad_masks(model)  # by name: FSDP replaces the parameters their hooks are on
    trainable_desc = trainable.describe(model)
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = build_scheduler(optimizer, data.total_steps, t.warmup_steps, t.schedule, t.min_lr_ratio,
                                t.decay_fraction)
    loader = batches.train_loader(data.dataset, t.per_device_batch_size)
    split = sharded_load.vocab_tables(model, accelerator) if fill_after else []
    with sharded_load.shards_only(accelerator, split) if fill_after else contextlib.nullcontext():
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if fill_after:
        sharded_load.fill_prepared(model, inputs.student_path, sharded_load.shard_device(accelerator))
    if split:
        tables = len({id(module.weight) for module in split})  # tied: one table, two modules
        notes.append(f"{tables} frozen embedding table(s) split by vocabulary rows over the processes in 16 bits, "
                     "never gathered (FSDP would gather each in fp32 at every step)")
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP2: the sharded parameters (DTensors)
    masked = trainable.sharded_grad_masks(model, masks) if _is_fsdp(accelerator) else []
    head = _chunked_head(accelerator, recipe, model, notes)
    return Training(model, optimizer, scheduler, loader, params, masked, trainable_desc, head)


def _chunked_head(accelerator, recipe: Recipe, model, notes: list):
    """The student's LM head when its loss needs no whole logits (cross-entropy without KL) and the model's
    logits are its head's output (`chunked_head.matches`, on a few positions): the cross-entropy then runs
    the head a chunk of positions at a time (`train.chunked_head: false` keeps the whole logits). Under FSDP
    a head split by vocabulary rows (`sharded_load.vocab_tables`) computes its block of the loss on each
    process, a head FSDP shards is used as the model's forward left it gathered; not under DeepSpeed, whose engine
    gathers ZeRO-3 partitions inside its own forward only."""
    from accelerate.utils import DistributedType

    loss = recipe.loss
    if (not recipe.train.chunked_head or loss.ce_weight == 0 or loss.kl_weight > 0 or chunked_head.head_of(model) is None
            or accelerator.distributed_type == DistributedType.DEEPSPEED):
        return None
    head = chunked_head.checked_head(model, accelerator.device)
    notes.append("cross-entropy run over the LM head in chunks of positions (no whole logits)" if head is not None
                 else "cross-entropy over whole logits: the model's logits are not its LM head's output")
    return head



def _hold_frozen(accelerator, t, student_path: Path, model, sharded_later: bool, notes: list) -> None:
    """The student's frozen parameters back in the checkpoint's 16-bit dtype, computed in fp32 (the same
    training bit for bit, half their bytes): on one process or DDP through `frozen.hold_frozen`; under FSDP
    on the meta model before its shards are made (FSDP gathers them in fp32, `sharded_load.shards_only`).
    Not under DeepSpeed, which holds the parameters itself, nor with FSDP's whole-model loading fallback,
    nor LoRA, whose merge would round in 16 bits, nor with `train.frozen_dtype: fp32`."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if t.frozen_dtype == "fp32" or t.trainable == "lora" or kind == DistributedType.DEEPSPEED or (kind == DistributedType.FSDP and not sharded_later):
        return
    dtype = frozen.storage_dtype(student_path)
    if dtype == torch.float32:
        return
    cast = frozen.cast_frozen(model, dtype) if sharded_later else frozen.hold_frozen(model, dtype)
    if cast:
        notes.append(f"{cast} frozen parameter tensor(s) held in {str(dtype).removeprefix('torch.')} "
                     "(the checkpoint's dtype), computed in fp32")


def _load_student(accelerator, inputs: Inputs) -> tuple[Any, dict[str, list[int]] | None, bool]:
    """(the student, its constant latent channels when found without its weights, whether its shards are
    filled after `accelerator.prepare`). Under FSDP every process builds it on the meta device and reads its
    own shards after preparation (`sharded_load`); when the checkpoint's names are not the model's, with
    `fsdp_cpu_ram_efficient_loading` only the main process reads it (accelerate broadcasts its weights) and
    the others take the channels it found."""
    from accelerate.utils import broadcast_object_list

    plugin = accelerator.state.fsdp_plugin if _is_fsdp(accelerator) else None
    empty = sharded_load.empty_student(inputs.student_path, inputs.trust) if plugin is not None else None
    if empty is not None:
        return *empty, True
    if plugin is None or not plugin.cpu_ram_efficient_loading:
        return models.load_causal_lm(inputs.student_path, inputs.trust), None, False
    if accelerator.is_main_process:
        model = models.load_causal_lm(inputs.student_path, inputs.trust)
        found = [trainable.constant_channel_map(model)]
    else:
        model, found = sharded_load.empty_causal_lm(inputs.student_path, inputs.trust), [None]
    return model, broadcast_object_list(found, from_process=0)[0], False


def _open_run_dir(accelerator, recipe: Recipe, run_dir: Path) -> RunLog:
    """The first write: RUN_DIR stamped with this run (main process; the others wait), then the run's log."""
    if accelerator.is_main_process:
        state.claim_run_dir(run_dir, recipe.fingerprint(), accelerator.num_processes)
    accelerator.wait_for_everyone()
    if accelerator.log_with:
        accelerator.init_trackers("tensorboard")
    return RunLog(run_dir / "log.jsonl", accelerator)


@dataclass(frozen=True)
class Evaluator:
    """The student's validation loss on the held-out rows (all processes), and the eval tasks (main process,
    unsharded models only) when asked: the same measure before, during and after training."""

    accelerator: Any
    recipe: Recipe
    model: Any
    tokenizer: Any
    val_rows: torch.Tensor
    sharded: bool
    notes: list  # a task's note is added once
    head: Any = None  # the LM head the cross-entropy runs over in chunks (`chunked_head`), else None

    def __call__(self, tasks: bool) -> dict:
        accelerator, recipe = self.accelerator, self.recipe
        total, count = measure.validation_loss(self.model, self.val_rows, recipe.train.per_device_batch_size,
                                               accelerator.device, accelerator.process_index,
                                               accelerator.num_processes, self.head)
        result = {"validation": measure.reduce_loss(accelerator, total, count)}
        if tasks and recipe.eval.tasks and not self.sharded:
            if accelerator.is_main_process:
                found, note = measure.eval_tasks(accelerator.unwrap_model(self.model), self.tokenizer,
                                                 recipe.eval.tasks, recipe.eval.limit)
                if note and note not in self.notes:
                    self.notes.append(note)
                if found:
                    result.update(found.get("metrics", found))
            accelerator.wait_for_everyone()
        return result


def _first_state(accelerator, recipe: Recipe, latest: Path | None, evaluate: Evaluator, teacher, cache,
                 val_rows: torch.Tensor, log: RunLog) -> dict:
    """The trainer state to start from: the checkpoint's when resuming, else step 0 with the student's
    evaluation before training and the teacher's validation loss (the target it heals toward)."""
    trainer_state = {"step": 0, "tokens_seen": 0, "loss_curve": [], "eval_curve": [], "eval_before": None, "seconds": 0.0}
    if latest is not None:
        return state.read_trainer_state(latest)
    trainer_state["eval_before"] = evaluate(tasks=True)
    if teacher is not None:  # the target the student heals toward, on the same held-out rows
        head = chunked_head.checked_head(teacher, accelerator.device) if recipe.train.chunked_head else None
        total, count = measure.validation_loss(
            teacher, val_rows, recipe.train.per_device_batch_size, accelerator.device, accelerator.process_index,
            accelerator.num_processes, head,
        )
        trainer_state["eval_teacher"] = {"validation": measure.reduce_loss(accelerator, total, count)}
    elif cache is not None:  # measured when the cache was built, on the same rows if they match
        trainer_state["eval_teacher"] = cache.teacher_validation(teacher_cache.rows_digest(val_rows))
    log.write({"event": "eval", "step": 0, **_flat(trainer_state["eval_before"])})
    return trainer_state


def _resume(accelerator, recipe: Recipe, latest: Path | None, loader, start: int, log: RunLog):
    """The batches from step `start` on, and, when resuming, the checkpoint's model, optimizer, scheduler
    and RNG states restored after the loader drew its seed, so the run continues bit for bit."""
    data_iter = _started(accelerator.skip_first_batches(loader, start * recipe.train.grad_accum))
    if latest is not None:  # after the loader drew its seed, so the restored RNG continues exactly
        state.restore(accelerator, latest)
        log.write({"event": "resume", "from": str(latest), "step": start})
    return data_iter


def _train(accelerator, recipe: Recipe, training: Training, data: Data, teacher, cache, data_iter,
           trainer_state: dict, log: RunLog, evaluate: Evaluator, run_dir: Path) -> float:
    """The optimizer steps from the trainer state's step to the last, with the loss logged every
    `log.every`, the validation loss every `eval.every` and a checkpoint every `checkpoint.every` steps.
    Updates `trainer_state`; returns the perf_counter the run's seconds count from (resumes included)."""
    start, total_steps = trainer_state["step"], data.total_steps
    tokens_per_step = data.rows_per_step * recipe.data.seq_len
    progress = _progress(accelerator.is_main_process, start, total_steps)
    training.model.train()
    began = time.perf_counter() - trainer_state["seconds"]
    window_start, window_tokens = time.perf_counter(), 0
    for step in range(start, total_steps):
        parts = _step(accelerator, recipe, training, teacher, cache, data_iter, step, total_steps, progress)
        trainer_state["step"] = step + 1
        trainer_state["tokens_seen"] += tokens_per_step
        window_tokens += tokens_per_step
        done = step + 1
        if done % recipe.log.every == 0 or done == total_steps:
            rate = window_tokens / max(1e-9, time.perf_counter() - window_start)
            window_start, window_tokens = time.perf_counter(), 0
            entry = {"step": done, "tokens": trainer_state["tokens_seen"], "lr": training.scheduler.get_last_lr()[0],
                     "tokens_per_s": round(rate, 1), **parts}
            trainer_state["loss_curve"].append([done, round(parts["loss"], 6)])
            log.write(entry)
            if progress is not None:
                progress.set_postfix(loss=f"{parts['loss']:.4f}", tok_s=f"{rate:,.0f}")
        if recipe.eval.every and done % recipe.eval.every == 0 and done < total_steps:
            result = evaluate(tasks=recipe.eval.tasks_periodic)
            trainer_state["eval_curve"].append([done, trainer_state["tokens_seen"], result["validation"]["loss"]])
            log.write({"event": "eval", "step": done, **_flat(result)})
        if recipe.checkpoint.every and done % recipe.checkpoint.every == 0 and done < total_steps:
            trainer_state["seconds"] = time.perf_counter() - began
            state.save_checkpoint(accelerator, run_dir, done, trainer_state, recipe.checkpoint.keep)
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    return began


def _step(accelerator, recipe: Recipe, training: Training, teacher, cache, data_iter, step: int, total_steps: int,
          progress) -> dict:
    """One optimizer step after telling step-scheduled modules the step; on a refusal (divergence) the
    progress bar closes first, so its last line comes before the error's, not after it."""
    broadcast_step(training.model, step, total_steps)
    if teacher is not None:
        broadcast_step(teacher, step, total_steps)
    try:
        return _optimizer_step(accelerator, training.model, teacher, cache, data_iter, training.optimizer,
                               training.scheduler, training.params, recipe, step, training.masked, training.head)
    except AttnkitError:
        if progress is not None:  # the bar's last line before the error's, not after it
            progress.close()
        raise


def _report(accelerator, recipe: Recipe, config_path: str | None, inputs: Inputs, data: Data, training: Training,
            trainer_state: dict, evaluate: Evaluator, log: RunLog, began: float, notes: list) -> dict:
    """The student's evaluation after training (logged, and the eval curve's last point) and the finetune
    report: the recipe, what was trained on how many tokens, the curves and the evaluations."""
    total_steps = data.total_steps
    eval_after = evaluate(tasks=True)
    log.write({"event": "eval", "step": total_steps, **_flat(eval_after)})
    trainer_state["eval_curve"].append([total_steps, trainer_state["tokens_seen"], eval_after["validation"]["loss"]])
    return {
        "attnkit_version": __version__,
        "recipe": {"config": str(config_path) if config_path else None, **recipe.to_dict()},
        "base_model": recipe.model,
        "base_model_path": str(inputs.student_path),
        "teacher": inputs.teacher_name,
        "teacher_path": str(inputs.teacher_path) if inputs.teacher_path else None,
        "tokens_seen": trainer_state["tokens_seen"],
        "steps": total_steps,
        "processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "seconds": round(time.perf_counter() - began, 1),
        "loss_curve": trainer_state["loss_curve"],
        "eval_curve": trainer_state["eval_curve"],
        "eval_before": trainer_state["eval_before"],
        "eval_after": eval_after,
        "validation_text": {"rows": data.val_distinct, "seq_len": recipe.data.seq_len},  # what validation ppl is on
        "eval_teacher": trainer_state.get("eval_teacher"),
        "trainable": f"{recipe.train.trainable}: {training.trainable_desc}",
        "load": {"trust_remote_code": inputs.trust},
        "notes": notes,
    }


def _export(accelerator, recipe: Recipe, inputs: Inputs, model, sharded: bool, report: dict, log: RunLog) -> None:
    """Write OUTPUT_DIR on the main process: the healed model (LoRA merged if asked; gathered first under
    FSDP/DeepSpeed, a collective every process joins), its tokenizer and the report; then end the run."""
    accelerator.wait_for_everyone()
    dtype = input_dtype(inputs.config)
    if _is_fsdp(accelerator):  # gathered one tensor at a time as it is written (a collective per tensor)
        full_state = gathered_tensors(accelerator.unwrap_model(model), dtype)
    else:  # DeepSpeed: gathered whole on the main process (a collective call)
        full_state = accelerator.get_state_dict(model) if sharded else None
    if accelerator.is_main_process:
        healed = final_model(accelerator.unwrap_model(model), recipe.train.lora.merge)
        save_healed(healed, inputs.tokenizer, inputs.student_path, inputs.out, recipe.force, dtype, report, full_state)
        log.write({"event": "saved", "output_dir": str(inputs.out)})
        print(finished_line(recipe.output_dir, report), flush=True)
    elif _is_fsdp(accelerator):
        for _ in full_state:  # the main process's gathers need every process
            pass
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _open_cache(accelerator, recipe, plan, fp, rows, used, val_rows, teacher_path, teacher_config, total_steps):
    """Build the teacher cache on the main process if needed (others wait), then open it everywhere."""
    folder = Path(recipe.teacher_cache.dir)
    accelerator.wait_for_everyone()  # every process has checked the folder before it changes
    with accelerator.main_process_first():
        if accelerator.is_main_process and plan == "build":
            teacher = load_teacher(teacher_path, teacher_config, accelerator.device)
            if broadcast_step(teacher, 0, total_steps):
                raise AttnkitError("teacher_cache: the teacher has step-scheduled modules; its logits cannot be cached")
            began = time.perf_counter()
            teacher_cache.build(
                folder, teacher, rows, used, fp, batch_size=recipe.train.per_device_batch_size,
                device=accelerator.device, autocast=accelerator.autocast, chunked=recipe.train.chunked_head,
                val=(val_rows, teacher_cache.rows_digest(val_rows)),
            )
            note = f"teacher cache built in {folder} ({time.perf_counter() - began:.1f} s)"
            del teacher
        else:
            note = f"teacher targets read from the cache {folder}"
        cache = teacher_cache.TeacherCache(folder)
    if cache.manifest["fingerprint"] != fp:  # another run replaced it meanwhile
        raise AttnkitError(f"teacher cache {folder} changed while this run started; rerun")
    return cache, note


def _optimizer_step(accelerator, model, teacher, cache, data_iter, optimizer, scheduler, params, recipe,
                    step: int, masked=(), head=None) -> dict:
    """`grad_accum` micro-batches → one clipped AdamW step; returns the mean loss parts (all processes).
    With `head`, the student's forward stops before its LM head and the cross-entropy runs it in chunks.
    A non-finite loss or gradient norm stops the run before the step is taken (on every process: the
    check reads the all-reduced values): continuing would only train on NaN and write a broken model."""
    accum, loss_cfg = recipe.train.grad_accum, recipe.loss
    want_hidden, want_logits = loss_cfg.hidden_weight > 0, loss_cfg.kl_weight > 0
    # without KL only the teacher's layer outputs are needed: skip its LM head ([b, L, V] logits)
    t_model = None if teacher is None else teacher if want_logits else teacher.base_model
    sums: dict[str, float] = {}
    for micro in range(accum):
        batch = next(data_iter)  # {"input_ids": [b, L], "row": [b]} on this process's device
        ids = batch["input_ids"]
        sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(model)
        with sync:
            with frozen.saved_in_low_precision(), chunked_head.final_hidden(head) as kept:  # frozen 16-bit weights re-upcast
                out = model(input_ids=ids, use_cache=False, output_hidden_states=want_hidden)  # logits [b, L or 0, V]
            ce = None if head is None else chunked_head.next_token_ce(kept.hidden, ids, head, chunked_head.softcap_of(model))
            target, hidden = None, None
            if t_model is not None:
                with torch.no_grad(), accelerator.autocast():
                    t_out = t_model(input_ids=ids, use_cache=False, output_hidden_states=want_hidden)
                target = t_out.logits if want_logits else None
                if want_hidden:  # layer outputs; [0] is the shared embedding, equal in both
                    hidden = (out.hidden_states[1:], t_out.hidden_states[1:])
            elif cache is not None and want_logits:  # this process's rows only
                target = cache.targets(batch["row"].cpu()).to(ids.device)
            loss, parts = heal_loss(
                out.logits, ids, target, loss_cfg.ce_weight, loss_cfg.kl_weight, loss_cfg.temperature,
                loss_cfg.hidden_weight, hidden, ce,
            )
            accelerator.backward(loss / accum)
        parts["loss"] = float(loss.detach())
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v / accum
    for param, keep in masked:  # FSDP: constant latent channels, zeroed in the sharded gradients
        if param.grad is not None:
            param.grad.mul_(keep)
    if recipe.train.max_grad_norm > 0:
        norm = accelerator.clip_grad_norm_(params, recipe.train.max_grad_norm)
        if norm is not None:  # DeepSpeed clips inside its engine and returns None
            sums["grad_norm"] = float(norm)
    keys = sorted(sums)
    mean = accelerator.reduce(torch.tensor([sums[k] for k in keys], device=accelerator.device), reduction="mean")
    parts = {k: float(v) for k, v in zip(keys, mean.tolist())}
    bad = [f"{k} {v}" for k, v in parts.items() if not math.isfinite(v)]
    if bad:
        raise AttnkitError(f"training diverged at step {step + 1}: {', '.join(bad)}; nothing written to "
                           f"{recipe.output_dir} (lower train.lr, now {recipe.train.lr:g}, or train.max_grad_norm)")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return parts


def _is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def _is_sharded(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def _started(loader):
    """Iterate `loader` with its first batch already fetched: starting a DataLoader iterator draws
    from the global torch RNG, which must happen before (not after) a resume restores that RNG."""
    it = iter(loader)
    return itertools.chain([next(it)], it)


def _progress(main_proc: bool, start: int, total: int):
    if not main_proc:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="finetune", unit="step", dynamic_ncols=True)


def _flat(result: dict) -> dict:
    """{'validation': {'loss': x}} → {'validation/loss': x} for log lines and trackers."""
    flat = {}
    for task, metrics in result.items():
        if isinstance(metrics, dict):
            flat.update({f"{task}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
    return flat


class RunLog:
    """JSONL on the main process, mirrored to accelerate's trackers (TensorBoard) when enabled."""

    def __init__(self, path: Path, accelerator):
        self.path, self.accelerator = path, accelerator

    def write(self, entry: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **entry}) + "\n")
        numbers = {k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self.accelerator.log_with and numbers and "step" in entry:
            self.accelerator.log(numbers, step=int(entry["step"]))
