"""The runtime on DeepSeek-V2-Lite's attention geometry, one cell at a time: transformers' own model vs kvzoo's.

``make gpu-check`` (``benchmarks/gpu_check.py``) plans and runs these cells with the kernels'; this module says what
one runtime cell does.

The model: DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, latent 512 + 64, nope 128, v 128, no q-LoRA, Lite's
YaRN), 8 layers with a small dense MLP (intermediate 1024) so that attention dominates, vocabulary 32,768, random
weights, bf16 on CUDA (fp32 on CPU; the toy size is hidden 256, 4 heads, 2 layers, the real 512 + 64 row).

* A **prefill cell** prefills one context once at batch 1, in chunks of 4,096 tokens, into a ``full`` cache
  (``KVZOO_KERNELS=torch``) -- or, for the ``transformers`` baseline, into transformers' ``DynamicCache`` with its own
  attention (a second copy of the model kvzoo never attaches to).
* A **decode cell** (policy, kernels, mode, context, batch) hands those rows to its policy
  (``TieredCache.transplant``: every arm starts from the very same rows), compresses (the pipeline's compression
  point), repeats them to the batch, runs ``warmup`` steps, then times ``steps`` steps (median ms, synchronised
  around each step: host overhead included). ``kernels``: ``KVZOO_KERNELS`` for the cell (``torch``: the PyTorch
  path; ``triton``: the kernels). ``mode``: ``eager`` (storage that grows), ``capacity`` (preallocated for the
  sequence: ``transplant(capacity=N)``) or ``graph`` (preallocated and captured: ``cuda_graph``; off CUDA a strict
  stand-in, ``kvzoo.bench.step_trace.StandInGraph``, replays the step and refuses a captured step that syncs or
  builds a tensor from host data, as ``torch.cuda.graph`` would).
  Every decode row records what the plan's cost model reads: ``layers``, ``step_launches`` (the ops one eager decode
  step launches: aten ops that are not metadata plus Triton kernel calls) and ``setup_launches`` (the ops of the
  cell's setup: transplant or copy, compress, batch repeat), counted by ``StepTrace`` outside the timed steps.

**A row checks what it times.** The ``torch``/``eager`` cell of a (policy, context, batch) is the reference: its
warm-up steps' logits are kept (or computed, untimed, when that cell was not run). That row is itself checked:
during its last warm-up step every decode-attention call the model makes (``kvzoo.framework.attention.attend``,
wrapped for that step only: :class:`AttentionCheck`) is recomputed at once by the reference with float64 math on the
same inputs and compared with what it returned, within the kernel rows' tolerance (``gpu_kernels.CHECK``). Every
other cell feeds the reference's greedy tokens through its own warm-up steps -- so in graph mode the steps compared
include the eager step, the captured one and replayed ones -- and compares each step's logits: relative error
``|got - ref| / |ref|`` within :data:`LOGIT_TOL` (bf16: 3e-2) and the same greedy token (a different token passes
only where the reference's two logits are closer than four times the RMS difference of the logits: a tie within the
rounding noise). A row that fails the check is a failed row. With random weights attention over thousands of random tokens is close to
uniform, so this check catches gross errors (a stale graph input, a wrong layer, NaN, an unwritten output) rather
than a subtly wrong row set: ``gpu_kernels.py`` checks each op against fp32 on random rows for that. The
``transformers`` row is compared with kvzoo's ``full`` reference (do they agree?).

**No silent fallback.** :class:`KernelGuard` replaces ``kvzoo.kernels.dispatch.run`` in the benchmark's process
only: a kernel that raises fails its row with the exception (``KVZOO_KERNELS=auto`` would otherwise switch that op
to PyTorch for the rest of the process and the row would time PyTorch under a Triton label); each kernel call is
counted, and a ``triton`` row in which no kernel ran is a failed row.
"""

from __future__ import annotations

import collections
import copy
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from gpu_kernels import CHECK, margin_bytes, rel_error
from gpu_kernels import free_bytes as _free_bytes

from kvzoo.bench.step_trace import StandInGraph, StepTrace

POLICIES: dict[str, tuple[str, dict] | None] = {
    "transformers": None,  # transformers' own DeepseekV2 attention with a DynamicCache
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {}),
    "vestige": ("vestige", {"retriever": None}),  # VestigeKV's eviction alone
    "vestige+sketch": ("vestige", {}),  # VestigeKV as registered: eviction + the certified sketch retriever
    "quest": ("quest", {}),
    "snapkv": ("snapkv", {}),
}
REFERENCE = ("torch", "eager")
# the logits of a checked step against the reference step's: relative L2 error allowed per model dtype
LOGIT_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}
ROW_BYTES = 576 * 2  # one absorbed MLA row in bf16


class Skip(Exception):
    """A cell that is not run, and why (memory, a prefill it needs failed): a row saying so, not a failure
    (``gpu_check.run_cell`` reads ``skip``)."""

    skip = True


class KernelFailed(RuntimeError):
    """A Triton kernel raised inside a benchmark cell (where ``auto`` would have switched to PyTorch silently)."""


@dataclass
class Settings:
    device: str
    dtype: torch.dtype
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    steps: int
    warmup: int
    chunk: int
    ratio: float
    notes: list[str] = field(default_factory=list)


def settings(toy: bool, device: str) -> Settings:
    s = Settings(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                 layers=2 if toy else 8, hidden=256 if toy else 2048, heads=4 if toy else 16,
                 intermediate=256 if toy else 1024, vocab=512 if toy else 32768, steps=2 if toy else 16,
                 warmup=2 if toy else 4,  # on CUDA: an eager step, the captured one, two replays
                 chunk=256 if toy else 4096, ratio=32.0)
    if toy:
        s.notes.append("toy size (hidden 256, 4 heads, 2 layers, the real 512 + 64 row): a smoke run, not a "
                       "measurement of a GPU")
    return s


def build_model(s: Settings) -> torch.nn.Module:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from kvzoo.models import DEEPSEEK_V2_LITE_ROPE, MLA_ROW_GEOMETRY

    config = DeepseekV2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.heads, q_lora_rank=None,
        first_k_dense_replace=s.layers,  # every layer's MLP dense and small: attention dominates
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, max_position_embeddings=163840,
        rope_parameters=dict(DEEPSEEK_V2_LITE_ROPE), tie_word_embeddings=False, **MLA_ROW_GEOMETRY,
    )
    torch.manual_seed(0)
    with torch.device(s.device):
        model = DeepseekV2ForCausalLM(config)
    return model.to(s.dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class KernelGuard:
    """``kvzoo.kernels.dispatch.run`` replaced in this process (every module that imported it by name too): the
    kernel's exception propagates as :class:`KernelFailed` -- never a switch to the PyTorch reference -- and each
    kernel call is counted by op."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        import kvzoo.kernels.decode_attention  # noqa: F401  (the modules that call it, loaded before patching)
        import kvzoo.kernels.index_scan  # noqa: F401
        from kvzoo.kernels import dispatch

        original = dispatch.run

        def run(name: str, triton_fn: Callable, reference_fn: Callable, *args: Any, **kwargs: Any) -> Any:
            try:
                out = triton_fn(*args, **kwargs)
            except Exception as err:
                self.failures.append(f"{name}: {type(err).__name__}: {str(err)[:300]}")
                raise KernelFailed(f"the Triton kernel {name!r} raised {type(err).__name__}: {str(err)[:300]} "
                                   "(gpu-check fails the row rather than time the PyTorch fallback)") from err
            self.calls[name] += 1
            return out

        self.patched = [(module, original) for name, module in list(sys.modules.items())
                        if name.startswith("kvzoo.") and getattr(module, "run", None) is original]
        for module, _ in self.patched:
            module.run = run
        self.installed = True

    def uninstall(self) -> None:
        """``dispatch.run`` put back (the tests; a benchmark process keeps the guard to its end)."""
        for module, original in getattr(self, "patched", []):
            module.run = original
        self.patched, self.installed = [], False

    def snapshot(self) -> tuple[collections.Counter, int, frozenset]:
        from kvzoo.kernels import dispatch

        return collections.Counter(self.calls), len(self.failures), frozenset(dispatch._failed)

    def since(self, before: tuple[collections.Counter, int, frozenset]) -> tuple[dict[str, int], list[str]]:
        """Kernel calls by op, and the problems (a kernel that raised, an op the dispatch switched to PyTorch),
        since ``before``."""
        from kvzoo.kernels import dispatch

        calls, failures, failed = before
        problems = list(self.failures[failures:])
        problems += [f"kvzoo.kernels.dispatch switched {op!r} to PyTorch"
                     for op in sorted(set(dispatch._failed) - failed)]
        return dict(self.calls - calls), problems


class GraphBookkeeping:
    """Host time spent advancing the cache's counters after each replay (``graphs._Steps.advance``), timed in this
    process only: the part of a graph step's host cost the issue asks to make O(1) in the number of layers."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        from kvzoo.framework import graphs

        steps = getattr(graphs, "_Steps", None)
        original = getattr(steps, "advance", None)
        if original is None:  # the runtime changed: the column says "—"
            self.installed = True
            return

        def advance(obj: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        steps.advance = advance
        self.restore = (steps, original)
        self.installed = True

    def uninstall(self) -> None:
        restore = getattr(self, "restore", None)
        if restore is not None:
            restore[0].advance = restore[1]
        self.restore, self.installed = None, False


class AttentionCheck:
    """``kvzoo.framework.attention.attend`` (imported there by name) wrapped in this process while installed: each
    call's result is compared at once -- before the step goes on and the storage changes -- with the reference's on
    the same inputs in float64 math (``attend_reference(..., math=torch.float64)``; a prior part's ``out``/``lse``
    cast to float64, a deferred part's sources read again, as ``attend`` does). ``rel``: ``gpu_kernels.rel_error``
    per call that returned an output (a deferred PyTorch part returns none: its rows join the softmax of the part
    that ends the step, checked there); ``calls``: every call. Installed for one step; nothing of the inputs kept."""

    def __init__(self) -> None:
        self.rel: list[float] = []
        self.calls = 0
        self.restore: tuple[Any, Callable] | None = None

    def install(self) -> None:
        if self.restore is not None:
            return
        from kvzoo.framework import attention
        from kvzoo.kernels.decode_attention import Attended, reference
        from kvzoo.kernels.decode_attention.rows import _validate

        original = attention.attend
        self.rel, self.calls = [], 0

        def attend(query: torch.Tensor, sources: list, scaling: float, **kwargs: Any) -> Any:
            got = original(query, sources, scaling, **kwargs)
            self.calls += 1
            if got.out is None:  # a deferred PyTorch part: the part that ends the step reads its sources again
                return got
            prior = kwargs.get("prior")
            if prior is not None:  # a PyTorch part's sources read again; a kernel's or the native op's (out, lse)
                prior = Attended(None if prior.out is None else prior.out.double(),
                                 None if prior.lse is None else prior.lse.double(), prior.best, sources=prior.sources)
            checked = _validate(query, sources, scaling, kwargs.get("splits"))
            want = reference.attend_reference(query, checked, float(scaling), defer=kwargs.get("defer", False),
                                              prior=prior, math=torch.float64)
            self.rel.append(rel_error(got.out, want.out))
            return got

        attention.attend = attend
        self.restore = (attention, original)

    def uninstall(self) -> None:
        if self.restore is not None:
            self.restore[0].attend = self.restore[1]
        self.restore = None

    def result(self, tol: float) -> dict[str, Any]:
        """The row's ``check``: ``ok`` when some call was compared and every one is within ``tol`` (else ``why``)."""
        out: dict[str, Any] = {"reference": "float64 attention on this row's inputs", "rel": list(self.rel),
                               "calls": self.calls, "tolerance": tol}
        worst = max(self.rel, default=float("nan"))
        if not self.rel:
            out["why"] = f"no decode-attention output was checked ({self.calls} calls)"
        elif not worst <= tol:
            out["why"] = (f"attention off its float64 reference: relative error {worst:.2e} > {tol:g} "
                          f"(call {self.rel.index(worst)} of the last warm-up step)")
        out["ok"] = "why" not in out
        return out


@dataclass
class Base:
    """One context prefilled once at batch 1: the rows every decode cell of that context starts from."""

    cache: Any
    token: torch.Tensor  # [1, 1] the greedy token after the prompt
    prefill_s: float
    peak_mib: float | None


@dataclass
class Reference:
    """The torch/eager warm-up steps of one (policy, context, batch): logits [B, V] per step (fp32, CPU), and the
    greedy tokens fed after each step [B, 1]."""

    logits: list[torch.Tensor]
    tokens: list[torch.Tensor]


def compare(reference: list[torch.Tensor], got: list[torch.Tensor], tol: float) -> dict[str, Any]:
    """``got``'s logits per step against ``reference``'s: relative L2 error per step (within ``tol``) and the greedy
    token per sequence -- equal, or a tie: the reference's margin between the two tokens within four times the RMS
    difference of that sequence's logits (rounding noise spread over the vocabulary, not one logit gone wrong).
    ``ok`` and, when not, ``why``."""
    rel, ties, mismatched = [], 0, []
    for step, (r, g) in enumerate(zip(reference, got)):
        if not torch.isfinite(g).all():
            return {"ok": False, "why": f"step {step}: non-finite logits", "rel": rel, "ties": ties}
        rel.append(float((g - r).norm() / r.norm().clamp_min(1e-30)))
        want, have = r.argmax(-1), g.argmax(-1)
        noise = (g - r).pow(2).mean(-1).sqrt()
        margin = r.gather(-1, want[:, None])[:, 0] - r.gather(-1, have[:, None])[:, 0]
        for b in torch.nonzero(want != have).flatten().tolist():
            if margin[b] <= 4 * noise[b]:
                ties += 1
            else:
                mismatched.append(f"step {step} seq {b}: token {int(have[b])}, reference {int(want[b])}")
    out: dict[str, Any] = {"rel": rel, "ties": ties, "tolerance": tol, "steps": len(rel)}
    worst = max(rel, default=0.0)
    problems = []
    if worst > tol:
        problems.append(f"logits off the reference: relative error {worst:.2e} > {tol:g} (step {rel.index(worst)})")
    if mismatched:
        problems.append("greedy token differs: " + "; ".join(mismatched[:3]))
    out["ok"] = not problems
    if problems:
        out["why"] = "; ".join(problems)
    return out


class RuntimeBench:
    """What the runtime cells of one worker process share: the model (and transformers' copy), the prefilled
    contexts, the references, the kernel guard."""

    def __init__(self, device: str, toy: bool, bandwidth: Callable[[], float] | None = None,
                 graph_runner: Callable[[Any], Any] | None = None) -> None:
        """``graph_runner(cache)``: a stand-in for ``torch.cuda.CUDAGraph``; by default None on CUDA (the real
        graph) and elsewhere the strict :class:`~kvzoo.bench.step_trace.StandInGraph` (a captured step that syncs
        or builds a host tensor fails its row)."""
        self.s = settings(toy, device)
        if graph_runner is None and device != "cuda":
            graph_runner = functools.partial(StandInGraph, strict=True)
        self.graph_runner = graph_runner
        self.device, self.toy = device, toy
        self._bandwidth = bandwidth
        self.model: torch.nn.Module | None = None
        self.hf_model: torch.nn.Module | None = None
        self.bases: dict[tuple[str, int], Base | Exception] = {}
        self.refs: dict[tuple[str, int, int], Reference] = {}
        self.guard = KernelGuard()
        self.bookkeeping = GraphBookkeeping()
        self.attention_check = AttentionCheck()

    def close(self) -> None:
        """Drop the prefilled rows and the references, put ``dispatch.run``, ``attention.attend`` and the graph
        counters back (the tests; a benchmark's worker keeps the first and the last to its end)."""
        self.bases.clear()
        self.refs.clear()
        self.guard.uninstall()
        self.bookkeeping.uninstall()
        self.attention_check.uninstall()

    def bandwidth(self) -> float:
        if self._bandwidth is None:
            from kvzoo.bench.metrics import copy_bandwidth

            value = copy_bandwidth(self.device, gib=1.0 if self.device == "cuda" else 0.05)
            self._bandwidth = lambda: value
        return self._bandwidth()

    def models(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        if self.model is None:
            self.model = build_model(self.s)
            self.hf_model = copy.deepcopy(self.model)  # never attached to: transformers' own attention
            self.guard.install()
            self.bookkeeping.install()
        return self.model, self.hf_model

    # --- what a cell costs beyond its plan (state a restarted worker lost) -------------------------------------
    def missing(self, p: dict[str, Any]) -> list[str]:
        """What this decode cell must rebuild first: ``prefill kvzoo C``, ``reference P C B`` (the plan's
        estimate covers neither)."""
        kind = "transformers" if p["policy"] == "transformers" else "kvzoo"
        out = [] if (kind, p["context"]) in self.bases else [f"prefill {kind} {p['context']}"]
        ref_policy = "full" if p["policy"] == "transformers" else p["policy"]
        if (p["kernels"], p["mode"]) != REFERENCE and (ref_policy, p["context"], p["batch"]) not in self.refs:
            out.append(f"reference {ref_policy} {p['context']} {p['batch']}")
        return out

    # --- prefill ---------------------------------------------------------------------------------------------
    def base(self, kind: str, context: int) -> Base:
        key = (kind, context)
        got = self.bases.get(key)
        if isinstance(got, Exception):
            raise Skip(f"the prefill of {context} tokens ({kind}) failed earlier: {type(got).__name__}: {got}")
        if got is None:
            try:
                got = self._prefill(kind, context)
            except Exception as err:
                self.bases[key] = err
                raise
            self.bases[key] = got
        return got

    def _prefill(self, kind: str, context: int) -> Base:
        from transformers import DynamicCache

        from kvzoo import TieredCache

        s = self.s
        # the cache, and a chunk's transients: a layer's rows decompressed to per-head K/V for the whole context
        need = 2 * s.layers * context * ROW_BYTES + 2 * context * s.heads * (128 + 64 + 128) * 2 \
            + margin_bytes(s.device)
        free = _free_bytes(s.device)
        if need > free:
            raise Skip(f"the prefill of {context} tokens needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
                       "free")
        model, hf_model = self.models()
        os.environ["KVZOO_KERNELS"] = "torch"
        g = torch.Generator(device="cpu").manual_seed(context)
        ids = torch.randint(3, s.vocab, (1, context), generator=g).to(s.device)
        mark = _memory_mark(s.device)
        if kind == "transformers":
            net, cache = hf_model, DynamicCache(config=hf_model.config)
        else:
            net, cache = model, TieredCache(model, "full", context_length=context)
        with torch.no_grad():
            sync(s.device)
            t = time.perf_counter()
            for start in range(0, context, s.chunk):
                logits = net(input_ids=ids[:, start:start + s.chunk], cache=cache, use_cache=True,
                             logits_to_keep=1).logits
            sync(s.device)
            seconds = time.perf_counter() - t
        held = cache.get_seq_length()
        if held != context:  # transformers 5.17 drops cache= silently: refuse rather than time an empty cache
            raise RuntimeError(f"after a prefill of {context} tokens the cache holds {held}: this transformers "
                               "ignores cache= (run the preflight: benchmarks/gpu_bundle.py preflight)")
        return Base(cache, logits[:, -1].argmax(-1, keepdim=True), seconds, _memory_peak(s.device, mark))

    def prefill_cell(self, p: dict[str, Any]) -> dict[str, Any]:
        existed = (p["kind"], p["context"]) in self.bases
        base = self.base(p["kind"], p["context"])
        return {"kind": p["kind"], "context": p["context"], "prefill_s": base.prefill_s,
                "prefill_peak_mib": base.peak_mib, "status": "ok",
                **({"note": "already prefilled in this process"} if existed else {})}

    # --- decode ----------------------------------------------------------------------------------------------
    def need_bytes(self, policy: str, context: int, batch: int) -> int:
        """A generous estimate of the device memory a decode cell allocates (its cache, the step's transients)."""
        s = self.s
        rows = s.layers * (context + s.warmup + s.steps + 8) * batch * ROW_BYTES
        if policy == "transformers":  # it decompresses a layer's latent into per-head K/V every step
            return 2 * rows + 2 * context * batch * s.heads * (128 + 64 + 128) * 2 + margin_bytes(s.device)
        return 4 * rows + margin_bytes(s.device)

    def _cache(self, policy: str, mode: str, context: int) -> tuple[Any, torch.nn.Module]:
        from kvzoo import registry

        s = self.s
        model, hf_model = self.models()
        if POLICIES[policy] is None:
            return copy.deepcopy(self.base("transformers", context).cache), hf_model
        name, extra = POLICIES[policy]
        params = dict(extra) if name == "full" else {"ratio": s.ratio, **extra}
        capacity = context + s.warmup + s.steps + 8 if mode in ("capacity", "graph") else None
        cache = self.base("kvzoo", context).cache.transplant(registry.get(name, **params), capacity=capacity,
                                                              context_length=context)
        if mode == "graph":
            # TieredCache(..., cuda_graph=True) for a transplanted cache: transplant() has no cuda_graph= yet
            from kvzoo.framework import graphs

            if self.graph_runner is None:
                graphs.check_cuda_graph(model, capacity)
                cache.graph = graphs.install(model, cache)
            else:
                cache.graph = graphs.install(model, cache, lambda c=cache: self.graph_runner(c))
        return cache, model

    def _run(self, policy: str, kernels: str, mode: str, context: int, batch: int,
             teacher: list[torch.Tensor] | None, timed: bool, check_attention: bool = False) -> dict[str, Any]:
        """The setup (counted: ``setup_launches``), warm-up steps (teacher-forced when ``teacher`` is given), then
        ``steps`` timed steps when ``timed``; ``check_attention``: the last warm-up step under :class:`AttentionCheck`."""
        s = self.s
        os.environ["KVZOO_KERNELS"] = kernels
        base = self.base("transformers" if policy == "transformers" else "kvzoo", context)
        cache = net = None
        try:
            with torch.no_grad():
                t = time.perf_counter()
                # the trace's own bookkeeping per op is in setup_s too: little beside what a setup copies
                with StepTrace() as setup:
                    cache, net = self._cache(policy, mode, context)
                    if hasattr(cache, "compress"):
                        cache.compress()
                    if batch > 1:
                        cache.batch_repeat_interleave(batch)
                sync(s.device)
                setup_s = time.perf_counter() - t
                out = self._drive(policy, cache, net, base, context, batch, teacher, timed, check_attention)
            out.update(setup_s=setup_s, setup_launches=setup.launches)
            return out
        finally:
            if cache is not None:
                _release_graph(net, cache)
            del cache
            if s.device == "cuda":
                torch.cuda.empty_cache()

    def _drive(self, policy: str, cache: Any, net: torch.nn.Module, base: Base, context: int, batch: int,
               teacher: list[torch.Tensor] | None, timed: bool, check_attention: bool) -> dict[str, Any]:
        s = self.s
        token = base.token.repeat(batch, 1)
        warm_logits, warm_tokens = [], []
        step_launches = None
        for step in range(s.warmup):
            if step == 0:
                # the first warm-up step runs eagerly in every mode (in graph mode the DecodeGraph warms up or, after
                # an event, runs it plainly; it captures a later step): its launches are an eager step's
                kernel_calls = sum(self.guard.calls.values())
                with StepTrace() as trace:
                    logits = self._step(net, cache, token, context + step)
                step_launches = trace.launches + sum(self.guard.calls.values()) - kernel_calls
                del trace
            elif check_attention and step == s.warmup - 1:  # (settings: warmup >= 2, never the traced step)
                self.attention_check.install()
                try:
                    logits = self._step(net, cache, token, context + step)
                finally:
                    self.attention_check.uninstall()
            else:
                logits = self._step(net, cache, token, context + step)
            warm_logits.append(logits.float().cpu())
            token = teacher[step].to(s.device) if teacher is not None else logits.argmax(-1, keepdim=True)
            warm_tokens.append(token.cpu())
        out: dict[str, Any] = {"warm_logits": warm_logits, "warm_tokens": warm_tokens, "step_launches": step_launches}
        if not timed:
            return out
        graph = getattr(cache, "graph", None)
        replays0 = graph.replays if graph is not None else 0
        book0 = (self.bookkeeping.seconds, self.bookkeeping.calls)
        mark = _memory_mark(s.device)
        times = []
        for step in range(s.warmup, s.warmup + s.steps):
            sync(s.device)
            t = time.perf_counter()
            logits = self._step(net, cache, token, context + step)
            sync(s.device)
            times.append(time.perf_counter() - t)
            token = logits.argmax(-1, keepdim=True)
        out.update(times=times, peak_mib=_memory_peak(s.device, mark), kv_bytes=self._kv_bytes(policy, cache))
        if graph is not None:
            calls = self.bookkeeping.calls - book0[1]
            out.update(replays=graph.replays - replays0, captures=graph.captures,
                       bookkeeping_ms=1e3 * (self.bookkeeping.seconds - book0[0]) / calls if calls else None)
        return out

    def _step(self, net: torch.nn.Module, cache: Any, token: torch.Tensor, position: int) -> torch.Tensor:
        positions = torch.full_like(token, position)
        return net(input_ids=token, position_ids=positions, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]

    def _kv_bytes(self, policy: str, cache: Any) -> int:
        if POLICIES[policy] is None:  # transformers keeps the latent c and k_pe and reads them every step
            layers = [la for la in cache.layers if getattr(la, "keys", None) is not None]
            return sum(la.keys.numel() * la.keys.element_size() + la.values.numel() * la.values.element_size()
                       for la in layers)
        return int(sum(la.last_step.get("kv_bytes_read", 0) for la in cache.stats().layers))

    def reference(self, policy: str, context: int, batch: int) -> Reference:
        key = (policy, context, batch)
        if key not in self.refs:
            got = self._run(policy, *REFERENCE, context, batch, teacher=None, timed=False)
            self.refs[key] = Reference(got["warm_logits"], got["warm_tokens"])
        return self.refs[key]

    def decode_cell(self, p: dict[str, Any]) -> dict[str, Any]:
        """One (policy, kernels, mode, context, batch) cell: a row with its timing and its check."""
        s = self.s
        policy, kernels, mode, context, batch = p["policy"], p["kernels"], p["mode"], p["context"], p["batch"]
        free = _free_bytes(s.device)
        need = self.need_bytes(policy, context, batch)
        if need > free:
            raise Skip(f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
        self.models()
        is_reference = (kernels, mode) == REFERENCE and policy != "transformers"
        ref_policy = "full" if policy == "transformers" else policy
        reference = None if is_reference else self.reference(ref_policy, context, batch)
        before = self.guard.snapshot()
        try:
            got = self._run(policy, kernels, mode, context, batch,
                            teacher=None if reference is None else reference.tokens, timed=True,
                            check_attention=is_reference)
        finally:
            calls, problems = self.guard.since(before)
        if is_reference:
            self.refs[(policy, context, batch)] = Reference(got["warm_logits"], got["warm_tokens"])
        kv = got["kv_bytes"]
        times = got["times"]
        row: dict[str, Any] = {
            "policy": policy, "kernels": "—" if policy == "transformers" else kernels, "mode": mode,
            "context": context, "batch": batch, "dtype": str(s.dtype).removeprefix("torch."),
            "decode_ms": 1e3 * statistics.median(times), "decode_ms_min": 1e3 * min(times), "steps": len(times),
            "kv_bytes_per_step": kv, "bandwidth_bound_ms": 1e3 * kv / self.bandwidth(),
            "decode_peak_mib": got["peak_mib"], "setup_s": got["setup_s"], "kernel_calls": calls,
            "layers": s.layers, "step_launches": got["step_launches"], "setup_launches": got["setup_launches"],
        }
        for key in ("replays", "captures", "bookkeeping_ms"):
            if key in got:
                row[key] = got[key]
        problems = list(problems)
        if reference is None:
            check = self.attention_check.result(CHECK[s.dtype])
            row["check"] = check
            if not check["ok"]:
                problems.append(check["why"])
        else:
            check = compare(reference.logits, got["warm_logits"], LOGIT_TOL[s.dtype])
            check["reference"] = f"{ref_policy} torch eager"
            row["check"] = check
            if not check["ok"]:
                problems.append(check["why"])
        if (kernels == "triton" or kernels == "auto" and s.device == "cuda") and policy != "transformers" and not calls:
            problems.append("no Triton kernel ran in this row: it timed the PyTorch path")
        if kernels == "torch" and calls:
            problems.append(f"Triton kernels ran under KVZOO_KERNELS=torch: {calls}")
        if mode == "graph" and not got.get("replays"):
            problems.append(f"no timed step replayed a CUDA graph ({got.get('captures', 0)} captures)")
        row["status"] = "failed" if problems else "ok"
        if problems:
            row["error"] = "; ".join(problems)
        return row


def _release_graph(model: torch.nn.Module, cache: Any) -> None:
    """Let a graphed cache go: ``graphs.install`` keeps it in ``model._kvzoo_graphs``, a WeakKeyDictionary whose
    value (the DecodeGraph) holds the cache strongly, so the entry -- the cache's rows and the graph's memory pool --
    would live as long as the model (a fix belongs in ``kvzoo/framework/graphs.py``)."""
    registry = getattr(model, "_kvzoo_graphs", None)
    if registry is not None:
        registry.pop(cache, None)


def _memory_mark(device: str) -> int:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _memory_peak(device: str, base: int) -> float | None:
    if device == "cuda":
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return None  # CPU: no allocator peak to read without a subprocess per row
