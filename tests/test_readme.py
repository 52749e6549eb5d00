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
