import pytest

from vllm_cascade_plugin.config import KNOBS, CascadeConfig, ConfigError, load_config


def test_every_knob_is_a_config_field_with_its_default():
    defaults = CascadeConfig()
    assert [k.field for k in KNOBS] == list(CascadeConfig.__dataclass_fields__)
    for knob in KNOBS:
        assert getattr(defaults, knob.field) == knob.default
        assert knob.env.startswith("CASCADE_"), "VLLM_* names are rejected by vLLM's env checks"


def test_unset_and_empty_environment_gives_defaults():
    assert load_config({}) == CascadeConfig()
    assert load_config({k.env: "" for k in KNOBS}) == CascadeConfig()


@pytest.mark.parametrize("raw", ["1", "true", "on", "TRUE", " On "])
def test_toggle_accepts_on_values(raw):
    assert load_config({"CASCADE_ATTENTION": raw}).enabled is True


@pytest.mark.parametrize("raw", ["0", "false", "off", "OFF"])
def test_toggle_accepts_off_values(raw):
    assert load_config({"CASCADE_ATTENTION": raw}).enabled is False


@pytest.mark.parametrize(
    ("env", "raw"),
    [("CASCADE_ATTENTION", "yes please"), ("CASCADE_ATTENTION", "2"),
     ("CASCADE_POLICY", "sometimes"), ("CASCADE_MAX_LEVELS", "1"), ("CASCADE_MAX_LEVELS", "3.5"),
     ("CASCADE_MIN_SHARED_PAGES", "0"), ("CASCADE_LOG_INTERVAL", "-1"),
     ("CASCADE_LOG_INTERVAL", "nan"), ("CASCADE_DEBUG", "maybe"),
     ("CASCADE_FUSED_DECODE", "triton"), ("CASCADE_CUDA_GRAPHS", "piecewise")],
)
def test_bad_value_names_variable_value_and_accepted_values(env, raw):
    knob = next(k for k in KNOBS if k.env == env)
    with pytest.raises(ConfigError) as info:
        load_config({env: raw})
    message = str(info.value)
    assert env in message and repr(raw) in message and knob.accepted in message
    assert isinstance(info.value, ValueError)


def test_good_values_parse():
    config = load_config({"CASCADE_ATTENTION": "1", "CASCADE_POLICY": "Always",
                          "CASCADE_MAX_LEVELS": "4", "CASCADE_MIN_SHARED_PAGES": "16",
                          "CASCADE_LOG_INTERVAL": "0", "CASCADE_DEBUG": "on",
                          "CASCADE_FUSED_DECODE": "off", "CASCADE_CUDA_GRAPHS": "0"})
    assert config == CascadeConfig(enabled=True, policy="always", max_levels=4,
                                   min_shared_pages=16, log_interval_s=0.0, debug=True,
                                   fused_decode=False, cuda_graphs=False)
