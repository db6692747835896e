"""The entry point as vLLM runs it: each case in a process of its own, like a vLLM process.

The plugin overrides two registry entries, FLASH_ATTN and FLASHINFER: these tests fail loudly when
vLLM's registry or its class paths change under them. Each case runs in a child of the fork server
(``tests/fresh_python.py``: an interpreter that has imported vLLM, forked per case); one also in a
new interpreter, which must see the same.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fresh_python import vllm_process
from vllm_cascade_plugin import BACKEND_PATH, FLASH_ATTN_BACKEND_PATH
from vllm_cascade_plugin.integration.compat.releases import flashinfer_api_problems

VLLM_DEFAULT = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
VLLM_FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"

PROBE = """
import json, sys
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
heavy = ("flashinfer", "vllm.v1.attention.backends.flashinfer",
         "vllm.v1.attention.backends.flash_attn",
         "vllm_cascade_plugin.integration.flashinfer_backend",
         "vllm_cascade_plugin.integration.flash_attn_backend", "vllm_cascade_plugin.execution.")
before = set(sys.modules)
load_general_plugins()
new = sorted(m for m in set(sys.modules) - before if m.startswith(heavy))
fi, fa = AttentionBackendEnum.FLASHINFER, AttentionBackendEnum.FLASH_ATTN
print("RESULT" + json.dumps({"path": fi.get_path(), "overridden": fi.is_overridden(),
                             "fa_path": fa.get_path(), "fa_overridden": fa.is_overridden(),
                             "heavy_imports": new,
                             "preloaded": sorted(m for m in before if m.startswith(heavy))}))
"""


# vLLM configures its loggers on import up to 0.30; from 0.31 on the engine, the LLM class and
# the CLI do it first thing, before plugins load. Every case starts as such a process.
VLLM_LOGGING = """
import vllm.logger
if hasattr(vllm.logger, "configure_logging"):
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging(LoggingConfig())
"""


def run_python(code: str, new_interpreter: bool = False,
               **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("CASCADE_") and k != "VLLM_PLUGINS"}
    environ.update(env)
    code = VLLM_LOGGING + textwrap.dedent(code)
    if new_interpreter:
        return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                              text=True, timeout=300)
    return vllm_process(environ).run(code, environ)


def probe(prelude: str = "", new_interpreter: bool = False, **env: str) -> tuple[dict, str]:
    proc = run_python(prelude + PROBE, new_interpreter, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    assert result["preloaded"] == [], "the heavy-import check would see nothing"
    return result, proc.stdout + proc.stderr


def test_a_forked_case_sees_what_a_new_interpreter_sees():
    """The fork server's premise (tests/fresh_python.py), checked on this vLLM."""
    new, new_log = probe(new_interpreter=True)
    forked, forked_log = probe()
    assert new == forked == {"path": VLLM_DEFAULT, "overridden": False,
                             "fa_path": VLLM_FLASH_ATTN, "fa_overridden": False,
                             "heavy_imports": [], "preloaded": []}
    assert "cascade" not in new_log.lower() and "cascade" not in forked_log.lower()


@pytest.mark.flashinfer
def test_enabled_plugin_overrides_flash_attn_and_flashinfer_without_importing_them():
    result, log = probe(CASCADE_ATTENTION="1")
    assert result["path"] == BACKEND_PATH and result["overridden"]
    assert result["fa_path"] == FLASH_ATTN_BACKEND_PATH and result["fa_overridden"]
    assert result["heavy_imports"] == [], "register() must resolve the backends lazily"
    assert log.count("cascade attention on for the FLASH_ATTN and FLASHINFER backends") == 1


@pytest.mark.flashinfer
def test_registered_path_imports_our_subclasses():
    code = """
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends import flashinfer as fi
    load_general_plugins()
    cls = AttentionBackendEnum.FLASHINFER.get_class()
    assert cls.__name__ == "CascadeFlashInferBackend", cls
    assert issubclass(cls, fi.FlashInferBackend) and cls.get_name() == "FLASHINFER"
    assert issubclass(cls.get_builder_cls(), fi.FlashInferMetadataBuilder)
    assert issubclass(cls.get_impl_cls(), fi.FlashInferImpl)
    assert cls.get_builder_cls() is not fi.FlashInferMetadataBuilder
    assert cls.get_impl_cls() is not fi.FlashInferImpl
    from vllm.v1.attention.backends import flash_attn as fa
    cls = AttentionBackendEnum.FLASH_ATTN.get_class()
    assert cls.__name__ == "CascadeFlashAttentionBackend", cls
    assert issubclass(cls, fa.FlashAttentionBackend) and cls.get_name() == "FLASH_ATTN"
    assert issubclass(cls.get_builder_cls(), fa.FlashAttentionMetadataBuilder)
    assert issubclass(cls.get_impl_cls(), fa.FlashAttentionImpl)
    assert cls.get_builder_cls() is not fa.FlashAttentionMetadataBuilder
    assert cls.get_impl_cls() is not fa.FlashAttentionImpl
    print("OK")
    """
    proc = run_python(code, CASCADE_ATTENTION="1")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_plugin_off_overrides_nothing(value):
    env = {} if value is None else {"CASCADE_ATTENTION": value}
    result, log = probe(**env)
    assert result["path"] == VLLM_DEFAULT and not result["overridden"]
    assert result["fa_path"] == VLLM_FLASH_ATTN and not result["fa_overridden"]
    assert "cascade" not in log.lower()


def test_empty_vllm_plugins_disables_the_plugin():
    result, _ = probe(CASCADE_ATTENTION="1", VLLM_PLUGINS="")
    assert result["path"] == VLLM_DEFAULT and not result["overridden"]
    assert result["fa_path"] == VLLM_FLASH_ATTN and not result["fa_overridden"]


def test_bad_toggle_aborts_startup_with_an_actionable_message():
    proc = run_python(PROBE, CASCADE_ATTENTION="yes")
    assert proc.returncode != 0
    assert "ConfigError: CASCADE_ATTENTION='yes' is not valid" in proc.stderr
    assert "1/true/on or 0/false/off" in proc.stderr


@pytest.mark.flashinfer
@pytest.mark.parametrize(("distribution", "name", "version"), [
    ("flashinfer-python", "FlashInfer", "0.5.3"), ("flashinfer-python", "FlashInfer", "0.8.0"),
    ("vllm", "vLLM", "0.25.1")])
def test_unsupported_version_warns_once_and_stays_off(distribution, name, version):
    prelude = f"""
    import vllm_cascade_plugin.integration.compat.releases as compat
    real = compat.installed_version
    compat.installed_version = lambda d: {version!r} if d == {distribution!r} else real(d)
    """
    result, log = probe(textwrap.dedent(prelude), CASCADE_ATTENTION="1")
    assert result["path"] == VLLM_DEFAULT and not result["overridden"]
    assert result["fa_path"] == VLLM_FLASH_ATTN and not result["fa_overridden"]
    assert log.count("stays off") == 1
    assert f"{name} {version} is outside the supported range" in log


# vLLM posing as a release newer than the tested range (0.35.0); ``record``: what the newest
# tested release's record of the patched methods becomes, as Python source for the child.
UNTESTED = """
import vllm_cascade_plugin.integration.compat.releases as releases
real = releases.installed_version
installed = real("vllm")
releases.installed_version = lambda d: "0.35.0" if d == "vllm" else real(d)
record = {record}
assert record
releases.PATCHED_METHODS[max(releases.PATCHED_METHODS)] = record
"""
# The installed vLLM's own record: every patched method reads as recorded.
AS_RECORDED = "releases.recorded_methods(installed)"
# The same, with one parameter more in CudaGraphManager.dispatch.
ONE_CHANGED = ("{k: v + ('new_flag',) if k[1:] == ('CudaGraphManager', 'dispatch') else v "
               "for k, v in releases.recorded_methods(installed).items()}")


@pytest.mark.flashinfer
def test_a_vllm_newer_than_the_tested_range_warns_once_and_stays_off():
    result, log = probe(UNTESTED.format(record=AS_RECORDED), CASCADE_ATTENTION="1")
    assert not result["overridden"] and not result["fa_overridden"]
    assert log.count("stays off") == 1
    assert "vLLM 0.35.0 is newer than the newest release the plugin is tested with" in log
    assert "CASCADE_ALLOW_UNTESTED_VLLM=1" in log


@pytest.mark.flashinfer
def test_allowing_an_untested_vllm_registers_where_every_patched_method_reads_as_recorded():
    result, log = probe(UNTESTED.format(record=AS_RECORDED), CASCADE_ATTENTION="1",
                        CASCADE_ALLOW_UNTESTED_VLLM="1")
    assert result["path"] == BACKEND_PATH and result["overridden"]
    assert result["fa_path"] == FLASH_ATTN_BACKEND_PATH and result["fa_overridden"]
    assert result["heavy_imports"] == []  # the check reads source files, imports nothing heavy
    assert log.count("runs on vLLM 0.35.0, newer than the newest release it is tested") == 1


@pytest.mark.flashinfer
def test_allowing_an_untested_vllm_whose_patched_method_changed_refuses_to_start_naming_it():
    proc = run_python(UNTESTED.format(record=ONE_CHANGED) + PROBE, CASCADE_ATTENTION="1",
                      CASCADE_ALLOW_UNTESTED_VLLM="1")
    assert proc.returncode != 0
    (line,) = [x for x in proc.stderr.splitlines() if "ConfigError: " in x]
    assert "CASCADE_ALLOW_UNTESTED_VLLM is on, but vLLM 0.35.0 changed a method" in line
    assert "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.dispatch(" in line
    assert "Unset CASCADE_ALLOW_UNTESTED_VLLM" in line


@pytest.mark.flashinfer
def test_register_is_idempotent_within_a_process():
    code = """
    from vllm_cascade_plugin import BACKEND_PATH, FLASH_ATTN_BACKEND_PATH, register
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    register(); register()
    assert AttentionBackendEnum.FLASHINFER.get_path() == BACKEND_PATH
    assert AttentionBackendEnum.FLASH_ATTN.get_path() == FLASH_ATTN_BACKEND_PATH
    print("OK")
    """
    proc = run_python(code, CASCADE_ATTENTION="1")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("cascade attention on") == 1


@pytest.mark.flashinfer
def test_the_imported_flashinfer_is_the_installed_distribution():
    """The matrix's cells check the distribution they find; this, that it is what imports."""
    import flashinfer

    from vllm_cascade_plugin.integration.compat.releases import _flashinfer_dir, installed_version

    assert flashinfer.__version__ == installed_version("flashinfer-python")
    assert Path(flashinfer.__file__).parent == _flashinfer_dir()


@pytest.mark.flashinfer
def test_installed_flashinfer_has_the_api_we_call():
    assert flashinfer_api_problems() == []


def test_missing_flashinfer_api_is_reported(tmp_path):
    (tmp_path / "prefill.py").write_text(
        "class BatchPrefillWithPagedKVCacheWrapper:\n"
        "    def __init__(self, float_workspace_buffer, kv_layout='NHD'): ...\n"
        "    def plan(self, qo_indptr, paged_kv_indptr): ...\n")
    (tmp_path / "cascade.py").write_text("def merge_state(v_a, s_a, v_b, s_b): ...\n")
    problems = flashinfer_api_problems(tmp_path)
    assert any("BatchPrefillWithPagedKVCacheWrapper.plan lacks parameter(s)" in p and "causal" in p
               for p in problems)
    assert "flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper.run is missing" in problems
    assert "flashinfer.cascade.merge_state_in_place is missing" in problems
