"""kvzoo and NVIDIA's kvpress, both ways: kvzoo policies as presses (:func:`to_press`), kvpress presses as kvzoo
policies (``registry.get("kvpress:KnormPress", compression_ratio=0.5)``, :func:`policy_class`).

kvpress 0.5.5 pins ``transformers<5.3``, so the two meet in kvpress's environment (``make test-kvpress``); kvpress is
imported only when used. kvpress's ``compression_ratio`` c removes a fraction, kvzoo's ``ratio`` r keeps ``1/r``
(``c = 1 - 1/r``); the kept count follows whoever sized the policy, as ``1 - c`` can fall just below ``1/r`` in
floating point. docs/kvpress.md has the examples.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from types import ModuleType
from typing import Any, ClassVar

import torch

from kvzoo.framework.policy import Observation, Policy, RowsView, forced_priority
from kvzoo.framework.retriever import Retriever

KVPRESS_VERSION = "0.5.5"
KVPRESS_INSTALL = (
    f"kvpress {KVPRESS_VERSION} needs transformers>=4.56,<5.3 and kvzoo's main environment has >=5.18, so it goes in an "
    "environment of its own: `make test-kvpress` builds one (.venv-kvpress), or by hand: python -m venv .venv-kvpress && "
    f".venv-kvpress/bin/pip install 'torch==2.13.0' 'kvpress=={KVPRESS_VERSION}' pluggy tqdm matplotlib safetensors gguf && "
    ".venv-kvpress/bin/pip install --no-deps -e .  (then run kvzoo with .venv-kvpress/bin/python)"
)


def require_kvpress() -> ModuleType:
    """The ``kvpress`` module, or ImportError naming the install command."""
    try:
        import kvpress
    except ImportError as exc:
        raise ImportError(f"kvpress is not installed ({exc}). {KVPRESS_INSTALL}") from exc
    return kvpress


# --- the ratio mapping ----------------------------------------------------------------------------------------


def compression_ratio_for(ratio: float) -> float:
    """kvpress's ``compression_ratio`` (fraction removed) for kvzoo's ``ratio`` (keep 1/ratio): ``1 - 1/ratio``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio < 1:
        raise ValueError(f"ratio must be a finite number >= 1 (keep 1/ratio of the rows), got {ratio!r}")
    return 1.0 - 1.0 / ratio


def ratio_for(compression_ratio: float) -> float:
    """kvzoo's ``ratio`` for kvpress's ``compression_ratio``: ``1 / (1 - compression_ratio)``."""
    check_compression_ratio(compression_ratio)
    return 1.0 / (1.0 - compression_ratio)


def check_compression_ratio(compression_ratio: Any, name: str = "compression_ratio") -> None:
    if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float)) \
            or not 0 <= compression_ratio < 1:
        raise ValueError(f"{name} must be a number in [0, 1) (kvpress's: the fraction of rows removed), "
                         f"got {compression_ratio!r}")


def kvpress_kept_rows(n: int, compression_ratio: float) -> int:
    """Rows kvpress keeps of ``n`` at ``compression_ratio`` (its ``compute_n_kept``): ``max(1, int(n (1 - c)))``."""
    return 0 if compression_ratio >= 1 else max(1, int(n * (1 - compression_ratio)))


def exact_compression_ratio(policy: Policy) -> float | None:
    """The ``compression_ratio`` at which a press keeps exactly the policy's own count: ``1 - 1/ratio``, 0 for a
    policy that keeps everything (``full``), None for a policy sized by ``budget=`` (no fraction)."""
    if policy.ratio is not None:
        return compression_ratio_for(policy.ratio)
    return 0.0 if not policy.requires_budget else None


# --- kvzoo policies as presses ----------------------------------------------------------------------------------


def to_press(policy: Policy, *, compression_ratio: float | None = None, prefill_only: bool = False) -> Any:
    """A kvpress press that runs ``policy``'s selector at the end of the prefill: a ``ScorerPress`` for a selector that
    is a score (so kvpress's wrappers compose), a ``BasePress`` for ``full``; alone it keeps exactly the rows
    ``policy.select`` chooses. ``compression_ratio``: kvpress's fraction removed (default ``1 - 1/policy.ratio``);
    ``prefill_only=True`` runs a per-step policy's context-end eviction alone (docs/kvpress.md).
    """
    require_kvpress()
    if not isinstance(policy, Policy):
        raise TypeError(f"to_press takes a kvzoo Policy (kvzoo.registry.get('snapkv', ratio=4)), got {policy!r}")
    if "gqa" not in policy.layouts:
        raise ValueError(f"{policy.name}: kvpress runs GQA/MHA models, and this policy supports {policy.layouts} only")
    if policy.retriever is not None:
        retriever = policy.retriever if isinstance(policy.retriever, str) else policy.retriever.name
        raise ValueError(
            f"{policy.name}: its retriever {retriever!r} fetches archived rows back at every decode step, which a "
            "kvpress press (a prefill-time compression) cannot do; pass the policy with retriever=None for its "
            "eviction alone, or run it in kvzoo's runtime (kvzoo.pipeline.generate)"
        )
    if policy.schedule == "step" and not prefill_only:
        raise ValueError(
            f"{policy.name}: it evicts at every decode step (schedule 'step'), which a kvpress prefill press does "
            "not do (and kvpress's DecodingPress re-scores from a buffer of recent hidden states, which is not this "
            "policy's rule); to_press(policy, prefill_only=True) runs its eviction at the context's end alone "
            "(the rows kvzoo's runtime holds after the context), or run it in kvzoo's runtime"
        )
    if policy.dense_layers:
        raise ValueError(
            f"{policy.name}: it leaves its first layers uncompressed (dense_layers={getattr(policy, 'dense_layers', '?')}"
            "), so layers would hold different numbers of rows, which kvpress's pipeline cannot attend over (its "
            "attention mask follows layer 0's length; kvpress allows per-layer lengths only with flash attention): "
            "pass the policy with dense_layers=0, or run it in kvzoo's runtime"
        )
    if compression_ratio is not None:
        check_compression_ratio(compression_ratio)
    elif exact_compression_ratio(policy) is None:
        raise ValueError(
            f"{policy.name} is sized by budget={policy.budget} rows; kvpress presses are sized by a fraction: give "
            "the policy ratio= (keep 1/ratio) or pass compression_ratio= (kvpress's: the fraction removed)"
        )
    from kvzoo.integrations import kvpress_presses

    score_based = policy.requires_budget or kvpress_presses.press_rule(policy) is not None  # full keeps every row
    cls = kvpress_presses.KvzooScorerPress if score_based else kvpress_presses.KvzooPress
    return cls(policy, compression_ratio=compression_ratio, exact_compression_ratio=exact_compression_ratio(policy))


# --- kvpress presses as kvzoo policies ------------------------------------------------------------------------

# presses whose score() needs what kvzoo's runtime does not produce, with the reason
UNSUPPORTED_PRESSES: dict[str, str] = {
    "ObservedAttentionPress": "it scores with the full attention matrix of eager attention, which kvzoo's runtime "
                              "never materialises",
    "QFilterPress": "it downloads its filters from the Hugging Face hub",
    "KVzapPress": "it downloads its scoring model from the Hugging Face hub",
}


def _unsupported(kvpress: ModuleType, press_class: type) -> str | None:
    """Why a kvpress ``ScorerPress`` cannot be a kvzoo selector, or None when it can."""
    name = press_class.__name__
    if name in UNSUPPORTED_PRESSES:
        return UNSUPPORTED_PRESSES[name]
    for method, why in (
        ("compress", "it sizes or selects by its own compress(), not by a top-k of its score(), and kvzoo's runtime fixes "
                     "the budget itself"),
        ("forward_hook", "it works in its own forward hook, not through score()"),
        ("post_init_from_model", "it initialises itself from the whole model (post_init_from_model)"),
    ):
        if getattr(press_class, method) is not getattr(kvpress.BasePress if method != "compress" else kvpress.ScorerPress,
                                                       method):
            return why
    return None


def press_names() -> list[str]:
    """The kvpress ``ScorerPress`` classes a ``kvpress:`` name may give (kvpress must be importable)."""
    kvpress = require_kvpress()
    return sorted(
        name for name in kvpress.__all__
        if inspect.isclass(cls := getattr(kvpress, name)) and issubclass(cls, kvpress.ScorerPress)
        and cls is not kvpress.ScorerPress and _unsupported(kvpress, cls) is None
    )


@dataclasses.dataclass
class KvpressPolicy(Policy):
    """A kvpress ``ScorerPress`` as a kvzoo selector (``registry.get("kvpress:KnormPress", compression_ratio=0.5)``).

    The fields are kvzoo's common ones plus the press's own (kvpress's names and defaults). Exactly one of
    ``compression_ratio`` (kvpress's count) and ``ratio`` (kvzoo's) sizes it; ``budget=`` is refused. At the context's
    end ``score()`` ranks the layer's rows with what kvpress's hook would hand it and the top rows stay (ties to the
    earlier row). A retriever may be added (``retriever="vestige"``).
    """

    press_class: ClassVar[type] = object
    observes: ClassVar[frozenset[Observation]] = frozenset({Observation.INPUTS})
    layouts: ClassVar[tuple[str, ...]] = ("gqa",)
    paper: ClassVar[str] = "https://github.com/NVIDIA/kvpress"

    def press_params(self) -> dict[str, Any]:
        """The press's own fields as set on this policy, ``compression_ratio`` included (``1 - 1/ratio`` from kvzoo's)."""
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self.press_class) if f.init}
        if params.get("compression_ratio") is None:
            params["compression_ratio"] = compression_ratio_for(self.ratio)
        return params

    def validate(self) -> None:
        compression_ratio = getattr(self, "compression_ratio", None)
        if self.budget is not None:
            raise ValueError(f"{self.name}: kvpress presses are sized by a fraction, not budget={self.budget}: give "
                             "compression_ratio= (kvpress's: the fraction removed) or ratio= (kvzoo's: keep 1/ratio)")
        if (compression_ratio is None) == (self.ratio is None):
            raise ValueError(f"{self.name}: give exactly one of compression_ratio= (kvpress's: the fraction removed) "
                             f"and ratio= (kvzoo's: keep 1/ratio); got compression_ratio={compression_ratio}, "
                             f"ratio={self.ratio}")
        if compression_ratio is not None:
            check_compression_ratio(compression_ratio)
            if self.archive is None:
                self.archive = self.retriever is not None
            if not isinstance(self.archive, bool):
                raise TypeError(f"archive must be True (keep evicted rows), False (drop them) or None (keep them "
                                f"exactly when a retriever reads them), got {self.archive!r}")
            if self.retriever is not None and not isinstance(self.retriever, (str, Retriever)):
                raise TypeError(f"retriever must be a registered retriever name, a Retriever object or None, got "
                                f"{self.retriever!r}")
        else:
            super().validate()  # kvzoo's checks of ratio, archive and retriever
        try:
            self.press = self.press_class(**self.press_params())
        except (AssertionError, TypeError, ValueError) as exc:
            raise ValueError(f"{self.name}: kvpress refused the parameters {self.press_params()}: "
                             f"{exc or type(exc).__name__}") from exc

    def resolve_budget(self, rows_seen: int) -> int | None:
        compression_ratio = getattr(self, "compression_ratio", None)
        if compression_ratio is not None:
            return kvpress_kept_rows(rows_seen, compression_ratio)
        return super().resolve_budget(rows_seen)

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        inputs = rows.inputs
        module = inputs.module if inputs is not None else None
        hidden_states = inputs.hidden_states if inputs is not None else None
        n = rows.num_rows
        if module is None or hidden_states is None or hidden_states.shape[1] != n:
            seen = "none" if hidden_states is None else f"{hidden_states.shape[1]} tokens' worth"
            raise RuntimeError(
                f"{self.name}: layer {rows.layer_idx} holds {n} rows but its attention inputs ({seen}) were not recorded "
                "for all of them; a kvpress press scores the context once, at its end, from the attention layer's "
                "inputs, which kvzoo records on GQA models from the first forward until the context ends"
            )
        if not bool(rows.valid.all()):
            raise ValueError(f"{self.name}: kvpress presses assume unpadded sequences; run one sequence at a time")
        kwargs = {
            "hidden_states": hidden_states,
            "position_embeddings": inputs.position_embeddings,
            "cache_position": torch.arange(n, device=rows.keys.device),
            "attention_mask": None,
        }
        scores = self.press.score(module, hidden_states, rows.keys, rows.values, None, kwargs)
        if scores.shape != rows.valid.shape:
            raise RuntimeError(f"{self.name}: score() returned shape {tuple(scores.shape)}, expected "
                               f"{tuple(rows.valid.shape)} (batch, KV heads, rows)")
        return forced_priority(scores, torch.zeros_like(rows.valid), rows.valid)


@functools.cache
def policy_class(press_name: str) -> type[KvpressPolicy]:
    """The kvzoo policy class ``kvpress:<press_name>`` of kvpress's ``ScorerPress`` ``press_name`` (the ``kvpress``
    namespace's resolver): ImportError naming the install command without kvpress, KeyError naming the valid presses."""
    kvpress = require_kvpress()
    what = getattr(kvpress, press_name, None)
    if inspect.isclass(what) and issubclass(what, kvpress.ScorerPress) and _unsupported(kvpress, what):
        raise KeyError(f"kvpress's {press_name} cannot run as a kvzoo policy: {_unsupported(kvpress, what)}")
    valid = press_names()
    if press_name not in valid:
        why = (f"kvpress's {press_name} is not a ScorerPress (it does its own compression, not a score() a kvzoo "
               "selector can rank)") if inspect.isclass(what) else f"kvpress has no {press_name!r}"
        raise KeyError(f"{why}; valid kvpress: names: {', '.join(valid)}")
    press_class = getattr(kvpress, press_name)
    own = {f.name for f in dataclasses.fields(Policy)}
    fields = []
    for f in dataclasses.fields(press_class):
        if not f.init or f.name in own:
            continue
        default = None if f.name == "compression_ratio" else f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, f.type, dataclasses.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type, dataclasses.field(default=default)))
    doc = (press_class.__doc__ or "").strip().splitlines()
    return dataclasses.make_dataclass(
        f"Kvpress{press_name}",
        fields,
        bases=(KvpressPolicy,),
        namespace={
            "name": f"kvpress:{press_name}",
            "summary": f"kvpress's {press_name}: {doc[0].strip() if doc else 'a ScorerPress'}",
            "press_class": press_class,
            "__module__": __name__,
        },
        kw_only=True,
    )
