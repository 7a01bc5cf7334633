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
    """Return the policy classes this plugin provides.

    Each must be a subclass of :class:`kvzoo.framework.policy.Policy` with a non-empty ``name``
    that no other plugin (nor a built-in) claims; the registry builds them by that name.
    """


@hookspec
def kvzoo_namespaces() -> Mapping[str, Callable[[str], type]]:
    """Return policy namespaces: a prefix and a resolver, ``{"kvpress": resolve}``.

    ``registry.get("kvpress:KnormPress", ...)`` calls ``resolve("KnormPress")``, which returns a
    :class:`kvzoo.framework.policy.Policy` subclass named ``"kvpress:KnormPress"``, or raises
    ImportError (a package it needs is missing: say how to install it) or KeyError (no such name:
    say which are valid). For families of policies too many or too dynamic to list (another
    library's presses); a prefix no other plugin claims.
    """


@hookspec
def kvzoo_retrievers() -> Sequence[type]:
    """Return the retriever classes this plugin provides.

    Each must be a subclass of :class:`kvzoo.framework.retriever.Retriever` with a non-empty
    ``name`` no other plugin claims; policies then name it (``retriever="my_index"``).
    """


@hookspec
def kvzoo_adapters() -> Sequence[type]:
    """Return the model-family adapter classes this plugin provides.

    Each follows :class:`kvzoo.framework.adapters.Adapter`: a non-empty ``name``, the transformers
    ``model_types`` it serves (a model type no other adapter claims), its ``layout`` (``"gqa"`` or
    ``"mla"``) and a constructor ``(model, policy)``; ``TieredCache`` builds the one whose model types
    hold the model's ``config.model_type``.
    """


@hookspec
def kvzoo_executors() -> Sequence[type]:
    """Return the executor classes this plugin provides (where a leaderboard's trials run).

    Each follows :class:`kvzoo.bench.executors.Executor`: a non-empty ``name`` no other plugin claims
    (``kvzoo leaderboard --executor NAME``), a one-line ``summary``, ``add_arguments(group)`` adding its
    own command-line options, and a constructor taking those options' values as keywords.
    """
