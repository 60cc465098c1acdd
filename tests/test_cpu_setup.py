"""What `import sdrt` and the CPU backend set up for the BLAS and Numba runtimes."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py(code: str, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "NUMBA_CPU_FEATURES")}
    e.update(env)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          check=True, timeout=120).stdout.strip()


def test_import_sdrt_stops_openblas_spinning_unless_told_otherwise():
    show = "import os, sdrt; print(os.environ['OPENBLAS_THREAD_TIMEOUT'], sdrt._blas_spin_late)"
    assert _py(show) == "4 False"                         # sdrt first: OpenBLAS will read it
    assert _py("import numpy; " + show) == "4 True"       # numpy first: too late, and it says so
    assert _py(show, OPENBLAS_THREAD_TIMEOUT="12") == "12 False"  # the user's value is kept


def test_numba_target_keeps_the_users_settings(monkeypatch):
    from sdrt.ops import numba_target
    monkeypatch.setattr(numba_target, "_done", False)
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+sse2")
    numba_target.configure()
    assert os.environ["NUMBA_CPU_FEATURES"] == "+sse2"
    monkeypatch.setattr(numba_target, "_done", False)
    monkeypatch.delenv("NUMBA_CPU_FEATURES")
    monkeypatch.setenv("SDRT_NUMBA_PREFER_256", "1")
    numba_target.configure()
    assert "NUMBA_CPU_FEATURES" not in os.environ


def test_cpu_backend_asks_llvm_for_full_width_vectors_on_avx512():
    out = _py("import llvmlite.binding as ll, os; import sdrt.ops.cpu; "
              "print(bool(ll.get_host_cpu_features().get('avx512f')), os.environ.get('NUMBA_CPU_FEATURES', ''))")
    avx512, features = out.split(" ", 1) if " " in out else (out, "")
    if avx512 == "True":
        assert features.endswith(",-prefer-256-bit")
    else:
        assert features == ""
