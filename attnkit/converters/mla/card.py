"""What the model card says that only MLA knows (`Method.card`, read by attnkit/card/hooks.py): where a
DeepSeek-V3 output serves, what fine-tuning an output with an MLA part takes, and the parameter table of
a composite's MLA step. Asked about every card: it speaks only when the folder has an MLA part."""

from __future__ import annotations

from attnkit.card.hooks import MethodSections


def mla_target(convert: dict) -> dict:
    """The MLA target form of this output (`mla+dex` keeps its MLA report under `mla`); {} when unknown."""
    target = convert.get("target") or ((convert.get("mla") or {}).get("target")) or {}
    return target if isinstance(target, dict) else {}


def serving_note(convert: dict) -> str:
    """Where a DeepSeek-V3 output runs, from the conversion report's target form."""
    load = convert.get("load") or {}
    if mla_target(convert).get("form") == "engines":
        text = ("Serving: a dense DeepSeek-V3 (MLA) checkpoint in attnkit's **engine form** — no attention biases, "
                "RoPE in the interleaved layout on a plain θ ladder (written as `yarn` with factor 1.0, as DeepSeek "
                "writes RoPE), `q_lora_rank` set, an explicit LM head — within what llama.cpp (`deepseek2`), vLLM and "
                "SGLang implement (attnkit's docs/serving.md cites their code; the checks are "
                "`benchmarks/engines/llama_cpp.py` and `benchmarks/engines/vllm_cpu.py`). The "
                "latent RMSNorm has no bias to make it exact: its one-shot error is the `native` step above, and "
                "healing recovers it.")
    else:
        factors = " and `longrope` frequency factors" if load.get("rope_frequencies") == "exact" else ""
        text = ("Serving: **transformers only**. This checkpoint carries attention biases (a constant latent channel "
                f"that makes the latent RMSNorm exact){factors}, which vLLM and SGLang would drop silently; its "
                "`architectures` name is one they and llama.cpp do not know, so they refuse it (transformers builds "
                "it from `model_type`). Convert with the default `--target engines` to serve it elsewhere.")
    serving = convert.get("serving") or {}
    if serving:
        text += "\n\n" + "\n".join(f"- {engine}: {verdict}" for engine, verdict in serving.items())
    return text


def finetune_note(convert: dict, plain_mla: bool) -> str | None:
    """What fine-tuning it safely takes, for outputs with an MLA part (None for others)."""
    target = mla_target(convert)
    if not (plain_mla or isinstance(convert.get("mla"), dict)):  # `mla+…` reports carry their MLA step's section
        return None
    constant = target.get("constant_channel", target.get("form") != "engines")
    if constant:
        return ("**Fine-tuning: keep `kv_b_proj` frozen.** One latent channel is a huge constant (≈ 10⁵, from a "
                "`kv_a_proj_with_mqa` bias over a zero weight row) that makes the latent RMSNorm exact; Adam moves the "
                "`kv_b_proj` column that reads it by ≈ lr per step, which shifts every key and value: one step of plain "
                "PEFT LoRA or full fine-tuning on attention raised the loss by +346 % (attnkit docs/serving.md). Train with "
                "`kv_b_proj` (and that channel's row of `kv_a_proj_with_mqa` / `kv_a_layernorm`) frozen, or heal with "
                "`attnkit finetune`, which freezes exactly that channel.")
    if plain_mla:
        return ("Fine-tuning: no constant latent channel, so plain PEFT LoRA and full fine-tuning are safe on it "
                "(measured: one AdamW step changes the loss as it does on the source model; attnkit docs/serving.md, "
                "docs/finetune.md).")
    return None


def card_sections(reports: dict[str, dict | None]) -> MethodSections:
    """MLA's part of a card: a DeepSeek-V3 config (a plain MLA output) or an `mla` section in the
    conversion report (`mla+dex`, `mla+titans`) says the folder has an MLA part."""
    convert = reports.get("convert") or {}
    plain_mla = (reports.get("config") or {}).get("model_type") == "deepseek_v3"
    notes = [serving_note(convert)] if plain_mla else []
    note = finetune_note(convert, plain_mla)
    if note:
        notes.append(note)
    step = convert.get("mla") or {}
    params = (step["params"], " (its MLA step)") if isinstance(step.get("params"), dict) else None
    return MethodSections(params=params, usage_notes=notes)
