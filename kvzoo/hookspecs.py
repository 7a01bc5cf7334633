"""The kvzoo plugin hooks: ``kvzoo_policies`` returns policy classes, ``kvzoo_retrievers`` retriever classes,
``kvzoo_namespaces`` resolvers of prefixed names (``kvpress:KnormPress``), ``kvzoo_adapters`` model families
(adapter classes), ``kvzoo_executors`` where a leaderboard's trials run (executor classes).

A plugin is a module with functions marked ``@kvzoo.registry.hookimpl``, installed through the ``kvzoo``
entry-point group or registered with :func:`kvzoo.registry.register_plugin` (docs/extending.md); kvzoo's own
classes come through the same hooks, from ``registry.toml``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pluggy

PROJECT_NAME = "kvzoo"  # pluggy project name and entry-point group

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kvzoo_policies() -> Sequence[type]:
    """Return the policy classes this plugin provides: :class:`kvzoo.framework.policy.Policy` subclasses, each with a
    non-empty ``name`` no other plugin claims."""


@hookspec
def kvzoo_namespaces() -> Mapping[str, Callable[[str], type]]:
    """Return policy namespaces, ``{"kvpress": resolve}``, for families of policies too many to list:
    ``registry.get("kvpress:KnormPress")`` calls ``resolve("KnormPress")``, which returns a Policy subclass of that
    full name, or raises ImportError (say how to install what is missing) or KeyError (say which names are valid)."""


@hookspec
def kvzoo_retrievers() -> Sequence[type]:
    """Return the retriever classes this plugin provides: :class:`kvzoo.framework.retriever.Retriever` subclasses, each
    with a non-empty ``name`` no other plugin claims (policies name it: ``retriever="my_index"``)."""


@hookspec
def kvzoo_adapters() -> Sequence[type]:
    """Return the model-family adapter classes this plugin provides, each following
    :class:`kvzoo.framework.adapters.Adapter` (``name``, the ``model_types`` it alone serves, ``layout``)."""


@hookspec
def kvzoo_executors() -> Sequence[type]:
    """Return the executor classes this plugin provides (where a leaderboard's trials run), each following
    :class:`kvzoo.bench.executors.Executor`."""
