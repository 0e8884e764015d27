"""The patch helper: apply once, record, skip with a reason, revert."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest

from accelerate_neuron import activation, patching
from accelerate_neuron.patching import Patch


@pytest.fixture
def fake_upstream() -> Iterator[types.ModuleType]:
    """A throwaway module standing in for an upstream library."""
    module = types.ModuleType("fake_upstream")

    def get_budget(max_memory=None, devices=None):
        return {"cpu": 1}

    class Loader:
        def load(self, path):
            return f"loaded {path}"

        @staticmethod
        def probe(x):
            return x

        @classmethod
        def make(cls, x):
            return (cls.__name__, x)

    module.get_budget = get_budget
    module.Loader = Loader
    alias = types.ModuleType("fake_upstream_alias")
    alias.get_budget = get_budget
    sys.modules["fake_upstream"] = module
    sys.modules["fake_upstream_alias"] = alias
    yield module
    for key in [r.key for r in patching.records() if r.target.startswith("fake_upstream")]:
        patching.revert(key)
    patching.forget()
    del sys.modules["fake_upstream"], sys.modules["fake_upstream_alias"]
    # forget() also dropped the real plugins' "skipped" records, which later bookkeeping tests read back.
    activation.reapply_patches()


def _neuron_budget(original):
    def get_budget(max_memory=None, devices=None):
        return {0: 100, **original(max_memory, devices)}

    return get_budget


def test_apply_records_and_reverts(fake_upstream: types.ModuleType) -> None:
    original = fake_upstream.get_budget
    patch = Patch("fake_upstream", "get_budget", _neuron_budget, reason="no Neuron branch", lacking="fake<=1")
    record = patching.apply(patch, plugin="test")
    assert record.status == "applied" and record.plugin == "test"
    assert fake_upstream.get_budget() == {0: 100, "cpu": 1}
    assert getattr(fake_upstream.get_budget, patching.MARKER) is record
    assert fake_upstream.get_budget.__wrapped__ is original
    assert patching.revert(patch.key)
    assert fake_upstream.get_budget is original
    assert record.status == "reverted"


def test_apply_is_idempotent(fake_upstream: types.ModuleType) -> None:
    patch = Patch("fake_upstream", "get_budget", _neuron_budget, reason="r")
    first = patching.apply(patch)
    patched = fake_upstream.get_budget
    second = patching.apply(patch)
    assert first is second
    assert fake_upstream.get_budget is patched  # not wrapped twice
    assert fake_upstream.get_budget() == {0: 100, "cpu": 1}


def test_missing_target_is_skipped_with_reason(
    fake_upstream: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    patch = Patch("fake_upstream", "get_max_memory", _neuron_budget, reason="renamed upstream")
    with caplog.at_level(logging.INFO, logger="accelerate_neuron"):
        record = patching.apply(patch)
    assert record.status == "skipped"
    assert "does not exist" in record.detail
    assert "get_max_memory" in caplog.text
    missing_module = patching.apply(Patch("fake_upstream_gone", "f", _neuron_budget, reason="r"))
    assert missing_module.status == "skipped" and "not found" in missing_module.detail
    replaced = patching.apply(
        Patch("fake_upstream", "old_list", _neuron_budget, reason="r", gone="upstream marks its wrappers now")
    )
    assert replaced.status == "skipped" and replaced.detail == "upstream marks its wrappers now"


def test_changed_signature_is_skipped(fake_upstream: types.ModuleType) -> None:
    patch = Patch("fake_upstream", "get_budget", _neuron_budget, reason="r", params=("max_memory", "clean_result"))
    record = patching.apply(patch)
    assert record.status == "skipped"
    assert "clean_result" in record.detail and "signature changed" in record.detail
    assert fake_upstream.get_budget() == {"cpu": 1}


def test_feature_detection_skips_when_upstream_already_does_it(fake_upstream: types.ModuleType) -> None:
    patch = Patch(
        "fake_upstream",
        "get_budget",
        _neuron_budget,
        reason="r",
        needed=lambda original: "upstream already enumerates Neuron" if 0 in original() else None,
    )
    fake_upstream.get_budget = lambda max_memory=None, devices=None: {0: 7, "cpu": 1}
    record = patching.apply(patch)
    assert record.status == "skipped" and record.detail == "upstream already enumerates Neuron"


def test_broken_feature_probe_leaves_upstream_alone(fake_upstream: types.ModuleType) -> None:
    def probe(original):
        raise KeyError("boom")

    record = patching.apply(Patch("fake_upstream", "get_budget", _neuron_budget, reason="r", needed=probe))
    assert record.status == "skipped" and "probe failed" in record.detail


def test_methods_keep_their_descriptor_kind(fake_upstream: types.ModuleType) -> None:
    loader = fake_upstream.Loader
    patching.apply(Patch("fake_upstream", "Loader.load", lambda f: lambda self, p: "neuron " + f(self, p), reason="r"))
    patching.apply(Patch("fake_upstream", "Loader.probe", lambda f: lambda x: f(x) * 2, reason="r"))
    patching.apply(Patch("fake_upstream", "Loader.make", lambda f: lambda cls, x: f(cls, x + 1), reason="r"))
    assert loader().load("m") == "neuron loaded m"
    assert loader.probe(3) == 6 and isinstance(loader.__dict__["probe"], staticmethod)
    assert loader.make(1) == ("Loader", 2) and isinstance(loader.__dict__["make"], classmethod)
    try:
        assert patching.revert_all() >= 3
        assert loader().load("m") == "loaded m" and loader.probe(3) == 3 and loader.make(1) == ("Loader", 1)
    finally:
        # revert_all() also reverted the plugins' real patches: the tests that follow need them back
        activation.reapply_patches()


def test_aliases_follow_only_while_identical(fake_upstream: types.ModuleType) -> None:
    alias_module = sys.modules["fake_upstream_alias"]
    patch = Patch(
        "fake_upstream", "get_budget", _neuron_budget, reason="r", aliases=("fake_upstream_alias.get_budget",)
    )
    record = patching.apply(patch)
    assert alias_module.get_budget is fake_upstream.get_budget
    assert record.aliases == ["fake_upstream_alias.get_budget"]
    patching.revert(patch.key)
    assert alias_module.get_budget() == {"cpu": 1}

    def users_own(max_memory=None, devices=None):
        return "mine"

    alias_module.get_budget = users_own  # rebound by someone else: leave it
    patching.apply(patch)
    assert alias_module.get_budget is users_own


def test_late_alias_is_patched(fake_upstream: types.ModuleType) -> None:
    original = fake_upstream.get_budget
    late = types.ModuleType("fake_upstream_late")
    patch = Patch("fake_upstream", "get_budget", _neuron_budget, reason="r")
    patching.apply(patch)
    late.get_budget = original  # imported the original before the patch
    sys.modules["fake_upstream_late"] = late
    try:
        patching.patch_aliases_now(patch.key, ["fake_upstream_late.get_budget"])
        assert late.get_budget is fake_upstream.get_budget
        patching.revert(patch.key)
        assert late.get_budget is original
    finally:
        del sys.modules["fake_upstream_late"]
