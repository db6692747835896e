"""The GPU engine tests' driver and engine runs (``tests/gpu/engine_driver.py``, ``engines.py``)
on a CPU: reading the plugin's counters gives up, with exit status 3, when the engine never
answers, instead of holding a GPU run until its time limit; an engine's environment carries the
knobs its test asked for."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    spec = importlib.util.spec_from_file_location("engine_driver_cpu",
                                                  GPU_TESTS / "engine_driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Exited(Exception):
    pass


def test_counters_that_never_come_end_the_driver(driver, monkeypatch):
    never = threading.Event()

    class DeadClient:
        def collective_rpc(self, method):
            never.wait()  # an engine client whose output handler died

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(driver, "COUNTERS_TIMEOUT_S", 0.2)
    monkeypatch.setattr(driver.os, "_exit", exit_)
    with pytest.raises(Exited) as exited:
        driver._counters(DeadClient())
    assert exited.value.args == (3,)
    never.set()


def test_counters_that_come_are_rank_zeros(driver):
    class Client:
        def collective_rpc(self, method):
            assert method is driver._worker_counters
            return [{"steps_planned": 4}, {"steps_planned": 4}]

    assert driver._counters(Client()) == {"steps_planned": 4}


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    spec = importlib.util.spec_from_file_location("engines_cpu", GPU_TESTS / "engines.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "engines_cpu", module)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


def test_an_engines_knobs_replace_the_plugin_runs_defaults(engines, monkeypatch):
    """An engine test's knobs (``CASCADE_SPLIT_MIXED=0``: mixed steps planned whole, the
    plugin's default) reach the engine's environment over the runs' own settings, and a run
    with the plugin off carries no ``CASCADE_*`` variable, not even one set outside."""
    monkeypatch.setenv("CASCADE_MAX_LEVELS", "2")
    monkeypatch.delenv("CASCADE_TEST_KERNEL", raising=False)
    on = engines.Engine("model", True, knobs=(("CASCADE_SPLIT_MIXED", "0"),
                                              ("CASCADE_FULL_GRAPHS", "0")))
    env = on.environment()
    assert (env["CASCADE_SPLIT_MIXED"], env["CASCADE_FULL_GRAPHS"]) == ("0", "0")
    assert (env["CASCADE_ATTENTION"], env["CASCADE_POLICY"]) == ("1", "always")
    assert "CASCADE_MAX_LEVELS" not in env
    assert on.with_(knobs=()).environment()["CASCADE_SPLIT_MIXED"] == "1"
    off = on.with_(plugin=False, knobs=()).environment()
    assert not [k for k in off if k.startswith("CASCADE_")]


def test_an_engines_pythonpath_comes_first_plugin_on_or_off_and_is_part_of_its_identity(
        engines, monkeypatch):
    """A test-only model's folder (its ``sitecustomize`` registers the model with vLLM) goes
    first on the run's ``PYTHONPATH``, before the one it inherits, with the plugin on and off;
    a run with it is another run than one without."""
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    plain = engines.Engine("model", False)
    with_site = plain.with_(pythonpath=("/site",))
    assert plain.environment()["PYTHONPATH"] == "/inherited"
    for engine in (with_site, with_site.with_(plugin=True)):
        assert engine.environment()["PYTHONPATH"].split(":") == ["/site", "/inherited"]
    assert with_site.key != plain.key
    monkeypatch.delenv("PYTHONPATH")
    assert with_site.environment()["PYTHONPATH"] == "/site"
