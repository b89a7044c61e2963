"""The model card written from attnkit's reports (no model needed: reports are hand-written here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import ModelCard

from attnkit.errors import AttnkitError
from attnkit.io.model_card import GENERATED_MARKER, write_model_card

CONVERT = {
    "attnkit_version": "0.1.0",
    "method": "mla",
    "source": {"model": "Qwen/Qwen2.5-0.5B", "path": "/hf/qwen", "model_type": "qwen2", "sha256_config": "ab" * 32},
    "settings": {"kv_lora_rank": 128, "rope_dim": 32, "rope_method": "rorope", "calib_tokens": 65536},
    "kv_cache_bytes_per_token": {"before": 12288, "after": 3840},
    "steps": [{"name": "exact_rewrite", "exact": True, "logits_rel_err_max": 2.5e-7},
              {"name": "lowrank", "exact": False, "kl": 0.031, "ppl": 14.2}],
    "ppl": {"before": 12.9, "after": 14.2},
    "load": {"trust_remote_code": False, "rope_frequencies": "geometric"},
}
FINETUNE = {
    "attnkit_version": "0.1.0",
    "recipe": {"config": "recipes/heal-mla.yaml", "lr": 1e-4},
    "base_model": "out/qwen-mla", "teacher": "Qwen/Qwen2.5-0.5B", "tokens_seen": 2_000_000, "steps": 500,
    "loss_curve": [[10, 3.25], [500, 2.5]],
    "eval_before": {"validation": {"loss": 2.9, "token_perplexity": 18.2}, "attnkit-complete": {"acc": 0.41}},
    "eval_after": {"validation": {"loss": 2.6, "token_perplexity": 13.5}, "attnkit-complete": {"acc": 0.47}},
    "trainable": "attention: 1.2M of 494M parameters (0.24 %)",
    "load": {"trust_remote_code": False},
}


def _folder(tmp_path: Path, **files) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    for name, data in files.items():
        (folder / name.replace("__", ".")).write_text(json.dumps(data))
    return folder


def _meta(path: Path) -> dict:
    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_convert_card_metadata_and_body(tmp_path):
    folder = _folder(tmp_path, attnkit_report__json=CONVERT, config__json={"model_type": "deepseek_v3"})
    path = write_model_card(folder)
    meta = _meta(path)
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B"
    assert meta["base_model_relation"] == "finetune"
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["attnkit", "mla", "deepseek_v3"]
    assert "model-index" not in meta  # nothing evaluated, nothing claimed
    body = path.read_text()
    assert "| 12288 | 3840 | 31.2% |" in body
    assert "| kv_lora_rank | 128 |" in body
    assert "| exact_rewrite | yes |" in body
    assert "12.9 before → 14.2 after" in body
    assert "trust_remote_code" not in body.split("## How to load")[1].split("```")[1]
    assert "**transformers only**" in body and "llama.cpp refuses" in body  # a report without an engine form
    assert GENERATED_MARKER in body


def test_engine_form_card_names_the_engines(tmp_path):
    convert = dict(CONVERT, target={"form": "engines"}, load={"trust_remote_code": False, "rope_frequencies": "ladder"})
    body = write_model_card(_folder(tmp_path, attnkit_report__json=convert, config__json={"model_type": "deepseek_v3"})).read_text()
    assert "**engine form**" in body and "vLLM" in body and "PEFT LoRA and full fine-tuning are safe" in body
    assert "transformers only" not in body


def test_local_source_is_not_a_base_model(tmp_path):
    local = dict(CONVERT, source=dict(CONVERT["source"], model=str(tmp_path)))
    for source in (local, dict(CONVERT, source=dict(CONVERT["source"], model="reference"))):
        folder = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "attnkit_report.json").write_text(json.dumps(source))
        meta = _meta(write_model_card(folder))
        assert "base_model" not in meta and "base_model_relation" not in meta  # the Hub only takes Hub ids


def test_dex_with_remote_code(tmp_path):
    dex = dict(CONVERT, method="mla+dex", load={"trust_remote_code": True})
    config = {"model_type": "attnkit_dex", "auto_map": {"AutoModelForCausalLM": "modeling_attnkit.DexForCausalLM"}}
    path = write_model_card(_folder(tmp_path, attnkit_report__json=dex, config__json=config))
    assert _meta(path)["tags"] == ["attnkit", "mla", "dex", "attnkit_dex"]
    assert "trust_remote_code=True)" in path.read_text()


def test_method_specific_extras_are_kept(tmp_path):
    dex = dict(CONVERT, method="dex", heads={"rule": "auto", "selected": [[1, 3], [0, 2]]}, lambda_init=[0.2, 0.3555])
    body = write_model_card(_folder(tmp_path, attnkit_report__json=dex)).read_text()
    block = body.split("Method-specific details (attnkit_report.json)</summary>")[1].split("```json")[1].split("```")[0]
    assert json.loads(block) == {"heads": {"rule": "auto", "selected": [[1, 3], [0, 2]]}, "lambda_init": [0.2, 0.3555]}


def test_healed_card_takes_index_from_the_trainer_when_no_eval_file(tmp_path):
    folder = _folder(tmp_path, attnkit_report__json=CONVERT, finetune_report__json=FINETUNE)
    path = write_model_card(folder)
    meta = _meta(path)
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B"
    results = meta["model-index"][0]["results"]
    assert [(r["dataset"]["type"], m["type"], m["value"]) for r in results for m in r["metrics"]] == [("attnkit-complete", "acc", 0.47)]
    body = path.read_text()
    assert "## Healing (fine-tune)" in body
    assert "| validation/token_perplexity | 18.2 | 13.5 |" in body
    assert "| loss first → last | 3.25 → 2.5 |" in body
    assert "| tokens seen | 2000000 |" in body


def test_eval_file_wins_and_round_trips_through_huggingface_hub(tmp_path):
    eval_results = {
        "schema": "attnkit.eval/v1", "tasks": ["attnkit-ppl", "attnkit-recall-512"],
        "models": {"model": {"name": "m", "metrics": {"attnkit-ppl": {"token_perplexity": 13.5, "bits_per_byte": 0.71},
                                                      "attnkit-recall-512": {"acc": 0.9},
                                                      "attnkit-recall-1024": {"acc": float("nan")}}},
                   "baseline": {"name": "Qwen/Qwen2.5-0.5B", "metrics": {"attnkit-ppl": {"token_perplexity": 12.9}}}},
        "retention": {"attnkit-ppl/token_perplexity": 0.955},
    }
    folder = _folder(tmp_path, finetune_report__json=FINETUNE, eval_results__json=eval_results)
    path = write_model_card(folder, repo_id="alice/qwen-mla")
    card = ModelCard.load(path)
    got = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert got == {("attnkit-ppl", "token_perplexity"): 13.5, ("attnkit-ppl", "bits_per_byte"): 0.71, ("attnkit-recall-512", "acc"): 0.9}
    assert card.data.model_name == "qwen-mla"
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B"  # the trainer's teacher
    assert "| attnkit-ppl | token_perplexity | 13.5 | 12.9 | 0.955 |" in card.text
    assert "| attnkit-recall-512 | acc | 0.9 | – | – |" in card.text
    assert 'from_pretrained("alice/qwen-mla")' in card.text


def test_hand_written_card_is_kept_generated_one_refreshed(tmp_path):
    folder = _folder(tmp_path, attnkit_report__json=CONVERT)
    first = write_model_card(folder).read_text()
    (folder / "eval_results.json").write_text(json.dumps({"models": {"model": {"metrics": {"attnkit-complete": {"acc": 0.5}}}}}))
    second = write_model_card(folder).read_text()
    assert second != first and "model-index" in second
    (folder / "README.md").write_text("# mine\n")
    assert write_model_card(folder).read_text() == "# mine\n"


def test_name_of_a_temporary_output_folder(tmp_path):
    folder = tmp_path / ".qwen-mla.attnkit-tmp-1a2b3c4d"
    folder.mkdir()
    (folder / "attnkit_report.json").write_text(json.dumps(CONVERT))
    assert "\n# qwen-mla\n" in write_model_card(folder).read_text()


def test_corrupt_report_is_a_clear_error(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "attnkit_report.json").write_text("{broken")
    with pytest.raises(AttnkitError, match="attnkit_report.json is not valid JSON"):
        write_model_card(folder)
    assert not (folder / "README.md").exists()


def test_folder_with_no_reports_still_gets_a_card(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    meta = _meta(write_model_card(folder))
    assert meta == {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["attnkit"]}


metric_names = st.sampled_from(["acc", "acc_norm", "token_perplexity", "bits_per_byte"])
task_names = st.sampled_from(["attnkit-ppl", "attnkit-complete", "attnkit-recall-256", "hellaswag"])
values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@settings(max_examples=15, deadline=None)
@given(st.dictionaries(task_names, st.dictionaries(metric_names, values, min_size=1, max_size=3), min_size=1, max_size=4))
def test_any_eval_results_round_trip_into_model_index(tmp_path_factory, metrics):
    folder = tmp_path_factory.mktemp("card")
    (folder / "eval_results.json").write_text(json.dumps({"models": {"model": {"metrics": metrics}}}))
    card = ModelCard.load(write_model_card(folder, repo_id="a/b"))
    got = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert got == {(t, m): float(v) for t, ms in metrics.items() for m, v in ms.items()}
