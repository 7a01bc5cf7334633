"""Naming a plugin in an error: a policy or a model-family adapter that raises, or hands the framework what its
contract refuses, is named by its registered name, its class and -- when an entry point provided it -- that entry
point and its distribution, so the user knows which package to fix or report (issue 44, item 11).

Everything here runs on the error path only: the steady decode step pays for none of it (a ``try`` costs nothing
until something raises).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, NoReturn

# the entry-point group plugins are discovered through: the package's name (kvzoo.hookspecs.PROJECT_NAME; not
# imported, as this module belongs to the policy layer, which imports nothing of kvzoo above it)
ENTRY_POINT_GROUP = __name__.partition(".")[0]


class PluginError(RuntimeError):
    """A plugin raised, or returned what its contract refuses; the message names the plugin (:func:`plugin_label`)
    and the plugin's own exception, when there is one, is the ``__cause__``."""


@functools.lru_cache(maxsize=256)
def _entry_point_of(module: str) -> str:
    """``", entry point 'x' of dist 1.2"`` when a ``kvzoo`` entry point's module is ``module`` or a package holding it;
    "" otherwise (a built-in, a plugin registered in code). Cached by module: a message made ahead of a device-side
    check (an event's NaN check) reads the installed entry points once."""
    try:
        points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution on the path must not hide the error being reported
        return ""
    for point in points:
        source = point.value.split(":", 1)[0].strip()
        if module == source or module.startswith(source + "."):
            dist = getattr(point, "dist", None)
            where = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unnamed distribution"
            return f", entry point {point.name!r} of {where}"
    return ""


def plugin_label(plugin: Any, kind: str) -> str:
    """``"policy 'name' (module.Class, entry point 'x' of dist 1.2)"``: what an error says of ``plugin`` (an object or
    a class) of ``kind`` ("policy", "model-family adapter")."""
    cls = plugin if isinstance(plugin, type) else type(plugin)
    name = getattr(plugin, "name", None) or cls.__name__
    return f"{kind} {name!r} ({cls.__module__}.{cls.__qualname__}{_entry_point_of(cls.__module__)})"


def plugin_failed(plugin: Any, kind: str, method: str, err: BaseException) -> NoReturn:
    """Called inside ``except Exception as err`` around a call of ``plugin``'s ``method``: re-raise ``err`` as it is
    when it names the plugin already (a contract check's) or is a memory error; else raise one naming the plugin,
    chained to ``err``: a ValueError or TypeError (a refusal, which callers catch by its type) stays one, anything
    else becomes a :class:`PluginError`."""
    label = plugin_label(plugin, kind)
    if isinstance(err, (PluginError, MemoryError)) or type(err).__name__ == "OutOfMemoryError" or label in str(err):
        raise err
    message = f"{label}: {method}() raised {type(err).__name__}: {err}"
    named: Exception = PluginError(message)
    if isinstance(err, (ValueError, TypeError)):
        try:
            named = type(err)(message)
        except Exception:  # an exception type whose constructor takes other arguments
            named = (TypeError if isinstance(err, TypeError) else ValueError)(message)
    raise named from err


__all__ = ["PluginError", "plugin_failed", "plugin_label"]
