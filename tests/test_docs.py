"""The documentation: a short README that opens with the two commands, a site that builds with
``mkdocs build --strict`` (a broken link, a missing page or a page left out of the nav fails), and a
configuration reference generated from the code, with a doc line for every key."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from conveyor.config.reference import CORE_TABLES, reference_markdown, undocumented
from conveyor.connector import KVConnector, KVConnectorWorker
from conveyor.scheduling.gates import AdmissionGate
from conveyor.kvcache import KVCacheManager
from conveyor.quant import QuantMethod
from conveyor.registry import PluginRegistry
from conveyor.scheduler import Scheduler
from conveyor.transport import Transport

REPO = Path(__file__).resolve().parent.parent


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    opening = "\n".join(lines[:6])
    assert "make serve" in opening and "make test" in opening


def test_every_config_key_has_a_doc_line():
    registry = PluginRegistry()
    structs = dict(CORE_TABLES)
    for kind in ("scheduler", "kvcache", "quant", "transport"):
        for name in registry.names(kind):
            structs[f"{kind} {name}"] = registry.get(kind, name).Options
    missing = {table: fields for table, struct in structs.items() if (fields := undocumented(struct))}
    assert not missing, f"keys without a comment above them: {missing}"


class _Options(msgspec.Struct):
    # documented
    one: int = 1
    two: int = 2


def test_a_key_without_a_comment_is_found():
    assert undocumented(_Options) == ["two"]


def test_the_configuration_page_is_the_generated_one():
    """docs/configuration.md is what `python -m conveyor.config.reference` writes (`make docs` rewrites it)."""
    assert (REPO / "docs" / "configuration.md").read_text() == reference_markdown()


def test_the_site_builds_strict(tmp_path):
    """With the ``mkdocs`` command a contributor types (the venv's console script; ``python -m mkdocs`` puts the
    current folder on sys.path where the script puts its own, beside the ``conveyor`` script)."""
    pytest.importorskip("mkdocs")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    result = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            check=False, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "match_prefix" in api and "KVCacheManager" in api  # (the docstrings made it in)
    assert "take_payload" in api and "KVConnectorWorker" in api


def _plugin_base_classes() -> dict[str, type]:
    """What a plugin author subclasses, found from the hooks: each kind's base class (the registry checks every
    registration against it), the classes of ours it inherits from (an admission gate's methods, a scheduler's
    gates), and those it names in a ``type[...]`` class attribute (a KV connector's worker side); by dotted name.
    """
    from conveyor import hookspecs
    from conveyor.registry import KIND_BASES, KIND_HOOKS

    hooks = {name for name in vars(hookspecs) if name.startswith("conveyor_register_")}
    assert hooks == set(KIND_HOOKS.values())  # (a hook without a base class would escape the checks below)
    found: dict[str, type] = {}
    for module_name, class_name in KIND_BASES.values():
        module = importlib.import_module(module_name)
        base = getattr(module, class_name)
        named = [getattr(module, name, None) for annotation in vars(base).get("__annotations__", {}).values()
                 for name in re.findall(r"type\[(\w+)\]", str(annotation))]
        for cls in [*base.__mro__, *named]:
            if isinstance(cls, type) and cls.__module__.startswith("conveyor."):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_plugin_base_class_is_in_the_api_reference_and_the_plugin_guide():
    """docs/api.md renders each (``::: conveyor.x.Class``), and docs/plugins.md's "The interfaces" names each
    with the file it is in."""
    classes = _plugin_base_classes()
    assert {"conveyor.connector.KVConnectorWorker", "conveyor.scheduling.gates.AdmissionGate", "conveyor.scheduler.Scheduler",
            "conveyor.transport.Transport"} <= set(classes)
    rendered = set(re.findall(r"^::: (\S+)$", (REPO / "docs" / "api.md").read_text(), re.MULTILINE))
    assert sorted(set(classes) - rendered) == [], "not in docs/api.md"
    guide = (REPO / "docs" / "plugins.md").read_text().split("\n## The interfaces\n", 1)[1].split("\n## ")[0]
    unlisted = [name for name in classes
                if f"`{name}`" not in guide or f"core/{'/'.join(name.split('.')[1:-1])}.py" not in guide]
    assert unlisted == [], "not in docs/plugins.md's interfaces (dotted name and file)"


def _methods(cls):
    for name, member in cls.__dict__.items():
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if (not name.startswith("_") or name == "__init__") and inspect.isfunction(function):
            yield name, function, isinstance(member, property)


@pytest.mark.parametrize("cls", sorted({KVCacheManager, QuantMethod, Scheduler, Transport, AdmissionGate, KVConnector,
                                        KVConnectorWorker, *_plugin_base_classes().values()}, key=repr),
                         ids=lambda c: c.__name__)
def test_every_base_class_method_has_a_docstring(cls):
    assert [name for name, function, _ in _methods(cls) if not inspect.getdoc(function)] == []


@pytest.mark.parametrize("cls", [KVCacheManager, QuantMethod, KVConnector, KVConnectorWorker],
                         ids=lambda c: c.__name__)
def test_the_methods_a_layout_or_quant_method_implements_say_their_args_and_returns(cls):
    missing = []
    for name, function, is_property in _methods(cls):
        doc, signature = inspect.getdoc(function), inspect.signature(function)
        if any(p not in ("self", "cls") for p in signature.parameters) and "Args:" not in doc:
            missing.append(f"{name}: Args")
        returns = signature.return_annotation not in (None, "None", inspect.Signature.empty)
        if returns and name != "__init__" and not is_property and "Returns:" not in doc:
            missing.append(f"{name}: Returns")
    assert missing == []


def test_the_grafana_dashboard_reads_only_metrics_the_server_exports():
    """docs/grafana/conveyor.json: valid JSON whose every query names series that /metrics renders."""
    import json
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from conveyor.serving.metrics import ServerMetrics

    dashboard = json.loads((REPO / "docs" / "grafana" / "conveyor.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    wanted = {name for expr in exprs for name in re.findall(r"conveyor_[a-z_]+", expr)}
    metrics = ServerMetrics("m")
    metrics.request_done("stop", 1.0, 5)  # (requests by finish reason show once one has finished)
    rendered = metrics.render(True, 0).decode()
    exported = {sample.name for family in text_string_to_metric_families(rendered) for sample in family.samples}
    assert len(wanted) >= 12 and wanted <= exported, wanted - exported


def test_the_metrics_table_lists_every_family_the_server_exports():
    """docs/observability.md's "Every metric" table: each family a server can register (several replicas, prefill
    and decode roles, a GPU under NVML) is a row of it with its type, and each row is such a family."""
    import re
    from types import SimpleNamespace

    from conveyor.serving.metrics import ServerMetrics
    from conveyor.serving.nvml import GpuGauges
    from conveyor.serving.role_metrics import RoleMetrics

    metrics = ServerMetrics("m", 2, replica_alive=lambda replica: True, replica_in_flight=lambda replica: 0)
    RoleMetrics(metrics.registry, "m", ["prefill", "decode"])
    GpuGauges(SimpleNamespace(nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i),
              metrics.registry, "m")
    # (a counter is scraped as NAME_total)
    exported = {family.name + ("_total" if family.type == "counter" else ""): family.type
                for family in metrics.registry.collect()}
    section = (REPO / "docs" / "observability.md").read_text().split("\n## Every metric\n", 1)[1].split("\n## ")[0]
    documented = dict(re.findall(r"^\| `(conveyor_\w+)` \| (\w+) \|", section, re.MULTILINE))
    assert len(exported) >= 60
    assert sorted(set(exported) - set(documented)) == [], "exported, not in the table"
    assert sorted(set(documented) - set(exported)) == [], "in the table, not exported"
    assert {name: kind for name, kind in documented.items() if exported[name] != kind} == {}


def _code_blocks(page: str, language: str) -> list[str]:
    import re

    return re.findall(rf"```{language}\n(.*?)```", (REPO / "docs" / page).read_text(), re.DOTALL)


def test_the_zmq_pages_config_example_loads_and_builds_as_pasted(tmp_path):
    """docs/zmq-protocol.md's first TOML block, pasted into a file: it loads, serves HTTP beside ZeroMQ, and its
    transports build (CURVE stays commented out until the key files exist)."""
    from conveyor.config import load_config

    path = tmp_path / "zmq.toml"
    path.write_text(_code_blocks("zmq-protocol.md", "toml")[0])
    config = load_config(path)
    assert [spec.plugin for spec in config.transport] == ["http", "zmq"]
    registry = PluginRegistry.of(config)
    for spec in config.transport:
        registry.build("transport", spec)


def test_the_plugin_pages_quant_example_checks_a_config_without_torch_and_keeps_the_bias(tmp_path):
    """docs/plugins.md's quant method, its two modules saved as the page names them: a config selecting it loads
    with torch unimportable, and without importing the code; in another process the method builds, and its
    linear is ``F.linear`` with the bias it was given."""
    blocks = _code_blocks("plugins.md", "python")
    (tmp_path / "my_quant.py").write_text(next(b for b in blocks if 'Declaration("half"' in b))
    (tmp_path / "my_quant_half.py").write_text(next(b for b in blocks if "class HalfWeights" in b))
    (tmp_path / "half.toml").write_text(next(b for b in _code_blocks("plugins.md", "toml") if '"half"' in b))
    frontend = (
        "import sys; sys.modules['torch'] = None\n"
        "from conveyor.config import load_config\n"
        "config = load_config('half.toml')\n"
        "assert (config.quant.plugin, config.quant.options.prune_below) == ('half', 1e-4), config.quant\n"
        "assert 'my_quant_half' not in sys.modules\n"
    )
    worker = (
        "import torch, torch.nn.functional as F\n"
        "from conveyor.config import PluginSpec, load_config\n"
        "from conveyor.registry import PluginRegistry\n"
        "config = load_config('half.toml')\n"
        "spec = PluginSpec('half', None)\n"
        "method = PluginRegistry.of(config).build('quant', spec, torch.float32, torch.device('cpu'))\n"
        "w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)\n"
        "expected = F.linear(x, w.to(torch.bfloat16).float(), b)\n"
        "torch.testing.assert_close(method.linear(x, method.prepare(w, b)), expected)\n"
    )
    for check in (frontend, worker):
        result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert result.returncode == 0, result.stderr[-2000:]


def test_each_operating_tool_has_a_heading_of_its_own():
    import re

    headings = re.findall(r"^## (.+)$", (REPO / "docs" / "observability.md").read_text(), re.MULTILINE)
    for tool in ("The doctor", "The live dashboard", "Simulate", "Plan", "Grafana"):
        assert tool in headings, headings


def test_the_offline_pages_first_command_prints_what_the_page_says():
    """docs/offline.md opens with a command and the answer it prints (the default config's greedy reply)."""
    block = (REPO / "docs" / "offline.md").read_text().split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    command, answer = block[0], block[1]
    assert command.startswith(".venv/bin/conveyor generate ") and answer.startswith("# ")
    argv = [sys.executable, "-m", "conveyor", *shlex.split(command)[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == answer.removeprefix("# ")
