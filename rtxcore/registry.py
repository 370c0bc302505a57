"""Plugin loading and the registry of components they provide.

Entry points of group ``rtx`` are loaded explicitly (never at import time), each inside its own try/except, so a
broken third-party plugin is reported and skipped instead of stopping the server. ``RTX_PLUGINS`` (comma-separated
entry-point names) restricts what loads.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Iterable

import pluggy

from rtxcore import contracts, envs, hookspecs
from rtxcore.errors import PluginError, RtxError

ENTRY_POINT_GROUP = "rtx"
BUILTIN_DISTRIBUTION = "rtx-serve"


@dataclass(frozen=True, slots=True)
class PluginKind:
    name: str
    hook: str
    # The contract's name in rtxcore.contracts; resolved on use, since most contracts import torch and the kinds'
    # names are wanted by commands (``rtx --help``) that run no plugin.
    contract_name: str

    @property
    def contract(self) -> type:
        return getattr(contracts, self.contract_name)


KINDS: dict[str, PluginKind] = {
    kind.name: kind
    for kind in (
        PluginKind("scheduler", "register_schedulers", "Scheduler"),
        PluginKind("eviction_policy", "register_eviction_policies", "EvictionPolicy"),
        PluginKind("sampler", "register_samplers", "Sampler"),
        PluginKind("quantizer", "register_quantizers", "Quantizer"),
        PluginKind("backend", "register_backends", "ExecutionBackend"),
        PluginKind("proposer", "register_proposers", "Proposer"),
        PluginKind("logits_processor", "register_logits_processors", "LogitsProcessor"),
        PluginKind("authenticator", "register_authenticators", "Authenticator"),
    )
}


@dataclass(frozen=True, slots=True)
class ComponentRecord:
    name: str
    kind: str
    cls: type
    # The pluggy plugin (entry point) that registered it.
    plugin: str
    package: str
    version: str

    def capabilities(self) -> dict[str, Any]:
        describe = getattr(self.cls, "describe", None)
        if describe is None:
            return {}
        try:
            return dict(describe())
        except Exception as exc:  # a broken describe() must not break listing
            return {"available": False, "unavailable_reason": f"describe() failed: {exc!r}"}


@dataclass(frozen=True, slots=True)
class PluginFailure:
    plugin: str
    package: str
    error: str


@dataclass(slots=True)
class PluginRegistry:
    components: dict[tuple[str, str], ComponentRecord] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)

    def get(self, kind: str, name: str) -> ComponentRecord:
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(KINDS)}")
        try:
            return self.components[(kind, name)]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            raise PluginError(f"no {kind.replace('_', ' ')} named {name!r} is registered "
                              f"(available: {known})") from None

    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        record = self.get(kind, name)
        try:
            return record.cls(*args, **kwargs)
        except RtxError:  # the plugin's own account of what is wrong (a setting, a missing device)
            raise
        except Exception as exc:  # a third-party plugin's bug: named, not a traceback from deep inside it
            raise PluginError(f"{kind.replace('_', ' ')} plugin {name!r} ({record.package}) failed to start: "
                              f"{type(exc).__name__}: {exc}") from exc

    def names(self, kind: str) -> list[str]:
        return sorted(n for (k, n) in self.components if k == kind)

    def records(self) -> list[ComponentRecord]:
        return sorted(self.components.values(), key=lambda r: (r.kind, r.name))


def make_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def allowed_plugins_from_env() -> AbstractSet[str] | None:
    """The entry-point names ``RTX_PLUGINS`` allows; None when it is unset (load all)."""
    return envs.RTX_PLUGINS.get()


def load_plugins(
    *,
    load_entrypoints: bool = True,
    allow: AbstractSet[str] | None = None,
    extra: Iterable[tuple[str, object]] = (),
) -> PluginRegistry:
    """Load plugins and collect what they register.

    :param load_entrypoints: load entry points of group ``rtx`` from installed distributions.
    :param allow: entry-point names to load; ``None`` reads ``RTX_PLUGINS`` (unset: load all).
    :param extra: ``(name, plugin_object)`` pairs registered directly, e.g. inline plugins in tests.
    """
    if allow is None:
        allow = allowed_plugins_from_env()
    pm = make_plugin_manager()
    registry = PluginRegistry()
    origins: dict[str, tuple[str, str]] = {}

    if load_entrypoints:
        for ep in _entry_points():
            if allow is not None and ep.name not in allow:
                continue
            package, version = _dist_of(ep)
            try:
                module = ep.load()
                pm.register(module, name=ep.name)
                _check_hook_names(pm, ep.name)
            except Exception as exc:
                registry.failures.append(PluginFailure(ep.name, package, f"{type(exc).__name__}: {exc}"))
                continue
            origins[ep.name] = (package, version)
    for name, plugin in extra:
        try:
            pm.register(plugin, name=name)
            _check_hook_names(pm, name)
        except Exception as exc:
            registry.failures.append(PluginFailure(name, "<inline>", f"{type(exc).__name__}: {exc}"))
            continue
        origins[name] = ("<inline>", "")

    for kind in KINDS.values():
        for impl in getattr(pm.hook, kind.hook).get_hookimpls():
            _call_registration(registry, kind, impl, origins.get(impl.plugin_name, ("<unknown>", "")))
    return registry


def _check_hook_names(pm: pluggy.PluginManager, name: str) -> None:
    """Refuse the plugin just registered as ``name`` if it implements a hook that does not exist (a typo would
    otherwise register nothing, silently): it is unregistered and reported like a plugin that fails to import, so
    the others still load and ``rtx plugins test`` fails on it (pluggy's ``check_pending``, one plugin at a time)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        plugin = pm.unregister(name=name)
        known = [kind.hook for kind in KINDS.values()]
        hooks = sorted(h for h in dir(plugin) if h not in known and pm.parse_hookimpl_opts(plugin, h) is not None)
        hints = [f"{h!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(h, known, 1)) else
                 repr(h) for h in hooks]
        raise PluginError(f"implements a hook that does not exist: {', '.join(hints) or 'unknown'}; the hooks are "
                          f"{', '.join(known)}") from None


def _call_registration(registry: PluginRegistry, kind: PluginKind, impl: Any, origin: tuple[str, str]) -> None:
    package, version = origin
    plugin = impl.plugin_name

    def register(name: str, cls: type) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {kind.name} with an invalid name {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, kind.contract)):
            raise PluginError(
                f"plugin {plugin!r} registered {name!r} as a {kind.name}, but {cls!r} is not a subclass of "
                f"{kind.contract.__module__}.{kind.contract.__qualname__}"
            )
        if inspect.isabstract(cls):  # it could never be built: refused here, where the plugin is named
            missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
            raise PluginError(f"plugin {plugin!r} registered {name!r} as a {kind.name}, but {cls.__qualname__} does "
                              f"not implement {missing} of the contract")
        existing = registry.components.get((kind.name, name))
        if existing is not None:
            raise PluginError(
                f"{kind.name} {name!r} from plugin {plugin!r} ({package}) is refused: the name is already "
                f"registered by plugin {existing.plugin!r} ({existing.package} {existing.version})"
            )
        registry.components[(kind.name, name)] = ComponentRecord(name, kind.name, cls, plugin, package, version)

    try:
        impl.function(register=register)
    except Exception as exc:
        registry.failures.append(PluginFailure(plugin, package, f"{type(exc).__name__}: {exc}"))


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    seen: set[tuple[str, str]] = set()
    unique = []
    # A distribution installed twice on sys.path (e.g. editable + regular) yields its entry points twice.
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = (ep.name, ep.value)
        if key not in seen:
            seen.add(key)
            unique.append(ep)
    # Built-ins register first and the rest in a fixed order, so a name clash is always resolved the same way
    # (the first registration wins) whatever the order of sys.path.
    return sorted(unique, key=lambda ep: (_dist_of(ep)[0] != BUILTIN_DISTRIBUTION, _dist_of(ep)[0], ep.name))


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", ""
    return dist.metadata["Name"], dist.version
