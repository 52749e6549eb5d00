"""Zero-code enabling (the torch.backends entry point) and what importing the package costs.

Each check runs in a fresh interpreter: what matters is which modules an import pulls in.
"""
import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINT = "torch_sm90_sdpa_autoload:autoload"


def run_python(code, tmp_path, env_var=None, pythonpath=(), autoload=True, timeout=600):
    """Run `code` in a fresh interpreter (this checkout first on its path, cwd tmp_path) with
    TORCH_SM90_SDPA set to `env_var` (unset when None); returns the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SM90_SDPA"}
    if env_var is not None:
        env["TORCH_SM90_SDPA"] = env_var
    if not autoload:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    else:
        env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, pythonpath), REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor-cache")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check(out):
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def entry_point_installed() -> bool:
    return any(ep.value.replace(" ", "") == ENTRY_POINT
               for ep in importlib.metadata.entry_points(group="torch.backends"))


needs_entry_point = pytest.mark.skipif(
    not entry_point_installed(),
    reason="the torch.backends entry point torch_sm90_sdpa_autoload:autoload is not installed "
           "in this environment (pip install the package: a plain checkout on PYTHONPATH has "
           "no entry points)")


def test_pyproject_declares_the_entry_point():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["entry-points"]["torch.backends"] == {"torch_sm90_sdpa": ENTRY_POINT}
    assert "torch_sm90_sdpa_autoload" in project["tool"]["setuptools"]["py-modules"]


# ---------------------------------------------------------------------------------------
# importing the package
# ---------------------------------------------------------------------------------------


def test_package_import_does_not_import_inductor(tmp_path):
    check(run_python("""
        import sys
        import torch_sm90_sdpa
        assert "torch._inductor" not in sys.modules, "import"
        stats = torch_sm90_sdpa.routing_stats()
        assert not stats["enabled"] and stats["routed_nodes"] == {}, stats
        torch_sm90_sdpa.routing_stats(summary=True)
        torch_sm90_sdpa.routing.is_enabled()
        torch_sm90_sdpa.routing.reset_stats()
        torch_sm90_sdpa.disable()
        assert "torch._inductor" not in sys.modules, "routing_stats / disable"
        assert "sympy" not in sys.modules, "sympy"
        torch_sm90_sdpa.enable(cpu=True)
        assert "torch._inductor" in sys.modules
        assert torch_sm90_sdpa.routing_stats()["enabled"]
        import torch._inductor.config as c
        assert type(c.post_grad_custom_post_pass).__name__ == "SdpaBackwardRewrite"
        torch_sm90_sdpa.disable()
        assert not torch_sm90_sdpa.routing_stats()["enabled"]
        assert c.post_grad_custom_post_pass is None
    """, tmp_path, autoload=False))


@pytest.mark.parametrize("value,enabled,cpu", [("cpu", True, True), ("1", True, False),
                                               ("off", False, False)])
def test_variable_at_package_import(tmp_path, value, enabled, cpu):
    out = check(run_python("""
        import torch_sm90_sdpa
        s = torch_sm90_sdpa.routing_stats()
        print(s["enabled"], s["cpu"])
    """, tmp_path, env_var=value, autoload=False))
    assert out.stdout.split() == [str(enabled), str(cpu)]


# ---------------------------------------------------------------------------------------
# the autoload function (called directly: works with or without the entry point installed)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "0", "off", "OFF", "false", "no"])
def test_autoload_does_nothing_without_the_variable(tmp_path, value):
    check(run_python("""
        import sys
        import torch_sm90_sdpa_autoload
        torch_sm90_sdpa_autoload.autoload()
        loaded = sorted(m for m in sys.modules if m.startswith(("torch", "torch_sm90_sdpa")))
        assert loaded == ["torch_sm90_sdpa_autoload"], loaded
    """, tmp_path, env_var=value, autoload=False))


def test_autoload_enables_routing(tmp_path):
    out = check(run_python("""
        import sys
        import torch_sm90_sdpa_autoload
        torch_sm90_sdpa_autoload.autoload()
        s = sys.modules["torch_sm90_sdpa"].routing_stats()
        print(s["enabled"], s["cpu"])
    """, tmp_path, env_var="cpu", autoload=False))
    assert out.stdout.split() == ["True", "True"]


def test_autoload_never_raises(tmp_path):
    """A broken install (here a torch_sm90_sdpa that fails to import, first on the path)
    warns; the caller (torch's import) goes on."""
    broken = tmp_path / "broken" / "torch_sm90_sdpa"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    out = check(run_python("""
        import warnings
        import torch_sm90_sdpa_autoload
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch_sm90_sdpa_autoload.autoload()
        messages = [str(x.message) for x in w]
        assert any("simulated broken install" in m for m in messages), messages
        print("ok")
    """, tmp_path, env_var="1", pythonpath=[broken.parent], autoload=False))
    assert out.stdout.strip() == "ok"


def test_autoload_when_the_package_imports_torch(tmp_path):
    """`import torch_sm90_sdpa` first: torch's import calls the entry point while the package
    is half imported; it leaves the variable to the package (one enable, no error)."""
    out = check(run_python("""
        import sys
        sys.modules.setdefault("torch_sm90_sdpa", type(sys)("torch_sm90_sdpa"))  # half imported
        import torch_sm90_sdpa_autoload
        torch_sm90_sdpa_autoload.autoload()
        print(hasattr(sys.modules["torch_sm90_sdpa"], "routing"))
    """, tmp_path, env_var="cpu", autoload=False))
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------
# through torch's autoload (the entry point installed)
# ---------------------------------------------------------------------------------------


@needs_entry_point
def test_import_torch_without_the_variable_imports_nothing(tmp_path):
    check(run_python("""
        import sys, torch
        assert "torch_sm90_sdpa_autoload" in sys.modules  # torch loaded the entry point
        assert "torch_sm90_sdpa" not in sys.modules
    """, tmp_path))


@needs_entry_point
def test_unmodified_script_is_routed(tmp_path):
    """TORCH_SM90_SDPA=cpu and a script that never imports torch_sm90_sdpa: its compiled
    attention backward is ours."""
    out = check(run_python("""
        import sys, torch
        import torch.nn.functional as F
        stats = lambda: sys.modules["torch_sm90_sdpa"].routing_stats()
        assert stats()["enabled"] and stats()["cpu"], stats()
        def loss(q, k, v, w):
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum()
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
        torch.compile(loss)(q, k, v, torch.randn(1, 2, 8, 16)).backward()
        print(stats()["routed_calls"], stats()["routed_nodes"])
    """, tmp_path, env_var="cpu"))
    assert out.stdout.split("\n")[0] == "1 {'cpu': 1}", out.stdout + out.stderr


@needs_entry_point
def test_import_torch_survives_a_broken_install(tmp_path):
    broken = tmp_path / "broken" / "torch_sm90_sdpa"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    out = check(run_python("import torch; print(torch.ones(2).sum().item())", tmp_path,
                           env_var="1", pythonpath=[broken.parent]))
    assert out.stdout.strip() == "2.0"
    assert "simulated broken install" in out.stderr
