"""python -m torch_sm90_sdpa: the parser, errors for wrong input, help and info text.

(The demo runs are in test_compile_routing.py, TestCommandLine.)"""
import os
import re
import subprocess
import sys

import pytest

from torch_sm90_sdpa import __main__ as cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, env_var=None):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SM90_SDPA"}
    if env_var is not None:
        env["TORCH_SM90_SDPA"] = env_var
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "torch_sm90_sdpa", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_no_command():
    out = run_cli()
    assert out.returncode == 2, out
    assert out.stderr.startswith("usage: python -m torch_sm90_sdpa"), out.stderr
    assert "error: a command is needed: demo or info" in out.stderr, out.stderr
    assert out.stdout == ""


def test_unknown_command():
    out = run_cli("bogus")
    assert out.returncode == 2, out
    assert "invalid choice: 'bogus' (choose from 'demo', 'info')" in out.stderr.replace('"', "'")


def test_unknown_option():
    out = run_cli("info", "--bogus")
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr, out


def test_help_lists_the_commands():
    out = run_cli("--help")
    assert out.returncode == 0, out
    assert re.search(r"^\s+demo\s+train a small compiled transformer", out.stdout, re.M)
    assert re.search(r"^\s+info\s+what was built", out.stdout, re.M)


def _options(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_option_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(subparsers) == ["demo", "info"]
    for name, sub in subparsers.items():
        for action in _options(sub):
            assert action.help and len(action.help) > 10, (name, action.option_strings)


@pytest.mark.parametrize("command", ["demo", "info"])
def test_help_is_plain_text(command):
    text = cli.build_parser()._subparsers._group_actions[0].choices[command].format_help()
    for markup in (":func:", ":class:", ":mod:", "``"):
        assert markup not in text, (command, markup)


def test_demo_help():
    out = run_cli("demo", "--help")
    assert out.returncode == 0, out
    assert "Train a small compiled transformer with the rewrite." in out.stdout
    for option in ("--steps", "--vocab", "--lr", "--seed", "--device", "--only-faster"):
        assert option in out.stdout
    assert "``" not in out.stdout and ":func:" not in out.stdout


def test_info_in_words():
    out = run_cli("info")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "dtype code" not in text and "code -1" not in text, text
    assert "SM90 kernels:" in text and "GPUs:" in text, text
    assert "Routing: off (TORCH_SM90_SDPA is not set)" in text, text
    assert "fp32 (and fp64): served by the CPU reference only" in text, text
    assert "What would be routed" in text and "build_info():" not in text, text


def test_info_routing_on():
    out = run_cli("info", env_var="cpu")
    assert out.returncode == 0, out.stderr
    assert "Routing: on, for CUDA calls where our kernel measured faster than stock, and CPU " \
           "calls (to the CPU reference)" in out.stdout, out.stdout


def test_fp32_reason_in_words():
    import torch

    from torch_sm90_sdpa import eligibility

    if eligibility._extension.load() is None:
        pytest.skip("torch_sm90_sdpa._C is not built: the kernels' contract is not asked")
    why = eligibility.kernel_verdict(torch.float32, 64, 64, 8, 8, (9, 0), False)
    assert why.startswith("dtype: float32: the SM90 kernels serve fp16 and bf16 only"), why
