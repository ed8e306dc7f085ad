"""The package's layers import only downward (DESIGN.md): serve -> engine -> spec -> runner -> model -> ops -> pallas;
sampling and text serve the engine, runner and server; settings, errors and numerics are leaves. Nothing in the
package imports bench or experiments."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxinfer"
ORDER = ["cli", "serve", "engine", "spec", "runner", "model", "ops", "pallas"]   # each may import those after it
SERVICES = {"sampling": {"sampling", "text"}, "text": {"text"}}          # what each service layer may import
LEAVES = {"settings", "errors", "numerics"}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_layers_import_only_downward():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        layer = rel.parts[0].removesuffix(".py")
        for module in _imports(path):
            if module.split(".")[0] in ("bench", "experiments"):
                wrong.append((str(rel), module))
            if not module.startswith("jaxinfer.") or layer == "__init__":
                continue
            target = _layer(module)
            if target == layer or target in LEAVES:
                continue
            if layer in LEAVES:
                ok = False
            elif layer in SERVICES:
                ok = target in SERVICES[layer]
            elif target in SERVICES:
                ok = layer in ("cli", "serve", "engine", "spec", "runner")
            else:
                ok = ORDER.index(target) > ORDER.index(layer)
            if not ok:
                wrong.append((str(rel), module))
    assert wrong == []
