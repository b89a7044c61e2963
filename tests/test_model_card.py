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
from attnkit.card.build import write_model_card
from attnkit.card.reports import GENERATED_MARKER

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
    assert "| exact_rewrite | exact |" in body and "| lowrank | lossy |" in body
    assert "12.9 before → 14.2 after" in body
    assert "trust_remote_code" not in body.split("## How to load")[1].split("```")[1]
    assert "**transformers only**" in body and "so they refuse it" in body  # a report without an engine form
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
    assert "| validation ppl | 18.2 | 13.5 |" in body and "validation ppl: on rows of the data's validation split." in body
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


# ---------------------------------------------------------------- the card tells the truth


def _card(folder: Path, repo_id: str | None = None) -> tuple[dict, str]:
    path = write_model_card(folder, repo_id=repo_id)
    return _meta(path), path.read_text()


def test_no_local_path_anywhere_in_the_card(tmp_path):
    home = "/home/u"
    convert = dict(CONVERT, source=dict(CONVERT["source"], model=f"{home}/my-llama", path=f"{home}/my-llama"),
                   settings=dict(CONVERT["settings"], out=f"{home}/out/llama-mla", calib=f"{home}/texts"),
                   calibration={"source": f"{home}/texts", "held_out_from": "validation split"})
    finetune = dict(FINETUNE, base_model=f"{home}/out/llama-mla", base_model_path=f"{home}/out/llama-mla",
                    teacher=f"{home}/my-llama", teacher_path=f"{home}/my-llama",
                    recipe={"config": f"{home}/recipes/heal.yaml", "output_dir": f"{home}/healed", "model": "../out/llama-mla"})
    eval_results = {"limit": None, "models": {"model": {"name": "~/healed", "metrics": {"attnkit-complete": {"acc": 0.5}}},
                                              "baseline": {"name": f"{home}/my-llama", "path": f"{home}/my-llama",
                                                           "metrics": {"attnkit-complete": {"acc": 0.6}}}}}
    folder = _folder(tmp_path, attnkit_report__json=convert, finetune_report__json=finetune, eval_results__json=eval_results)
    meta, text = _card(folder)
    assert home not in text and "~/" not in text and "../" not in text and str(tmp_path) not in text
    assert "`my-llama` with its attention rewritten" in text and "from `my-llama` (model type" in text
    assert "| model trained | llama-mla |" in text and "| teacher (distillation) | my-llama |" in text
    assert "baseline (my-llama)" in text and "| out | llama-mla |" in text and "| calib | texts |" in text
    assert "base_model" not in meta


def test_what_counts_as_a_local_path():
    from attnkit.card.names import looks_local

    for local in ("/home/u/x", "~/x", "./x", "../x", "C:\\models\\x", "out/runs/x"):
        assert looks_local(local), local
    for public in ("Qwen/Qwen2.5-0.5B", "hf:HuggingFaceFW/fineweb-edu/sample-10BT", "python", "reference",
                   "GQA as MLA: latent = raw K and V/keys/values of all heads"):
        assert not looks_local(public), public


def test_bundled_reference_and_relative_local_sources_are_named_by_folder(tmp_path):
    reference = dict(CONVERT, source=dict(CONVERT["source"], model="reference", path="/site/attnkit/assets/reference"))
    meta, text = _card(_folder(tmp_path, attnkit_report__json=reference))
    assert "from `reference` (attnkit's bundled reference model)" in text and "/site" not in text
    assert "base_model" not in meta
    # `out/qwen` read as a local folder (relative path recorded as such) is not the Hub model out/qwen
    local = dict(CONVERT, source=dict(CONVERT["source"], model="out/qwen", path="out/qwen"))
    (tmp_path / "two").mkdir()
    meta, text = _card(_folder(tmp_path / "two", attnkit_report__json=local))
    assert "base_model" not in meta and "`qwen` with its attention" in text
    # a Hub id read from the Hub cache stays a Hub id
    hub = dict(CONVERT, source=dict(CONVERT["source"], path="/c/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc"))
    (tmp_path / "three").mkdir()
    assert _card(_folder(tmp_path / "three", attnkit_report__json=hub))[0]["base_model"] == "Qwen/Qwen2.5-0.5B"


def test_kv_table_names_its_dtype(tmp_path):
    convert = dict(CONVERT, kv_cache_bytes_per_token={"before": 2048, "after": 608, "dtype": "bf16"})
    _, text = _card(_folder(tmp_path, attnkit_report__json=convert))
    assert "(all layers, bytes in bf16, the dtype it is stored in; as measured by attnkit)" in text
    assert "| 2048 | 608 | 29.7% |" in text


def test_no_link_to_a_pypi_project(tmp_path):
    _, text = _card(_folder(tmp_path, attnkit_report__json=CONVERT, finetune_report__json=FINETUNE))
    assert "pypi.org" not in text and "](http" not in text.split("## Conversion")[0]


def test_partial_eval_run_is_marked_and_kept_out_of_model_index(tmp_path):
    eval_results = {"limit": 5, "models": {"model": {"metrics": {"attnkit-complete": {"acc": 0.5, "acc_stderr": 0.2}}}}}
    meta, text = _card(_folder(tmp_path, attnkit_report__json=CONVERT, eval_results__json=eval_results))
    assert "model-index" not in meta
    assert "this model, partial (--limit 5)" in text and "Partial run (--limit 5)" in text
    assert "| attnkit-complete | acc | 0.5 ± 0.2 |" in text


def test_partial_healing_eval_is_marked_and_kept_out_of_model_index(tmp_path):
    partial = dict(FINETUNE, recipe={**FINETUNE["recipe"], "eval": {"tasks": "attnkit-core", "limit": 3}})
    meta, text = _card(_folder(tmp_path, attnkit_report__json=CONVERT, finetune_report__json=partial))
    assert "model-index" not in meta
    assert "partial (eval.limit 3)" in text and "| attnkit-complete/acc | 0.41 | 0.47 |" in text
    # a complete healing evaluation (limit null) is a result
    full = dict(FINETUNE, recipe={**FINETUNE["recipe"], "eval": {"tasks": "attnkit-core", "limit": None}})
    (tmp_path / "full").mkdir()
    meta, text = _card(_folder(tmp_path / "full", finetune_report__json=full))
    assert meta["model-index"] and "partial" not in text


def test_stderr_is_shown_beside_its_metric_never_as_a_metric(tmp_path):
    eval_results = {"limit": None, "models": {
        "model": {"metrics": {"attnkit-complete": {"acc": 0.3633, "acc_stderr": 0.0312, "acc_norm": 0.4}}},
        "baseline": {"name": "Qwen/Qwen2.5-0.5B", "metrics": {"attnkit-complete": {"acc": 0.4, "acc_stderr": 0.03}}}}}
    healed = dict(FINETUNE, eval_after={"validation": {"loss": 2.6}, "attnkit-complete": {"acc": 0.47, "acc_stderr": 0.05}})
    meta, text = _card(_folder(tmp_path, finetune_report__json=healed, eval_results__json=eval_results))
    results = meta["model-index"][0]["results"]
    assert sorted(m["type"] for r in results for m in r["metrics"]) == ["acc", "acc_norm"]
    assert "| attnkit-complete | acc | 0.3633 ± 0.031 | 0.4 ± 0.03 |" in text
    assert "| attnkit-complete | acc_norm | 0.4 | – |" in text
    assert "acc_stderr" not in text
    assert "| attnkit-complete/acc | 0.41 | 0.47 ± 0.05 |" in text


def _source_with_card(folder: Path, front: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(f"---\n{front}---\n# the source\n")
    return folder


def test_license_datasets_language_come_from_the_source_card_only(tmp_path):
    src = _source_with_card(tmp_path / "src", "license: llama3.2\ndatasets:\n- HuggingFaceFW/fineweb\nlanguage:\n- en\n- de\ntags: [x]\n")
    convert = dict(CONVERT, source=dict(CONVERT["source"], path=str(src)))
    folder = _folder(tmp_path, attnkit_report__json=convert)
    meta, _ = _card(folder)
    assert (meta["license"], meta["datasets"], meta["language"]) == ("llama3.2", ["HuggingFaceFW/fineweb"], ["en", "de"])
    assert "license_name" not in meta and "x" not in meta["tags"]  # only what the source says, only those keys
    # `push` rebuilds the card after the source is gone: the keys the card carried stay
    (src / "README.md").unlink()
    meta, _ = _card(folder, repo_id="alice/m")
    assert meta["license"] == "llama3.2" and meta["language"] == ["en", "de"]


def test_no_source_card_means_no_license_keys(tmp_path):
    from attnkit.io.resolve import REFERENCE_DIR

    plain = tmp_path / "plain"
    plain.mkdir()
    for path in (str(plain), str(REFERENCE_DIR)):  # no README / a README without those keys
        folder = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "attnkit_report.json").write_text(json.dumps(dict(CONVERT, source=dict(CONVERT["source"], path=path))))
        meta, _ = _card(folder)
        assert not {"license", "datasets", "language", "license_name", "license_link"} & set(meta)


def test_healed_card_carries_the_students_card_keys(tmp_path):
    student = _source_with_card(tmp_path / "student", "license: apache-2.0\n")
    healed = dict(FINETUNE, base_model_path=str(student))
    meta, _ = _card(_folder(tmp_path, finetune_report__json=healed))
    assert meta["license"] == "apache-2.0" and "datasets" not in meta


def test_card_states_minimum_transformers_and_remote_code(tmp_path):
    mla = dict(CONVERT, load={**CONVERT["load"], "min_transformers": "4.53.0"})
    config = {"model_type": "deepseek_v3", "transformers_version": "5.24.0"}
    _, text = _card(_folder(tmp_path, attnkit_report__json=mla, config__json=config))
    usage = text.split("## How to load")[1]
    assert "Minimum transformers version: **4.53.0**" in usage and "No custom code is needed" in usage
    # healed: re-saved by the trainer, so only the release that wrote it is stated
    (tmp_path / "healed").mkdir()
    _, text = _card(_folder(tmp_path / "healed", attnkit_report__json=mla, finetune_report__json=FINETUNE, config__json=config))
    assert "4.53.0" not in text and "Saved with transformers 5.24.0; older releases were not checked." in text
    dex = dict(CONVERT, method="dex", load={"trust_remote_code": True, "min_transformers": "4.53.0"})
    dex_config = {"model_type": "attnkit_llama", "transformers_version": "5.24.0", "auto_map": {"AutoConfig": "modeling_attnkit.C"}}
    (tmp_path / "dex").mkdir()
    _, text = _card(_folder(tmp_path / "dex", attnkit_report__json=dex, config__json=dex_config))
    usage = text.split("## How to load")[1]
    assert "needs `trust_remote_code=True`" in usage and "Saved with transformers 5.24.0" in usage and "4.53.0" not in usage


@pytest.mark.parametrize(("method", "config", "target"), [
    ("mla", {"model_type": "deepseek_v3"}, {"form": "transformers", "constant_channel": True}),
    ("mla", {"model_type": "deepseek_v3"}, None),  # reports from before the engine form: all had the channel
    ("mla+dex", {"model_type": "attnkit_deepseek_v3"}, {"form": "transformers", "constant_channel": True}),
])
def test_constant_channel_outputs_warn_against_plain_fine_tuning(tmp_path, method, config, target):
    convert = dict(CONVERT, method=method)
    if target and method == "mla":
        convert["target"] = target
    elif target:
        convert["mla"] = {"target": target}
    _, text = _card(_folder(tmp_path, attnkit_report__json=convert, config__json=config))
    assert "Fine-tuning: keep `kv_b_proj` frozen." in text and "`attnkit finetune`" in text
    assert "are safe on it" not in text


def test_engine_form_may_be_fine_tuned_and_dex_alone_says_nothing(tmp_path):
    engines = dict(CONVERT, target={"form": "engines", "constant_channel": False})
    _, text = _card(_folder(tmp_path, attnkit_report__json=engines, config__json={"model_type": "deepseek_v3"}))
    assert "plain PEFT LoRA and full fine-tuning are safe on it" in text and "kv_b_proj` frozen" not in text
    (tmp_path / "dex").mkdir()
    _, text = _card(_folder(tmp_path / "dex", attnkit_report__json=dict(CONVERT, method="dex"),
                            config__json={"model_type": "attnkit_llama"}))
    assert "Fine-tuning" not in text


@pytest.mark.slow
def test_dex_card_snippet_runs_in_a_fresh_process_without_prompting(tmp_path):
    """The card's code block, run as printed on a tiny DEX output: the tokenizer line must not read
    config.json's auto_map (AutoTokenizer would ask "Do you wish to run the custom code?")."""
    import os
    import subprocess
    import sys

    from test_dex_models import convert_cli, save_tiny_model, write_calib

    src = save_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "dex"
    assert convert_cli("dex", src, out, write_calib(tmp_path / "calib")) == 0
    code = (out / "README.md").read_text().split("## How to load")[1].split("```python\n")[1].split("```")[0]
    tokenizer_line = next(line for line in code.splitlines() if line.startswith("tokenizer ="))
    assert "trust_remote_code" not in tokenizer_line
    code = code.replace("PATH_OR_REPO_ID", str(out)) + "print(type(model).__name__, len(tokenizer('w1 w2').input_ids))\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-2000:]
    assert "custom code" not in output and "[y/N]" not in output, output[-2000:]
    assert run.stdout.split()[0] == "AttnkitLlamaForCausalLM"


# ---------------------------------------------------------------- one name per perplexity (issue 29)


def test_each_perplexity_is_named_and_the_card_leads_with_the_figure_eval_prints(tmp_path):
    convert = dict(CONVERT, calibration={"source": "python", "seq_len": 512, "held_out_rows": 8,
                                         "held_out_from": "validation split"})
    ppl = {"word_perplexity": 21470.9, "byte_perplexity": 2.33, "bits_per_byte": 1.22, "token_perplexity": 29.56}
    eval_results = {"limit": None, "models": {"model": {"metrics": {"attnkit-ppl-quick": ppl}},
                                              "baseline": {"metrics": {"attnkit-ppl-quick": dict(ppl, token_perplexity=25.53)}}},
                    "retention": {"attnkit-ppl-quick/token_perplexity": 1.158}}
    finetune = dict(FINETUNE, validation_text={"rows": 16, "seq_len": 1024})
    folder = _folder(tmp_path, attnkit_report__json=convert, eval_results__json=eval_results, finetune_report__json=finetune)
    meta, body = _card(folder)
    # the conversion's figure under its name, with its text and rows
    assert "held-out ppl (8 × 512-token rows of --calib python's validation split): 12.9 before → 14.2 after conversion" in body
    assert "| step | step alone | " in body and "| kl | held-out ppl |" in body
    # eval's: the rows `attnkit eval` prints, token_perplexity first, lm-eval's word_perplexity not in the table
    table = body.split("## Evaluation")[1]
    assert "word_perplexity" not in table
    assert table.index("token_perplexity") < table.index("byte_perplexity") < table.index("bits_per_byte")
    assert "token_perplexity (attnkit-ppl): per token over 24 held-out Python files" in table
    first = meta["model-index"][0]["results"][0]["metrics"][0]
    assert first["type"] == "token_perplexity" and first["value"] == 29.56
    # the fine-tune's own
    assert "| validation ppl | 18.2 | 13.5 |" in body
    assert "validation ppl: on 16 × 1024-token rows of the data's validation split." in body
