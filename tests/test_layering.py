"""The package layering (cli -> engine -> io -> models -> ops <- gpu: DESIGN.md's, with io reading
the model-family registry to detect and name files): sdrt.ops imports nothing from sdrt.gpu, and no
two packages import each other, even through others. Every import counts, also those inside
functions, read with `ast`."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sdrt")
PACKAGES = ("ops", "gpu", "io", "models", "engine", "cli")


def _module_of(path: str) -> list[str]:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
    return rel[:-1] if rel[-1] == "__init__" else rel


def imports():
    """(importing module, imported module) for every import statement under sdrt/."""
    for base, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(base, f)
            mod = _module_of(path)
            pkg = mod if f == "__init__.py" else mod[:-1]
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        yield ".".join(mod), a.name
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        target = pkg[: len(pkg) - node.level + 1] + (node.module.split(".") if node.module else [])
                    else:
                        target = node.module.split(".")
                    names = [".".join(target)]
                    if not node.module or node.level and len(target) <= 2:
                        names += [".".join(target + [a.name]) for a in node.names]
                    for n in names:
                        yield ".".join(mod), n


def _package(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "sdrt" and parts[1] in PACKAGES else None


def package_graph() -> dict[str, set[str]]:
    g = {p: set() for p in PACKAGES}
    for src, dst in imports():
        a, b = _package(src), _package(dst)
        if a and b and a != b:
            g[a].add(b)
    return g


def test_ops_imports_nothing_from_gpu():
    bad = sorted({(s, d) for s, d in imports() if _package(s) == "ops" and _package(d) == "gpu"})
    assert not bad, f"sdrt.ops must not import sdrt.gpu (backends register themselves): {bad}"


def test_no_import_cycle_between_packages():
    g = package_graph()
    cycles = []

    def visit(path):
        for nxt in sorted(g[path[-1]]):
            if nxt == path[0]:
                cycles.append(" -> ".join(path + [nxt]))
            elif nxt not in path:
                visit(path + [nxt])
    for p in PACKAGES:
        visit([p])
    assert not cycles, f"import cycles between sdrt packages: {cycles}; package imports: {g}"


def test_the_scan_sees_imports():
    # the scan is not vacuous: it finds the layering's known edges
    g = package_graph()
    assert "ops" in g["gpu"] and "ops" in g["models"] and "engine" in g["cli"]


def test_gpu_path_loads_no_cpu_kernels(tmp_path):
    """What a GPU run does on the host (parse sd-cli's flags, load the files, draw the noise) loads
    neither sdrt.ops.cpu nor Numba: they cost a one-image CUDA command ~1.5 s (profiled on the
    H200). The CPU kernels load with the CPU backend."""
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    code = f"""
import sys
sys.path.insert(0, {tests!r})
import flux_tiny
from sdrt.cli.main import build_parser
from sdrt.engine.model_manager import load_models
from sdrt.engine.params import ModelParams
from sdrt.engine.rng import make_rng
from sdrt.ops.threads import set_threads
build_parser()
set_threads(2)
args = flux_tiny.write({str(tmp_path)!r})
load_models(ModelParams(model=args[1]))
make_rng("cuda", 42).randn((1, 16, 8, 8))
bad = [m for m in ("numba", "sdrt.ops.cpu") if m in sys.modules]
assert not bad, bad
"""
    subprocess.run([sys.executable, "-c", code], check=True)
