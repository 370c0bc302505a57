"""Plugin loading: registration checks, duplicate refusal, misspelled hooks, the allow-list."""

from __future__ import annotations

import inspect

import pytest

from rtxcore import hookspecs
from rtxcore.contracts import EvictionPolicy
from rtxcore.errors import PluginError
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import KINDS, load_plugins
from tests.helpers import REPO


class FIFOPolicy(EvictionPolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: list[int] = []

    def add(self, block_id):
        self.order.append(block_id)

    def remove(self, block_id):
        self.order.remove(block_id)

    def evict(self):
        return self.order.pop(0) if self.order else None

    def __len__(self):
        return len(self.order)

    def __contains__(self, block_id):
        return block_id in self.order


class InlinePlugin:
    @hookimpl
    def register_eviction_policies(self, register):
        register("fifo", FIFOPolicy)


def test_inline_plugin_registers_next_to_builtins():
    registry = load_plugins(extra=[("inline", InlinePlugin())])
    rec = registry.get("eviction_policy", "fifo")
    assert rec.cls is FIFOPolicy and rec.plugin == "inline"
    assert registry.get("eviction_policy", "lru").package == "rtx-serve"
    assert isinstance(registry.create("eviction_policy", "fifo", 8), FIFOPolicy)


def test_duplicate_name_is_refused_and_first_wins():
    class Again:
        @hookimpl
        def register_eviction_policies(self, register):
            register("fifo", dict)

    class Dupe:
        @hookimpl
        def register_eviction_policies(self, register):
            register("fifo", FIFOPolicy)

    class Unfinished:
        @hookimpl
        def register_eviction_policies(self, register):
            class Half(EvictionPolicy):
                def add(self, block_id):
                    pass

            register("half", Half)

    registry = load_plugins(load_entrypoints=False, extra=[("a", InlinePlugin()), ("b", Dupe()), ("c", Again()),
                                                           ("d", Unfinished())])
    assert registry.get("eviction_policy", "fifo").plugin == "a"
    errors = {f.plugin: f.error for f in registry.failures}
    assert "already registered by plugin 'a'" in errors["b"]
    assert "not a subclass" in errors["c"]
    assert "Half does not implement __contains__, __len__, evict, remove of the contract" in errors["d"]
    assert "half" not in registry.names("eviction_policy")


def test_misspelled_hook_is_a_failure_of_that_plugin_alone():
    class Typo:
        @hookimpl
        def register_eviction_policys(self, register):
            register("never", FIFOPolicy)

        @hookimpl
        def register_schedulers(self, register):  # a right one beside it: the plugin is refused whole
            register("never-either", dict)

    registry = load_plugins(extra=[("typo", Typo()), ("inline", InlinePlugin())])
    (failure,) = registry.failures
    assert failure.plugin == "typo" and "'register_eviction_policys' (did you mean " \
        "'register_eviction_policies'?)" in failure.error
    assert registry.get("eviction_policy", "fifo").plugin == "inline"  # the others load, built-ins too
    assert "never" not in registry.names("eviction_policy") and "never-either" not in registry.names("scheduler")
    assert registry.get("scheduler", "fcfs").package == "rtx-serve"


def test_unknown_component_lists_what_exists():
    registry = load_plugins()
    with pytest.raises(PluginError, match="available: .*fcfs"):
        registry.get("scheduler", "nope")


def test_allow_list_restricts_entry_points():
    registry = load_plugins(allow={"lru"})
    assert registry.names("eviction_policy") == ["lru"]
    assert registry.names("scheduler") == []


def test_every_kind_has_a_documented_typed_hook():
    for kind in KINDS.values():
        spec = getattr(hookspecs, kind.hook)
        doc = inspect.getdoc(spec)
        assert doc and ":param register:" in doc and ":returns:" in doc, kind.hook
        assert "register" in inspect.signature(spec).parameters
        assert inspect.signature(spec).parameters["register"].annotation != inspect.Parameter.empty


def test_every_hookspec_is_documented_in_docs_plugins_md():

    doc = (REPO / "docs" / "plugins.md").read_text()
    hooks = [name for name, obj in vars(hookspecs).items() if name.startswith("register_") and callable(obj)]
    assert sorted(hooks) == sorted(kind.hook for kind in KINDS.values())
    for hook in hooks:
        assert f"### `{hook}(register)`" in doc, f"docs/plugins.md lacks a section for {hook}"
    for kind in KINDS.values():
        assert kind.contract.__name__ in doc
