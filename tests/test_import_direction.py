"""The direction of imports (docs/architecture.md, "Import direction"): a module imports its own layer or those
below it, never one above. Read from the sources (every ``import`` and ``from ... import`` of ``conveyor``, at
module level or in a function; those under ``TYPE_CHECKING`` are for annotations and not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Top first: a module may import from its own layer and the layers after it. A module belongs to the first layer
# with a prefix it starts with (a prefix is a module or a package).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("conveyor.entrypoints.cli", "conveyor.__main__")),
    ("tools", ("conveyor.bench",)),
    ("offline API", ("conveyor.entrypoints.llm",)),
    ("frontend", ("conveyor.serving", "conveyor.plugins.transport", "conveyor.api", "conveyor.batches",
                  "conveyor.entrypoints.zmq_client")),
    ("engine", ("conveyor.engine", "conveyor.plugins.schedulers", "conveyor.plugins.kvcache",
                "conveyor.plugins.connector")),
    ("executor", ("conveyor.executor",)),
    ("worker", ("conveyor.worker",)),
    ("measures", ("conveyor.perf",)),
    ("model", ("conveyor.model", "conveyor.plugins.quant")),
    ("kernels", ("conveyor.attention", "conveyor.native")),
    # the plugin interfaces, the wire types and the config every process shares
    ("interfaces", ("conveyor",)),
]

# Imports that run the wrong way today, each with what it reaches for; the list may only shrink (an entry that no
# longer exists fails too, so that it is struck off).
KNOWN: dict[tuple[str, str], str] = {
    ("conveyor", "conveyor.entrypoints.llm"): "LLM, exported lazily by the package",
    ("conveyor.attention.backend", "conveyor.model.spec"): "the model's shape, to size the attention buffers",
    ("conveyor.attention.storage", "conveyor.model.formats"): "the KV cache's dtypes",
    ("conveyor.attention.storage", "conveyor.model.loader"): "a dtype table",
    ("conveyor.attention.torch_backend", "conveyor.model.invariant"): "the batch-invariant ops",
    ("conveyor.native.gemm_choice", "conveyor.model.ggml"): "GGUF's block formats",
    ("conveyor.transport", "conveyor.model.tokenizer"): "the Tokenizer the Frontend interface names",
    ("conveyor.connector", "conveyor.model.checkpoint"): "the checkpoint's files, for a KV fingerprint",
    ("conveyor.config.shortcuts", "conveyor.model.checkpoint"): "a model path checked as the CLI reads it",
}


def module_name(path: Path) -> str:
    """core/x/y.py is conveyor.x.y; plugins/a/b.py is conveyor.plugins.a.b (as the package installs them)."""
    relative = path.relative_to(REPO)
    parts = list(relative.with_suffix("").parts)
    parts = ["conveyor", *parts[1:]] if parts[0] == "core" else ["conveyor", "plugins", *parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, str]:
    """Every module of the package, by name: its source."""
    files = [*REPO.glob("core/**/*.py"), *REPO.glob("plugins/**/*.py")]
    return {module_name(path): path.read_text() for path in files}


def layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer")


def imports(module: str, source: str, modules: set[str]) -> set[str]:
    """The conveyor modules ``module`` imports (``from conveyor.x import y`` counts conveyor.x.y where that is a
    module, else conveyor.x), those under ``if TYPE_CHECKING:`` left out."""
    tree = ast.parse(source)
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    package = module if f"{module}.__init__" in modules or any(m.startswith(module + ".") for m in modules) \
        else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "conveyor"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "conveyor":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found - {module}


def wrong_way(modules: dict[str, str]) -> set[tuple[str, str]]:
    """Every import from a module to one in a layer above it."""
    names = set(modules)
    return {(module, imported) for module, source in modules.items() for imported in imports(module, source, names)
            if layer(imported) < layer(module)}


def test_imports_run_down_the_layers():
    found = wrong_way(sources())
    assert sorted(found - KNOWN.keys()) == [], "imports from a layer above (docs/architecture.md, Import direction)"
    assert sorted(KNOWN.keys() - found) == [], "gone: strike them off KNOWN"


def test_a_wrong_way_import_added_is_found():
    modules = sources()
    modules["conveyor.model.decoder"] += "\n\ndef _late():\n    from conveyor.engine import core  # noqa\n"
    modules["conveyor.kvcache"] += "\nimport conveyor.serving.frontend\n"
    assert wrong_way(modules) - KNOWN.keys() == {("conveyor.model.decoder", "conveyor.engine.core"),
                                                 ("conveyor.kvcache", "conveyor.serving.frontend")}


def test_every_module_is_in_a_layer():
    assert all(layer(module) >= 0 for module in sources())
