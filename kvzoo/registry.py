"""Policies, retrievers, name prefixes, model-family adapters and executors by name: ``get("streaming_llm",
ratio=4)`` returns a configured policy.

Each kind comes through its pluggy hook (:mod:`kvzoo.hookspecs`) and is discovered by :func:`_discover` (what is
particular to a kind is in :data:`_KINDS`): kvzoo's own from ``registry.toml``, third parties' from the ``kvzoo``
entry-point group or :func:`register_plugin`. Discovery runs on the first lookup and is cached.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from kvzoo import hookspecs
from kvzoo.hookspecs import PROJECT_NAME, hookimpl

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli (a dependency there) is the same parser
    import tomli as tomllib

if TYPE_CHECKING:
    from kvzoo.framework.policy import Policy
    from kvzoo.framework.retriever import Retriever

REGISTRY_TOML = Path(__file__).with_name("registry.toml")
ENTRY_POINT_GROUP = PROJECT_NAME
BUILTIN_PLUGIN_NAME = "kvzoo.builtins"


class RegistryError(Exception):
    """The set of plugins is inconsistent: a name claimed twice, a malformed plugin or manifest."""


class PluginWarning(UserWarning):
    """An installed plugin (a ``kvzoo`` entry point) that kvzoo left out: it failed to import, to register or to list
    what it provides. The message names the entry point, its distribution and the error; the rest of kvzoo works."""


class UnknownPolicyError(KeyError):
    """No policy of that name. A KeyError whose message reads as a sentence (no repr quoting)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# --- the built-in plugin -------------------------------------------------------------------------


def read_manifest(path: Path = REGISTRY_TOML, kind: str = "policy") -> list[dict[str, Any]]:
    """The ``[[policy]]`` (or ``[[retriever]]``, ``[[namespace]]``) tables of ``registry.toml``, in file order, checked."""
    try:
        with path.open("rb") as f:
            manifest = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RegistryError(f"cannot read the built-in manifest {path}: {exc}") from exc
    entries = manifest.get(kind, None if kind == "policy" else [])
    if not isinstance(entries, list) or (kind == "policy" and not entries):
        raise RegistryError(f"{path} must list the built-in {kind}s as [[{kind}]] tables")
    for i, entry in enumerate(entries):
        for key in ("name", "module"):
            if not isinstance(entry.get(key), str):
                raise RegistryError(
                    f"{path}: [[{kind}]] #{i + 1} ({entry.get('name', '?')!r}) needs {key} = <str> "
                    "(keys: name, module = 'package.module:Class')"
                )
    return entries


def _import_object(spec: str) -> Any:
    """Import ``"package.module:Attr"`` (dots after the colon walk attributes)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise RegistryError(f"module spec {spec!r} must read 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"cannot import {spec!r} listed in {REGISTRY_TOML.name}: {exc}") from exc
    return obj


class BuiltinPolicies:
    """The plugin that provides kvzoo's own policies, retrievers, adapters and executors: the classes
    ``registry.toml`` lists."""

    def __init__(self, manifest_path: Path = REGISTRY_TOML) -> None:
        self.manifest_path = manifest_path

    def _classes(self, kind: str) -> list[type]:
        classes = []
        for entry in read_manifest(self.manifest_path, kind):
            cls = _import_object(entry["module"])
            if getattr(cls, "name", None) != entry["name"]:
                raise RegistryError(
                    f"{self.manifest_path.name}: entry {entry['name']!r} points at {entry['module']}, whose "
                    f"name is {getattr(cls, 'name', None)!r}; make the two agree"
                )
            classes.append(cls)
        return classes

    @hookimpl
    def kvzoo_policies(self) -> list[type[Policy]]:
        return self._classes("policy")

    @hookimpl
    def kvzoo_retrievers(self) -> list[type[Retriever]]:
        return self._classes("retriever")

    @hookimpl
    def kvzoo_adapters(self) -> list[type]:
        return self._classes("adapter")

    @hookimpl
    def kvzoo_executors(self) -> list[type]:
        return self._classes("executor")

    @hookimpl
    def kvzoo_namespaces(self) -> dict[str, Any]:
        """Each ``[[namespace]]``'s resolver, imported when a name in it is first looked up."""
        return {entry["name"]: lambda name, spec=entry["module"]: _import_object(spec)(name)
                for entry in read_manifest(self.manifest_path, "namespace")}


def builtin_classes(kind: str) -> list[type]:
    """The classes ``registry.toml`` lists as ``kind`` (``"policy"``, ``"executor"``, ...), imported and checked as the
    built-in plugin registers them, without discovering any other plugin (nor importing the policies, for another
    kind: the CLI's parser takes the executors' options from here without torch)."""
    return BuiltinPolicies()._classes(kind)


def plugins_registered() -> list[str]:
    """The names of the plugins given to :func:`register_plugin` in this process (entry points not included)."""
    return [name for _, name in _registered]


# --- discovery: one path for every kind of thing a plugin provides -------------------------------


@dataclass(frozen=True)
class _Entry:
    obj: Any  # the class (a namespace's resolver, for a namespace)
    plugin: str  # the pluggy plugin name
    source: str  # where it came from, for messages and info()


@dataclass(frozen=True)
class _Kind:
    """One kind of thing plugins provide: the hook returning them, and how one is checked."""

    hook: str
    returns: str  # what the hook must return, for the message when it does not
    claims: Callable[[Any, str], dict[str, Any]]  # one returned item, checked -> {key: object} ("where" names the plugin)
    noun: str = ""  # what a key is, for the message when two plugins claim one
    mapping: bool = False  # the hook returns a mapping (its items are what is claimed), not a list
    eager: bool = True  # built with the policy table, else on its first lookup (adapters import transformers)


def _class_path(cls: Any) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _named_class(cls: Any, where: str, hook: str, base: type | None = None, what: str = "a class") -> type:
    """``cls`` if it is a class (a subclass of ``base``, if given) with a non-empty ``name``; else a RegistryError."""
    if not inspect.isclass(cls) or (base is not None and not issubclass(cls, base)):
        classes = f"subclasses of {_class_path(base)}" if base else "classes"
        raise RegistryError(f"{where}: {hook}() returned {cls!r}, which is not {what}; return named {classes} "
                            "(class attribute name: ClassVar[str])")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise RegistryError(f"{where}: class {_class_path(cls)} has no name; set the class attribute "
                            f"name: ClassVar[str] = '<name>' (a non-empty string): what {hook}() returns is named")
    return cls


def _policy_claims(cls: Any, where: str) -> dict[str, Any]:
    """A policy class, checked: named, concrete, valid layouts and observations."""
    from kvzoo.framework.policy import LAYOUTS, SCHEDULES, Policy, observations

    _named_class(cls, where, "kvzoo_policies", Policy, "a Policy subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise RegistryError(f"{where}: policy {cls.name!r} ({_class_path(cls)}) does not implement {missing}")
    if not cls.layouts or not set(cls.layouts) <= set(LAYOUTS):
        raise RegistryError(f"{where}: policy {cls.name!r} has layouts={cls.layouts!r}; use a non-empty subset of {LAYOUTS}")
    if cls.schedule not in SCHEDULES:  # a class default (a dataclass field's too); Policy.validate checks instances
        raise RegistryError(f"{where}: policy {cls.name!r} ({_class_path(cls)}) has schedule={cls.schedule!r}; use one "
                            f"of {', '.join(SCHEDULES)}")
    try:
        observations(cls.observes, f"{where}: policy {cls.name!r}")
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
    return {cls.name: cls}


def _retriever_claims(cls: Any, where: str) -> dict[str, Any]:
    from kvzoo.framework.retriever import Retriever

    return {_named_class(cls, where, "kvzoo_retrievers", Retriever, "a Retriever subclass").name: cls}


def _namespace_claims(item: tuple[Any, Any], where: str) -> dict[str, Any]:
    prefix, resolver = item
    if not callable(resolver) or not str(prefix).isidentifier():
        raise RegistryError(f"{where}: kvzoo_namespaces() must map identifiers to callables, got {prefix!r}: {resolver!r}")
    return {prefix: resolver}


def _adapter_claims(cls: Any, where: str) -> dict[str, Any]:
    """The model types an adapter class serves, checked against :class:`kvzoo.framework.adapters.Adapter`."""
    from kvzoo.framework.adapters.base import adapter_problem

    _named_class(cls, where, "kvzoo_adapters")
    problem = adapter_problem(cls)
    if problem is not None:
        raise RegistryError(f"{where}: adapter {_class_path(cls)} {problem}")
    return dict.fromkeys(cls.model_types, cls)


def _executor_claims(cls: Any, where: str) -> dict[str, Any]:
    """An executor class, checked: it needs ``summary``, ``add_arguments`` and ``run``."""
    _named_class(cls, where, "kvzoo_executors")
    missing = [attr for attr in ("summary", "add_arguments", "run") if not hasattr(cls, attr)]
    if missing:
        raise RegistryError(f"{where}: executor {_class_path(cls)} has no {', '.join(missing)}; an executor class "
                            "has name, summary, add_arguments(group) and run(work, emit) (kvzoo.bench.executors.Executor)")
    return {cls.name: cls}


_KINDS: dict[str, _Kind] = {
    "policy": _Kind("kvzoo_policies", "a list of Policy subclasses", _policy_claims, "policy name "),
    "retriever": _Kind("kvzoo_retrievers", "a list of Retriever subclasses", _retriever_claims, "retriever name "),
    "namespace": _Kind("kvzoo_namespaces", "a mapping of identifiers to resolvers", _namespace_claims,
                       "policy namespace ", mapping=True),
    "adapter": _Kind("kvzoo_adapters", "a list of adapter classes", _adapter_claims, eager=False),
    "executor": _Kind("kvzoo_executors", "a list of executor classes", _executor_claims, eager=False),
}

_registered: list[tuple[object, str]] = []  # plugins given to register_plugin(), in order
_plugins: pluggy.PluginManager | None = None  # the plugins of the current tables; None until the first lookup
_tables: dict[str, dict[str, _Entry]] = {}  # kind -> key -> entry, each built from _plugins on its first lookup
_dists: dict[str, Any] = {}  # entry-point name -> its distribution (importlib.metadata), for messages
_entry_points: set[str] = set()  # the entry-point plugins registered (left out of a kind where their hook fails)
_left_out: dict[str, str] = {}  # entry-point plugin name -> why it (or one of its hooks) was left out


def _hook_result(impl: Any, where: str, hook: str) -> Any:
    """What one plugin's ``hook`` implementation returns; its exception as a RegistryError naming the plugin."""
    try:
        return impl.function()
    except RegistryError:
        raise
    except Exception as exc:
        raise RegistryError(f"{where}: {hook}() raised {type(exc).__name__}: {exc}") from exc


def _describe_plugin(plugin_name: str, dist: Any) -> str:
    if plugin_name == BUILTIN_PLUGIN_NAME:
        return f"built-in plugin {plugin_name!r} ({REGISTRY_TOML.name})"
    if dist is not None:
        return f"plugin {plugin_name!r} (entry point of {dist.metadata['Name']} {dist.version})"
    return f"plugin {plugin_name!r}"


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except ValueError as exc:  # pluggy: name taken, or the same object under another name
        raise RegistryError(f"cannot register plugin {name!r}: {exc}") from exc
    except pluggy.PluginValidationError as exc:
        raise RegistryError(f"plugin {name!r} does not match the kvzoo hook spec: {exc}") from exc


def _leave_out(name: str, why: str, what: str = "it") -> None:
    """Record and warn (:class:`PluginWarning`) that entry-point plugin ``name`` (or ``what`` of it) is left out,
    ``why`` naming the plugin and the error."""
    dist = _dists.get(name)
    fix = f"fix or uninstall {dist.metadata['Name']}" if dist is not None else "fix or uninstall it"
    message = f"{why}; {what} is left out and the rest of kvzoo works without it ({fix})"
    _left_out[name] = message
    warnings.warn(message, PluginWarning, stacklevel=2)


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Register every ``kvzoo`` entry point of the installed distributions; one that fails to import, to register or
    to match the hook spec is left out (:func:`_leave_out`) -- one broken plugin must not take the others down."""
    import importlib.metadata

    for dist in list(importlib.metadata.distributions()):
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or pm.has_plugin(ep.name) or ep.name in _left_out:
                continue  # a name already taken: the first distribution on the path wins, as pluggy does
            _dists[ep.name] = dist
            where = _describe_plugin(ep.name, dist)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - whatever its import raises, the plugin is what failed
                _leave_out(ep.name, f"{where}: importing {ep.value} raised {type(exc).__name__}: {exc}")
                continue
            try:
                pm.register(plugin, name=ep.name)
                pm.check_pending()  # a hook kvzoo does not define (a misspelt name), this plugin's alone
            except (ValueError, pluggy.PluginValidationError) as exc:
                if pm.has_plugin(ep.name):
                    pm.unregister(name=ep.name)
                _leave_out(ep.name, f"{where}: {ep.value} cannot be registered ({exc})")
                continue
            _entry_points.add(ep.name)


def _plugin_manager() -> pluggy.PluginManager:
    """The built-in plugin, the entry-point plugins (those that load) and the registered ones, checked against the
    hook spec."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    _register(pm, BuiltinPolicies(), BUILTIN_PLUGIN_NAME)
    _load_entry_points(pm)
    for plugin, name in _registered:
        _register(pm, plugin, name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        hooks = ", ".join(f"{kind.hook}()" for kind in _KINDS.values())
        raise RegistryError(f"{exc}; the kvzoo hooks are {hooks}") from exc
    return pm


def _discover(pm: pluggy.PluginManager, kind: _Kind) -> dict[str, _Entry]:
    """key -> entry from every plugin's ``kind.hook()`` (the built-in plugin's in ``registry.toml``'s order, then the
    others' by key), each item checked by ``kind.claims``; a key claimed twice is a RegistryError naming both plugins.
    An entry-point plugin whose hook raises or returns what is not valid is left out of this kind (a
    :class:`PluginWarning`); the built-in plugin and a registered one raise the RegistryError."""
    impls = sorted(getattr(pm.hook, kind.hook).get_hookimpls(),
                   key=lambda impl: (impl.plugin_name != BUILTIN_PLUGIN_NAME, impl.plugin_name))
    builtins: dict[str, _Entry] = {}
    others: dict[str, _Entry] = {}
    for impl in impls:
        where = _describe_plugin(impl.plugin_name, _dists.get(impl.plugin_name))
        try:
            claimed = _claims(impl, kind, where)
        except RegistryError as exc:
            if impl.plugin_name not in _entry_points:
                raise
            _leave_out(impl.plugin_name, str(exc), f"what it provides through {kind.hook}()")
            continue
        for key, obj in claimed:
            what = "class" if inspect.isclass(obj) else "resolver"
            entry = _Entry(obj, impl.plugin_name, f"{where}, {what} {_class_path(obj)}")
            known = builtins.get(key) or others.get(key)
            if known is not None and (known.obj, known.plugin) == (obj, entry.plugin):
                continue  # one plugin listing a class twice
            if known is not None:
                clash = (f"{kind.hook}: {kind.noun}{key!r} is claimed twice: by {known.source} and by {entry.source}; "
                         "each must be unique, so rename one (a class's attribute `name`) or uninstall one of the "
                         "plugins")
                if impl.plugin_name not in _entry_points:
                    raise RegistryError(clash)
                _leave_out(impl.plugin_name, clash, f"its {key!r}")  # the first claim stands
                continue
            (builtins if impl.plugin_name == BUILTIN_PLUGIN_NAME else others)[key] = entry
    return {**builtins, **dict(sorted(others.items()))}


def _claims(impl: Any, kind: _Kind, where: str) -> list[tuple[str, Any]]:
    """What one plugin's ``kind.hook()`` claims, each item checked (a RegistryError naming the plugin otherwise)."""
    result = _hook_result(impl, where, kind.hook)
    if result is None:
        return []
    if isinstance(result, (str, bytes)) or not isinstance(result, Mapping if kind.mapping else Iterable):
        raise RegistryError(f"{where}: {kind.hook}() must return {kind.returns}, got {result!r}")
    return [pair for item in (result.items() if kind.mapping else result) for pair in kind.claims(item, where).items()]


def _table(kind: str = "policy") -> dict[str, _Entry]:
    """The table of ``kind``: discovery runs on the first lookup (the plugins and every eager kind's table) and is
    cached until :func:`reload`, :func:`reset` or a plugin (un)registered."""
    global _plugins
    if _plugins is None:
        try:
            _plugins = _plugin_manager()
            for name, eager_kind in _KINDS.items():
                if eager_kind.eager:
                    _tables[name] = _discover(_plugins, eager_kind)
        except Exception:
            _forget()
            raise
    if kind not in _tables:
        _tables[kind] = _discover(_plugins, _KINDS[kind])
    return _tables[kind]


def _forget() -> None:
    global _plugins
    _plugins = None
    _tables.clear()
    _dists.clear()
    _entry_points.clear()
    _left_out.clear()


def broken_plugins() -> dict[str, str]:
    """The installed plugins kvzoo left out (by entry-point name), each with why: the same words as their
    :class:`PluginWarning`. Empty when every plugin loaded."""
    _table()
    return dict(_left_out)


def adapters() -> dict[str, type]:
    """Every registered model type with the adapter class that serves it."""
    return {model_type: entry.obj for model_type, entry in _table("adapter").items()}


def adapter_class(model_type: str | None) -> type:
    """The adapter class serving ``model_type``; a ValueError naming the supported model types if none does."""
    table = adapters()
    if model_type not in table:
        raise ValueError(f"kvzoo does not support model_type={model_type!r}: no adapter serves it; supported: {', '.join(table)} "
                         "(a plugin adds a model family through the kvzoo_adapters hook)")
    return table[model_type]


def executors() -> dict[str, str]:
    """Every registered executor name with its one-line summary (``local`` first)."""
    return {name: entry.obj.summary for name, entry in _table("executor").items()}


def executor_class(name: str) -> type:
    """The executor class registered as ``name``; a ValueError naming the valid ones if none is."""
    table = _table("executor")
    if name not in table:
        raise ValueError(f"unknown executor {name!r}: valid executors are {', '.join(table)}")
    return table[name].obj


def namespaces() -> list[str]:
    """The prefixes of namespaced policy names (``kvpress`` for ``kvpress:KnormPress``)."""
    return list(_table("namespace"))


def _namespaced(name: str) -> _Entry:
    """The entry of ``prefix:rest`` from the prefix's resolver; its errors become :class:`UnknownPolicyError`."""
    from kvzoo.framework.policy import Policy

    prefix, _, rest = name.partition(":")
    table = _table("namespace")
    if prefix not in table:
        raise UnknownPolicyError(
            f"unknown policy {name!r}: {prefix!r} is not a policy namespace; namespaces: "
            f"{', '.join(table) or 'none'} (e.g. 'kvpress:KnormPress'), policies: {', '.join(_table())}"
        )
    resolver, plugin = table[prefix].obj, table[prefix].plugin
    try:
        cls = resolver(rest)
    except ImportError as exc:  # the namespace's package is missing: its message says how to install it
        raise UnknownPolicyError(f"policy {name!r} is not available: {exc}") from exc
    except KeyError as exc:
        raise UnknownPolicyError(f"unknown policy {name!r}: {exc.args[0] if exc.args else exc}") from exc
    if not (inspect.isclass(cls) and issubclass(cls, Policy) and cls.name == name):
        raise RegistryError(f"namespace {prefix!r} of plugin {plugin!r} resolved {name!r} to {cls!r}; it must return a "
                            f"Policy subclass whose name is {name!r}")
    return _Entry(cls, plugin, f"namespace {prefix!r} of {_describe_plugin(plugin, _dists.get(plugin))}, class "
                               f"{_class_path(cls)}")


def reload() -> None:
    """Forget the cached tables and discover again now (entry points re-read; registered plugins kept)."""
    _forget()
    _table()


def reset() -> None:
    """Unregister every plugin given to :func:`register_plugin` and forget the cached tables."""
    _registered.clear()
    _forget()


def register_plugin(plugin: ModuleType | object, name: str | None = None) -> str:
    """Register a plugin (a module or object with ``@hookimpl`` functions of :mod:`kvzoo.hookspecs`) without installing
    it; returns its name (``name``, else the module's ``__name__``, else its type and id).

    The registry is rebuilt at once, so a bad plugin fails here with a :class:`RegistryError` and is not kept (the
    registry stays as it was). Registering the same object again is a no-op.
    """
    for known, known_name in _registered:
        if known is plugin:
            return known_name
    if name is None:
        name = getattr(plugin, "__name__", None) or f"{type(plugin).__module__}.{type(plugin).__qualname__}@{id(plugin):#x}"
    if name == BUILTIN_PLUGIN_NAME or any(name == known_name for _, known_name in _registered):
        raise RegistryError(f"a plugin named {name!r} is already registered; pass register_plugin(plugin, name=...)")
    _registered.append((plugin, name))
    _forget()
    try:
        _table()
        for kind_name, kind in _KINDS.items():  # check the lazy tables it adds to now, not at their next lookup
            if any(impl.plugin_name == name for impl in getattr(_plugins.hook, kind.hook).get_hookimpls()):
                _table(kind_name)
    except Exception:
        _registered.pop()
        _forget()
        raise
    return name


def unregister_plugin(plugin_or_name: ModuleType | object | str) -> None:
    """Undo :func:`register_plugin` (by the plugin object or its name); KeyError if it is not registered."""
    for i, (plugin, name) in enumerate(_registered):
        if plugin is plugin_or_name or name == plugin_or_name:
            del _registered[i]
            _forget()
            return
    names = ", ".join(name for _, name in _registered) or "none"
    raise KeyError(f"{plugin_or_name!r} is not a registered plugin (registered: {names})")


# --- lookups -------------------------------------------------------------------------------------


def _entry(name: str) -> _Entry:
    table = _table()
    try:
        return table[name]
    except (KeyError, TypeError):
        pass
    if isinstance(name, str) and ":" in name:
        return _namespaced(name)
    own = _left_out_plugin_of(name)
    if own is not None:  # the plugin of that name (or distribution) is installed and was left out: say why
        raise UnknownPolicyError(f"policy {name!r} is not available: {_left_out[own]}")
    close = difflib.get_close_matches(str(name), list(table), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else "."
    missing = "".join(f"; a plugin left out (the policy may be one of its): {why}" for why in _left_out.values())
    raise UnknownPolicyError(
        f"unknown policy {name!r}{hint} Available policies: {', '.join(table)} "
        f"(kvzoo.registry.available() lists them with summaries){missing}"
    )


def _left_out_plugin_of(name: Any) -> str | None:
    """The left-out entry-point plugin whose entry-point or distribution name is ``name`` (``-``/``_`` alike)."""
    wanted = str(name).replace("-", "_").lower()
    for plugin in _left_out:
        dist = _dists.get(plugin)
        names = {plugin, dist.metadata["Name"] if dist is not None else plugin}
        if wanted in {n.replace("-", "_").lower() for n in names}:
            return plugin
    return None


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name``; :class:`UnknownPolicyError` (a KeyError) if none."""
    return _entry(name).obj


def available() -> dict[str, str]:
    """Every registered policy name with its one-line summary: built-ins first, then plugins' by name."""
    return {name: entry.obj.summary for name, entry in _table().items()}


def _parameters(cls: type[Policy]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _names_policy(exc: Exception, name: str) -> Exception:
    """``exc`` if its message names the policy, else the same exception type prefixed with the name."""
    message = str(exc)
    if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message):
        return exc
    try:
        return type(exc)(f"{name}: {message}")
    except Exception:  # an exception type whose constructor takes other arguments
        return (TypeError if isinstance(exc, TypeError) else ValueError)(f"{name}: {message}")


def get(name: str, **params: Any) -> Policy:
    """A configured instance of the policy ``name``: ``get("streaming_llm", ratio=4, sinks=8)``; ``params`` are its
    dataclass fields. An unknown name is an :class:`UnknownPolicyError` (a KeyError), an unknown parameter a
    TypeError, and the policy's own errors for a bad value are prefixed with its name."""
    cls = policy_class(name)
    valid = [f.name for f in _parameters(cls)]
    unknown = [p for p in params if p not in valid]
    if unknown:
        close = {p: difflib.get_close_matches(p, valid, n=1, cutoff=0.6) for p in unknown}
        if len(unknown) == 1:
            hints = f"; did you mean {close[unknown[0]][0]!r}?" if close[unknown[0]] else "."
        else:
            hints = "".join(f"; did you mean {m[0]!r} for {p!r}?" for p, m in close.items() if m) or "."
        raise TypeError(
            f"{name}: unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}{hints} "
            f"Valid parameters of {name}: {', '.join(valid)}"
        )
    try:
        policy = cls(**params)
    except (TypeError, ValueError) as exc:
        named = _names_policy(exc, name)
        if named is exc:
            raise
        raise named from exc
    _check_retriever_name(policy)
    return policy


def _check_retriever_name(policy: Policy) -> None:
    if isinstance(policy.retriever, str) and policy.retriever not in _table("retriever"):
        valid = ", ".join(_table("retriever"))
        raise ValueError(f"{policy.name}: retriever={policy.retriever!r} is not a retriever; valid: {valid} "
                         "or None (eviction only)")


def resolve(policy: Policy | str | None) -> Policy:
    """A Policy from a Policy (as it is), a registered name or spec (``"quest(gqa=group)"``), or None (``full``).

    The one place names become policies for the framework (``TieredCache(model, "snapkv")``).
    """
    from kvzoo.framework.policy import Policy

    if policy is None:
        return get("full")
    if isinstance(policy, str):
        return get_spec(policy)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a kvzoo Policy, a registered name (see kvzoo.registry.available()) or None, "
            f"got {type(policy).__name__}"
        )
    _check_retriever_name(policy)
    return policy


def retrievers() -> dict[str, str]:
    """Every registered retriever name with the first line of its class's docstring."""
    return {name: (entry.obj.__doc__ or "").strip().splitlines()[0] for name, entry in _table("retriever").items()}


def retriever_class(name: str) -> type[Retriever]:
    table = _table("retriever")
    if name not in table:
        raise KeyError(f"unknown retriever {name!r}; valid: {', '.join(table)}")
    return table[name].obj


def build_retriever(spec: str | Retriever | None, **params: Any) -> Retriever | None:
    """A configured retriever from a registered name (with ``params``), a Retriever object, or None."""
    from kvzoo.framework.retriever import Retriever

    if spec is None or isinstance(spec, Retriever):
        if params:
            raise TypeError("retriever parameters need a retriever name")
        return spec
    cls = retriever_class(spec)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise TypeError(f"retriever {spec!r}: unknown parameter(s) {unknown}; valid: {sorted(fields)}")
    return cls(**params)


def check_retriever_params(policy: Policy, retriever: Retriever | None) -> None:
    """ValueError when a retriever object disagrees with a setting the policy also holds (``page_size``)."""
    if retriever is None:
        return
    for name, value in ((name, getattr(policy, name)) for name in policy.retriever_fields):
        if name in getattr(retriever, "__dataclass_fields__", {}) and getattr(retriever, name) != value:
            raise ValueError(
                f"policy {policy.name!r} has {name}={value!r} but its retriever has {name}={getattr(retriever, name)!r}; "
                f"give the retriever by name (retriever={retriever.name!r}) to take the policy's, or make them equal"
            )


_SPEC = re.compile(r"^\s*([A-Za-z_][\w.:-]*)\s*(?:\((.*)\))?\s*$")


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"quest(gqa=group, page_size=8)"`` -> ``("quest", {"gqa": "group", "page_size": 8})``: values are Python
    literals or, failing that, plain strings. How the leaderboard and the CLI name a configured variant."""
    match = _SPEC.match(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"policy spec {spec!r} is not 'name' or 'name(key=value, ...)', e.g. 'quest(gqa=group)'")
    name, body = match.group(1), match.group(2)
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (body or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"policy spec {spec!r}: {item!r} is not key=value")
        try:
            params[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            params[key.strip()] = value.strip()
    return name, params


def get_spec(spec: str, **params: Any) -> Policy:
    """:func:`get` from a spec string (:func:`parse_spec`); ``params`` are added (a clash is an error)."""
    name, own = parse_spec(spec)
    clash = sorted(set(own) & set(params))
    if clash:
        again = ", ".join(f"{key}={params[key]!r}" for key in clash)
        raise TypeError(f"policy spec {spec!r} sets {', '.join(clash)}, given again as {again}: give each once")
    return get(name, **own, **params)


def info(name: str) -> dict[str, Any]:
    """What the registry knows of ``name``: summary, paper, layouts, parameter defaults, source."""
    entry = _entry(name)
    cls = entry.obj
    defaults: dict[str, Any] = {}
    for f in _parameters(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return {
        "name": cls.name,
        "summary": cls.summary,
        "paper": cls.paper,
        "layouts": list(cls.layouts),
        "defaults": defaults,
        "parameters": [f.name for f in _parameters(cls)],
        "source": entry.source,
        "plugin": entry.plugin,
        "class": _class_path(cls),
    }
