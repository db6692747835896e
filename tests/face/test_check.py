"""``vllm-cascade check`` with the arguments vLLM will start with: it reads them as vLLM does and
names what keeps every step flat (the same reasons the builders log at startup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_cascade_plugin.face import check, cli
from vllm_cascade_plugin.integration import support

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 3})
EAGLE = json.dumps({"method": "eagle", "model": "some/eagle", "num_speculative_tokens": 3})


@pytest.fixture
def plugin_on(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CASCADE_") or name == "VLLM_PLUGINS":
            monkeypatch.delenv(name)
    monkeypatch.setenv("CASCADE_ATTENTION", "1")


def test_check_reads_the_settings_it_judges_in_both_spellings():
    values = support.read_engine_arguments(
        ["my/model", "--port", "8000", "--kv_cache_dtype=fp8", "--no-enable-prefix-caching",
         "--speculative-config", NGRAM, "--attention-backend", "FLASH_ATTN", "-tp", "2"])
    assert values == {"attention_backend": "FLASH_ATTN", "kv_cache_dtype": "fp8",
                      "enable_prefix_caching": False, "async_scheduling": None,
                      "speculative_config": json.loads(NGRAM), "tensor_parallel_size": 2}
    assert support.read_engine_arguments([]) == dict.fromkeys(support.ENGINE_FIELDS)
    for bad in (["--kv-cache-dtype"], ["--speculative-config", "{not json"]):
        with pytest.raises(ValueError):
            support.read_engine_arguments(bad)


@pytest.mark.parametrize(("argv", "reasons"), [
    ([], []),
    (["--attention-backend", "FLASH_ATTN", "--kv-cache-dtype", "auto"], []),
    (["--attention-backend", "flashinfer"], []),
    (["--speculative-config", NGRAM], []),
    (["--enable-prefix-caching"], []),
    (["--no-enable-prefix-caching"], [support.PREFIX_CACHING_OFF]),
    (["--kv-cache-dtype", "fp8_e5m2"], [support.kv_cache_dtype_reason("fp8_e5m2")]),
    (["--speculative-config", NGRAM, "--async-scheduling"], [support.ASYNC_SPECULATIVE]),
    (["--speculative-config", EAGLE], [support.speculative_reason("eagle", None)]),
    (["--speculative-config", SUFFIX], [support.speculative_reason("suffix", None)]),
    (["--tensor-parallel-size", "2"], [support.parallel_reason(2)]),
    (["-tp", "1"], []),
    (["--attention-backend", "TRITON_ATTN"], ["--attention-backend TRITON_ATTN: the plugin "
                                              "extends FLASH_ATTN and FLASHINFER only; other "
                                              "backends run as without it"]),
])
def test_check_names_every_setting_that_keeps_the_cascade_flat(argv, reasons):
    assert support.engine_argument_reasons(support.read_engine_arguments(argv)) == reasons


def test_the_reasons_for_fp8_and_speculative_decoding_say_why():
    assert support.kv_cache_dtype_reason("auto") is None
    assert support.kv_cache_dtype_reason("bfloat16") is None
    assert "CASCADE_FP8_KV=0" in support.kv_cache_dtype_reason("fp8")
    assert support.kv_cache_dtype_reason("fp8", fp8_kv=True) is None
    assert "not supported" in support.kv_cache_dtype_reason("fp8_e5m2", fp8_kv=True)
    assert support.speculative_reason("ngram", False) is None
    # suffix is served but not run on a GPU with this release: CASCADE_UNVERIFIED only.
    assert "CASCADE_UNVERIFIED=1" in support.speculative_reason("suffix", None)
    assert support.speculative_reason("suffix", None, unverified=True) is None
    assert "CASCADE_UNVERIFIED=1" in support.parallel_reason(2)
    assert support.parallel_reason(2, unverified=True) is None
    assert support.parallel_reason(1) is None and support.parallel_reason(None) is None
    assert "upper bounds" in support.speculative_reason("ngram", True)
    assert "drafter" in support.speculative_reason("mtp", False)


def test_vllms_own_parser_reads_these_flags_as_check_does():
    """The flags check reads are EngineArgs fields vLLM parses to the same values (a CPU platform
    stands in for the GPU; in a subprocess, so no other test sees it)."""
    argv = ["--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "--speculative-config",
            NGRAM, "--attention-backend", "FLASHINFER", "--no-async-scheduling", "-tp", "2"]
    script = textwrap.dedent("""
        import dataclasses, json, sys
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform
        vllm.platforms._current_platform = CpuPlatform()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        fields = [f.name for f in dataclasses.fields(EngineArgs)]
        args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
        names = json.loads(sys.argv[2])
        print("PARSED" + json.dumps({"fields": [n for n in names if n in fields],
                                     "values": {n: getattr(args, n) for n in names}},
                                    default=lambda v: getattr(v, "name", str(v))))
    """)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(argv),
                           json.dumps(support.ENGINE_FIELDS)],
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PARSED")), None)
    assert line is not None, proc.stderr[-3000:]
    parsed = json.loads(line[6:])
    assert parsed["fields"] == list(support.ENGINE_FIELDS)
    assert parsed["values"] == support.read_engine_arguments(argv)


@pytest.mark.flashinfer  # check reports the installed FlashInfer
def test_check_with_arguments_that_keep_the_cascade_flat_says_so_and_exits_1(plugin_on,
                                                                            capsys):
    assert cli.main(["check", "--kv-cache-dtype", "fp8_e5m2", "--no-enable-prefix-caching"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "every step runs vLLM's flat attention and the plugin has nothing to do" in out
    assert " ".join(support.PREFIX_CACHING_OFF.split()) in out
    assert "quantised KV cache (kv_cache_dtype=fp8_e5m2)" in out


@pytest.mark.flashinfer  # check reports the installed FlashInfer
@pytest.mark.parametrize("knob", [None, "0"], ids=["default", "off"])
def test_an_fp8_kv_cache_runs_cascade_unless_the_knob_is_off(plugin_on, capsys, monkeypatch,
                                                            knob):
    if knob is None:
        monkeypatch.delenv("CASCADE_FP8_KV", raising=False)
    else:
        monkeypatch.setenv("CASCADE_FP8_KV", knob)
    status = cli.main(["check", "--kv-cache-dtype", "fp8"])
    out = " ".join(capsys.readouterr().out.split())
    if knob is None:  # nothing in the arguments keeps it flat (the status may still say: no GPU)
        assert status != 1 and "FP8 KV cache (kv_cache_dtype=fp8)" not in out, out
    else:
        assert status == 1 and "FP8 KV cache (kv_cache_dtype=fp8) with CASCADE_FP8_KV=0" in out


@pytest.mark.flashinfer  # check reports the installed FlashInfer
@pytest.mark.parametrize(("gpu", "status"), [("NVIDIA H200 (sm_90), CUDA 13.0, 1 device(s)", 0),
                                             (None, 3)])
def test_check_with_arguments_the_cascade_can_serve_exits_0_on_a_gpu_and_3_without(
        plugin_on, capsys, monkeypatch, gpu, status):
    """Exit status 0 means it will run here: not on a machine without a CUDA GPU, where
    everything else being in place is status 3 (the report's last line says which)."""
    monkeypatch.setattr(check, "gpu", lambda: gpu)
    assert cli.main(["check", "my/model", "--speculative-config", NGRAM,
                     "--no-async-scheduling"]) == status
    out = " ".join(capsys.readouterr().out.split())
    assert "nothing keeps the cascade off" in out
    assert "no --attention-backend, so vLLM picks it: FLASH_ATTN on Hopper" in out
    assert out.endswith(f"Exit status {status}: {' '.join(check.EXIT_STATUS[status].split())}")
    assert ("GPU none" in out) is (gpu is None)


@pytest.mark.flashinfer  # check reports the installed FlashInfer
def test_check_reads_speculative_decoding_without_an_async_flag_as_the_installed_vllm_runs_it(
        plugin_on, capsys, monkeypatch):
    """vLLM 0.34 schedules asynchronously by default with every speculative method (0.26-0.33
    turned it off for n-gram drafting), and a plan from asynchronous speculative steps would
    read rejected tokens: there check must say the steps run flat."""
    from packaging.version import Version

    from vllm_cascade_plugin.integration.compat.releases import installed_version

    monkeypatch.setattr(check, "gpu", lambda: None)
    async_default = Version(installed_version("vllm") or "0") >= Version("0.34.0")
    status = cli.main(["check", "my/model", "--speculative-config", NGRAM])
    out = " ".join(capsys.readouterr().out.split())
    assert status == (1 if async_default else 3)
    assert ("upper bounds of each request's sequence length" in out) is async_default


@pytest.mark.flashinfer  # check reports the installed FlashInfer
def test_without_a_gpu_arguments_that_keep_the_cascade_flat_still_exit_1(plugin_on, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(check, "gpu", lambda: None)
    assert cli.main(["check", "--no-enable-prefix-caching"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("Exit status 1: the plugin will "
                                                                "not run")
