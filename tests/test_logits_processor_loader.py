"""Loading custom logits processors and build_logitsprocs (seed 001 ch. 11, appendix Q)."""

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.logits_processors import (
    LOGITSPROCS_GROUP,
    LogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    build_logitsprocs,
    cached_load_custom_logitsprocs,
    validate_logits_processors_parameters,
)
from tinyvllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
CONFIG = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=4))


class DummyLogitsProcessor(LogitsProcessor):
    """A custom processor that refuses requests with a negative extra_args['x']."""

    def __init__(self, config, device, is_pin_memory):
        self.max_num_seqs = config.scheduler_config.max_num_seqs

    @classmethod
    def validate_params(cls, sampling_params):
        if (sampling_params.extra_args or {}).get("x", 0) < 0:
            raise ValueError(f"x must be >= 0, got {sampling_params.extra_args['x']}")

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass


class Outer:
    class Inner(DummyLogitsProcessor):
        pass


class NotAProcessor:
    pass


NOT_A_TYPE = 42
MODULE = __name__


class _FakeEntryPoint:
    def __init__(self, name, obj=None, error=None):
        self.name, self._obj, self._error = name, obj, error

    def load(self):
        if self._error is not None:
            raise self._error
        return self._obj


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Install fake entry points: ``fake_entry_points([...])``; records the group asked for."""
    asked = []

    def install(eps):
        def entry_points(*, group):
            asked.append(group)
            return list(eps) if group == LOGITSPROCS_GROUP else []

        monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
        cached_load_custom_logitsprocs.cache_clear()
        return asked

    yield install
    cached_load_custom_logitsprocs.cache_clear()


def types_of(procs):
    return [type(p) for p in procs.all]


@pytest.mark.seed("001:11", "001:Q")
def test_normal_mode_builds_builtins_then_entry_point_plugin(fake_entry_points):
    asked = fake_entry_points([_FakeEntryPoint("dummy", DummyLogitsProcessor)])
    procs = build_logitsprocs(CONFIG, CPU, False, is_pooling_model=False)
    assert asked == ["tinyvllm.logits_processors"]
    assert [type(p) for p in procs.non_argmax_invariant][:1] == [MinTokensLogitsProcessor]
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor, DummyLogitsProcessor]
    assert procs.argmax_invariant[1].max_num_seqs == 4


@pytest.mark.seed("001:11")
def test_fqcn_class_and_nested_qualname(fake_entry_points):
    fake_entry_points([])
    procs = build_logitsprocs(CONFIG, CPU, False, False, [f"{MODULE}:Outer.Inner", DummyLogitsProcessor])
    assert types_of(procs)[1:3] == [Outer.Inner, DummyLogitsProcessor]
    assert len(types_of(procs)) == 5


@pytest.mark.seed("001:11", "001:Q")
def test_plugins_load_before_fqcns(fake_entry_points):
    fake_entry_points([_FakeEntryPoint("inner", Outer.Inner)])
    procs = build_logitsprocs(CONFIG, CPU, False, False, [DummyLogitsProcessor])
    assert types_of(procs)[:3] == [MinPLogitsProcessor, Outer.Inner, DummyLogitsProcessor]


@pytest.mark.seed("001:11")
@pytest.mark.parametrize("fqcn", ["no_colon_here", ":Dummy", f"{MODULE}:", f"{MODULE}:A:B"])
def test_malformed_fqcn_raises_value_error(fake_entry_points, fqcn):
    fake_entry_points([])
    with pytest.raises(ValueError, match="malformed"):
        build_logitsprocs(CONFIG, CPU, False, False, [fqcn])


@pytest.mark.seed("001:11")
def test_fqcn_of_non_type_raises(fake_entry_points):
    fake_entry_points([])
    with pytest.raises(ValueError, match="must name a class"):
        build_logitsprocs(CONFIG, CPU, False, False, [f"{MODULE}:NOT_A_TYPE"])


@pytest.mark.seed("001:11")
def test_fqcn_of_non_subclass_raises(fake_entry_points):
    fake_entry_points([])
    with pytest.raises(ValueError, match="NotAProcessor is not a subclass of LogitsProcessor"):
        build_logitsprocs(CONFIG, CPU, False, False, [f"{MODULE}:NotAProcessor"])
    with pytest.raises(ValueError, match="NotAProcessor is not a subclass"):
        build_logitsprocs(CONFIG, CPU, False, False, [NotAProcessor])


@pytest.mark.seed("001:11")
def test_fqcn_missing_attribute_raises(fake_entry_points):
    fake_entry_points([])
    with pytest.raises(ValueError, match="'Missing' not found"):
        build_logitsprocs(CONFIG, CPU, False, False, [f"{MODULE}:Outer.Missing"])


@pytest.mark.seed("001:11")
def test_fqcn_import_failure_raises_runtime_error(fake_entry_points):
    fake_entry_points([])
    with pytest.raises(RuntimeError, match="no_such_module_xyz") as info:
        build_logitsprocs(CONFIG, CPU, False, False, ["no_such_module_xyz:Proc"])
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


@pytest.mark.seed("001:11")
def test_entry_point_load_failure_raises_runtime_error(fake_entry_points):
    fake_entry_points([_FakeEntryPoint("broken", error=ImportError("boom"))])
    with pytest.raises(RuntimeError, match="'broken'") as info:
        build_logitsprocs(CONFIG, CPU, False, False)
    assert "boom" in str(info.value.__cause__)


@pytest.mark.seed("001:11")
def test_entry_point_of_non_subclass_raises(fake_entry_points):
    fake_entry_points([_FakeEntryPoint("bad", NotAProcessor)])
    with pytest.raises(ValueError, match="plugin 'bad'"):
        build_logitsprocs(CONFIG, CPU, False, False)


@pytest.mark.seed("001:11", "001:Q")
def test_pooling_mode_has_no_processors_and_rejects_custom(fake_entry_points):
    fake_entry_points([_FakeEntryPoint("dummy", DummyLogitsProcessor)])
    assert types_of(build_logitsprocs(CONFIG, CPU, False, is_pooling_model=True)) == []
    with pytest.raises(ValueError, match="Pooling models"):
        build_logitsprocs(CONFIG, CPU, False, True, [DummyLogitsProcessor])


@dataclass(frozen=True)
class _SpecConfig:
    """A fake engine config with speculative decoding (EngineConfig has none yet)."""

    scheduler_config: SchedulerConfig
    speculative_config: object


@pytest.mark.seed("001:11", "001:Q")
def test_spec_decode_mode_keeps_min_tokens_only(fake_entry_points):
    fake_entry_points([_FakeEntryPoint("dummy", DummyLogitsProcessor)])
    config = _SpecConfig(SchedulerConfig(max_num_seqs=4), speculative_config={"num_speculative_tokens": 2})
    assert types_of(build_logitsprocs(config, CPU, False, False)) == [MinTokensLogitsProcessor]
    with pytest.raises(ValueError, match="speculative decoding"):
        build_logitsprocs(config, CPU, False, False, [DummyLogitsProcessor])


@pytest.mark.seed("001:11")
def test_validate_parameters_asks_custom_processors(fake_entry_points):
    fake_entry_points([])
    validate_logits_processors_parameters([DummyLogitsProcessor], SamplingParams(extra_args={"x": 1}))
    with pytest.raises(ValueError, match="x must be >= 0, got -1"):
        validate_logits_processors_parameters([f"{MODULE}:DummyLogitsProcessor"], SamplingParams(extra_args={"x": -1}))
    validate_logits_processors_parameters(None, SamplingParams(extra_args={"x": -1}))  # no custom processors


@pytest.mark.seed("001:Q")
def test_validate_parameters_caches_loading(fake_entry_points, monkeypatch):
    fake_entry_points([])
    validate_logits_processors_parameters([f"{MODULE}:DummyLogitsProcessor"], SamplingParams())
    hits = cached_load_custom_logitsprocs.cache_info().hits
    validate_logits_processors_parameters([f"{MODULE}:DummyLogitsProcessor"], SamplingParams())
    assert cached_load_custom_logitsprocs.cache_info().hits == hits + 1


@pytest.mark.seed("001:11")
def test_fqcn_loads_a_module_installed_at_run_time(fake_entry_points, monkeypatch):
    fake_entry_points([])
    module = types.ModuleType("tvllm_fake_plugin_pkg")
    module.Proc = DummyLogitsProcessor
    monkeypatch.setitem(sys.modules, "tvllm_fake_plugin_pkg", module)
    procs = build_logitsprocs(CONFIG, CPU, False, False, ["tvllm_fake_plugin_pkg:Proc"])
    assert DummyLogitsProcessor in types_of(procs)
