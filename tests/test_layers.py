"""The layers kvzoo keeps (docs/architecture.md): arrows point down, no import cycle, the policy layer needs torch
alone, and a dropped cache frees its memory without the cycle collector."""

from __future__ import annotations

import ast
import gc
import pathlib
import re
import subprocess
import sys

import torch

import kvzoo

PACKAGE = pathlib.Path(kvzoo.__file__).parent

# The one documented seam where the framework reaches up: names become policies and retrievers
# through the registry (kvzoo/framework/names.py).
SEAMS = {("kvzoo.framework.names", "kvzoo.registry")}
# The policy layer and the kernels: importable with torch alone (kvpress's environment pins an older
# transformers), so they import nothing of kvzoo above them.
POLICY_LAYER = {"kvzoo.framework.policy", "kvzoo.framework.retriever", "kvzoo.framework.buffers",
                "kvzoo.framework.plugins"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str], typing: bool = False) -> set[str]:
    """Every kvzoo module ``name`` imports, at module level or inside functions (under TYPE_CHECKING too when
    ``typing``)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not typing:
            return  # annotations only: never executed
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvzoo"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("kvzoo"):
                for alias in node.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("kvzoo"):
                add(arg.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(typing: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known, typing) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_cycle_anywhere_in_kvzoo():
    graph = _graph()
    assert sum(len(v) for v in graph.values()) > 50  # the walker sees the package's imports
    assert _cycles(graph) == []


def test_no_import_cycle_even_through_type_names():
    """Not even a ``TYPE_CHECKING`` import runs back: two modules that name each other's types are one module in
    two files (issue 46: the layer names a ``Host`` protocol, not the runtime)."""
    assert _cycles(_graph(typing=True)) == []


def test_the_framework_never_imports_policies_bench_or_the_registry_beyond_the_seam():
    upward = [
        (src, dst) for src, dsts in _graph().items() if src.startswith("kvzoo.framework")
        for dst in dsts
        if dst.startswith(("kvzoo.policies", "kvzoo.retrievers", "kvzoo.bench", "kvzoo.registry", "kvzoo.cli",
                           "kvzoo.pipeline"))
        and (src, dst) not in SEAMS
    ]
    assert upward == []


# The user layer: it uses the cache and never reaches into it; nothing below it imports it.
USER_LAYER = ("kvzoo.bench", "kvzoo.cli", "kvzoo.demo", "kvzoo.pipeline")

def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_pipeline_is_a_user_layer_module_not_a_framework_one():
    graph = _graph()
    assert "kvzoo.pipeline" in graph
    assert not (PACKAGE / "framework" / "pipeline.py").exists()
    assert not [m for m in graph if m.startswith("kvzoo.framework") and m.rpartition(".")[2] == "pipeline"]
    # it drives the cache (framework) and is driven by bench and cli, never the other way round
    assert not {d for d in graph["kvzoo.pipeline"] if _in(d, "kvzoo.bench", "kvzoo.cli")}
    assert "kvzoo.pipeline" in graph["kvzoo.bench.trial"]  # one trial is built from its steps


def test_nothing_below_the_user_layer_imports_bench_or_the_pipeline():
    upward = sorted(
        (src, dst) for src, dsts in _graph().items() if src != "kvzoo" and not _in(src, *USER_LAYER)
        for dst in dsts if _in(dst, *USER_LAYER)
    )
    assert upward == []


def test_refmodel_imports_nothing_of_bench_and_loads_without_it():
    graph = _graph()
    refmodel = [m for m in graph if _in(m, "kvzoo.refmodel")]
    assert len(refmodel) >= 3
    assert [(m, d) for m in refmodel for d in graph[m] if _in(d, *USER_LAYER)] == []
    code = ("import sys, kvzoo.refmodel.data\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kvzoo.bench', 'kvzoo.pipeline'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_policy_layer_and_kernels_import_nothing_above_them():
    graph = _graph()
    for src in POLICY_LAYER | {m for m in graph if m.startswith("kvzoo.kernels")}:
        above = {dst for dst in graph[src] if dst not in POLICY_LAYER and not dst.startswith("kvzoo.kernels")}
        assert above - {"kvzoo"} == set(), (src, above)
    for src in (m for m in graph if m.startswith("kvzoo.policies")):  # concrete policies: the policy layer only
        # (and retrievers: Quest's policy names its paging, which its retriever declares)
        allowed = ("kvzoo.kernels", "kvzoo.policies", "kvzoo.retrievers")
        assert {d for d in graph[src] if not d.startswith(allowed)} <= POLICY_LAYER | {"kvzoo"}, src
        assert not {d for d in graph[src] if d.startswith("kvzoo.policies.") and d != src}, f"{src} imports a policy"
    for src in (m for m in graph if m.startswith("kvzoo.retrievers")):  # retrievers: the policy layer, never a policy
        assert {d for d in graph[src] if not d.startswith(("kvzoo.kernels", "kvzoo.retrievers"))} \
            <= POLICY_LAYER | {"kvzoo"}, src


def test_the_policy_layer_imports_with_torch_alone():
    """transformers made unimportable: the policy layer, every built-in policy and the kernels still load."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvzoo.framework.policy, kvzoo.framework.retriever, kvzoo.kernels.attention, kvzoo.kernels.index_scan\n"
        "import kvzoo.policies.full, kvzoo.policies.streaming_llm, kvzoo.policies.snapkv, kvzoo.policies.h2o\n"
        "import kvzoo.policies.chunkkv, kvzoo.policies.quest, kvzoo.policies.vestige\n"
        "import kvzoo.retrievers.vestige, kvzoo.retrievers.quest\n"
        "from kvzoo.policies.snapkv import SnapKV\n"
        "assert 'transformers' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print(SnapKV(ratio=4).config()['name'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "snapkv"


def test_no_framework_module_imports_refmodel():
    """The reference twins register their own adapter (kvzoo.refmodel.adapter); the framework knows none of them."""
    graph = _graph()
    assert sorted((src, dst) for src, dsts in graph.items() if src.startswith("kvzoo.framework")
                  for dst in dsts if dst.startswith("kvzoo.refmodel")) == []
    imports = re.compile(r"from\s+kvzoo\.refmodel|import\s+kvzoo\.refmodel|import_module\(\s*[\"']kvzoo\.refmodel")
    assert [p.name for p in (PACKAGE / "framework").rglob("*.py") if imports.search(p.read_text())] == []


def test_the_cache_asks_its_adapter_and_never_probes_it():
    """cache.py reads the adapter through its protocol (geometry, attention_modules, untiered_layer): no
    getattr/hasattr on it, no model type or family named."""
    source = (PACKAGE / "framework" / "cache.py").read_text()
    probes = [ast.unparse(node) for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr")
              and "adapter" in ast.unparse(node.args[0])]
    assert probes == []
    assert not re.search(r"kv_lora_rank|model_type|LinearAttentionLayer", source)


def test_a_model_family_registered_from_outside_the_package_runs(monkeypatch):
    """tests/plugin_family.py: an adapter for model type "toy_llama", registered through the kvzoo_adapters hook;
    before it, kvzoo refuses the model naming the supported types; after it, the model decodes under a policy as
    the same weights do as a Llama."""
    from kvzoo import TieredCache, pipeline, registry
    from kvzoo.models import tiny_llama

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    import plugin_family

    ids = torch.arange(40).view(1, 40) % 50 + 3

    def decode(model) -> list[int]:
        cache = TieredCache(model, "streaming_llm(ratio=2)", context_length=ids.shape[1])
        with torch.no_grad():
            logits = pipeline.prefill(model, cache, ids, None)
            pipeline.compress(cache)
            return pipeline.greedy_decode(model, cache, logits, 6, set())

    llama, _ = tiny_llama()
    expected = decode(llama)
    toy, _ = tiny_llama()
    toy.config.model_type = "toy_llama"
    try:
        TieredCache(toy, "full")
    except ValueError as err:
        assert "model_type='toy_llama'" in str(err) and "supported: llama" in str(err)
    else:
        raise AssertionError("an unregistered model type was accepted")
    registry.register_plugin(plugin_family)
    try:
        assert registry.adapters()["toy_llama"] is plugin_family.ToyLlamaAdapter
        assert decode(toy) == expected
        assert isinstance(TieredCache(toy, "full").adapter, plugin_family.ToyLlamaAdapter)
    finally:
        registry.unregister_plugin(plugin_family)
        registry.reload()


def _rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", pathlib.Path("/proc/self/status").read_text()).group(1)) / 1024


def test_a_dropped_cache_is_freed_without_the_cycle_collector(tiny):
    """200 caches, each after a generate over 1,000 tokens (~1.5 MiB of rows), dropped with gc disabled."""
    from kvzoo import TieredCache, registry

    ids = torch.randint(1, 256, (1, 1000), generator=torch.Generator().manual_seed(0))
    policy = registry.get("streaming_llm", ratio=4)  # rows in the tier and the archive, an index-free policy

    def one() -> None:
        cache = TieredCache(tiny, policy)
        tiny.generate(ids, max_new_tokens=2, do_sample=False, cache=cache, pad_token_id=0)

    one()  # warm-up: allocator pools, lazily imported modules
    gc.collect()
    gc.disable()
    try:
        before = _rss_mib()
        for _ in range(200):
            one()
        growth = _rss_mib() - before
    finally:
        gc.enable()
    assert growth < 50, f"RSS grew {growth:.0f} MiB over 200 dropped caches"


def test_a_policy_writes_one_method_and_the_readme_example_writes_only_that():
    """Policy's one abstract method is priority (the rule as a score read by slot); select and step_victim derive
    from it. The README's example policy, registered from outside the package (tests/test_readme_example.py runs
    it), writes that method and no other."""
    from kvzoo.framework.policy import Policy
    from tests.test_readme_example import _example_source

    assert Policy.__abstractmethods__ == {"priority"}
    classes = [node for node in ast.parse(_example_source()).body if isinstance(node, ast.ClassDef)]
    assert len(classes) == 1
    methods = [node.name for node in classes[0].body if isinstance(node, ast.FunctionDef)]
    assert methods == ["priority"]


PARTS = ("store", "counts", "observed")  # a layer's parts: what the runtime reads of them counts too
# a parameter annotated with one of these holds a layer or one of its parts
HOLDERS = {"RuntimeLayer": "layer", "KVLayer": "layer", "LayerStorage": "store", "LayerCounters": "counts",
           "Observed": "observed"}


def _holder(node: ast.AST, held: dict[str, str]) -> str | None:
    """What ``node`` holds of a layer (``"layer"`` or a part's name; None: nothing), ``held``: the local names that
    hold one."""
    if isinstance(node, ast.Name):
        return held.get(node.id)
    if isinstance(node, ast.Attribute) and _holder(node.value, held) == "layer" and node.attr in PARTS:
        return node.attr
    return None


def _layer_names_read_by_runtime(source: str) -> tuple[set[str], set[str], list[str]]:
    """Every name ``source`` (``framework/runtime.py``) touches of a layer, counted strictly: the layer's own
    (``layer.X``) and those of its parts (``store.X`` for ``layer.store.X``), through any local name that holds the
    layer or a part (an alias, a tuple unpacking, a parameter annotated with its type); and the escapes: a layer or a
    part used other than by an attribute or handed to one of the runtime's own methods (``getattr(store, ...)``, a
    helper elsewhere), which would hide names from the count."""
    tree = ast.parse(source)
    methods = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    own: set[str] = set()
    parts: set[str] = set()
    escapes: list[str] = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        held = {a.arg: HOLDERS.get(ast.unparse(a.annotation).strip("'\""), "layer" if a.arg == "layer" else None)
                for a in function.args.args + function.args.kwonlyargs if a.annotation is not None or a.arg == "layer"}
        held = {name: kind for name, kind in held.items() if kind is not None}

        allowed: set[int] = set()  # nodes that hold a layer or a part where that is no escape
        aliases = [(target, value) for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for whole in (node.targets if isinstance(node, ast.Assign) else [node.target])
                   for target, value in (zip(whole.elts, node.value.elts) if isinstance(whole, ast.Tuple)
                                         and isinstance(node.value, ast.Tuple) else [(whole, node.value)])
                   if isinstance(target, ast.Name) and value is not None]
        while True:  # an alias of an alias, in whatever order the walk meets them
            found = {(target.id, id(value), _holder(value, held)) for target, value in aliases if _holder(value, held)}
            if all(held.get(name) == kind for name, _, kind in found):
                break
            held.update((name, kind) for name, _, kind in found)
        allowed.update(value for _, value, _ in found)
        for node in ast.walk(function):
            holder = _holder(node.value, held) if isinstance(node, ast.Attribute) else None
            if holder:
                allowed.add(id(node.value))
                if holder == "layer":
                    own.add(node.attr)
                else:
                    parts.add(f"{holder}.{node.attr}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith("self.") \
                    and ast.unparse(node.func)[5:] in methods:
                allowed.update(id(arg) for arg in node.args + [k.value for k in node.keywords])
        for node in ast.walk(function):
            stored = isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
            if _holder(node, held) and id(node) not in allowed and not stored:
                escapes.append(f"{function.name}: {ast.unparse(node)}")
    return own, parts, escapes


def _runtime_source() -> str:
    return (PACKAGE / "framework" / "runtime.py").read_text()


def test_the_runtime_reaches_a_layer_through_a_small_named_interface():
    """Issue 46: the runtime reads a layer only through ``RuntimeLayer``, and of the layer and its parts (storage,
    counters, observations) at most 12 names in all, counted strictly: the few it decides with and one operation per
    intention (``store.evict``, ``observed.drop_inputs``). 33 names before the issue, 16 before ``store.evict``."""
    from kvzoo.framework.layer import RuntimeLayer

    members = {name for name in vars(RuntimeLayer) if not name.startswith("_")} | set(RuntimeLayer.__annotations__)
    own, parts, escapes = _layer_names_read_by_runtime(_runtime_source())
    assert len(members) <= 12, sorted(members)
    assert own <= members, f"the runtime reads {sorted(own - members)} of a layer, outside RuntimeLayer"
    assert escapes == [], f"a layer or a part used other than by name: {escapes}"
    names = (own - set(PARTS)) | parts
    assert len(names) <= 12, sorted(names)


def test_the_strict_count_sees_every_way_to_a_layer_name():
    """The count above is honest: a 13th name, through an alias, a parameter or a tuple, counts; a ``getattr`` or a
    part handed to a helper is an escape."""
    source = _runtime_source()
    own, parts, _ = _layer_names_read_by_runtime(source)
    before = (own - set(PARTS)) | parts
    extra = source + (
        "\n\ndef probe(self, layer: RuntimeLayer, rows: LayerStorage) -> None:\n"
        "    policy, store = self.policy, layer.store\n"
        "    kept = store.row_bytes() + rows.capacity + layer.counts.events + layer.layer_idx\n"
        "    observed = layer.observed\n"
        "    observed.scaling = getattr(store, 'n')\n"
        "    helper(layer.counts)\n"
    )
    own, parts, escapes = _layer_names_read_by_runtime(extra)
    assert (own - set(PARTS)) | parts == before | {"store.row_bytes", "store.capacity", "counts.events", "layer_idx",
                                                   "observed.scaling"}
    assert escapes == ["probe: store", "probe: layer.counts"]
