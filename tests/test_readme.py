"""The README's Python examples run as copied (on CPU, as the README says)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _examples():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_has_examples():
    assert len(_examples()) >= 3


@pytest.mark.parametrize("index", range(len(_examples())))
def test_readme_example_runs_as_copied(index, tmp_path):
    script = tmp_path / f"example_{index}.py"
    script.write_text(_examples()[index])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_SM90_SDPA")}
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip(), "each example prints what it shows"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's second set-up command verbatim; the first keeps the user's
    torch (it installs the CPU build only where `import torch` fails)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        commands = re.findall(r"```bash\n(.*?)\n```", f.read(), flags=re.S)
    install, test = commands[0], commands[1]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read().splitlines()
    assert test in ci
    for command in (install, test):
        assert command.startswith('python -c "import torch" 2>/dev/null || pip install torch==')
