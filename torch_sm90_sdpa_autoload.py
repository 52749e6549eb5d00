"""Zero-code enabling of torch_sm90_sdpa: torch's backend autoload hook.

torch (>= 2.5) calls the entry points of the group ``torch.backends`` at the end of
``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). Ours, declared in
pyproject.toml, is :func:`autoload`: with ``TORCH_SM90_SDPA`` set to anything but
``0`` / ``off`` / ``false`` / ``no`` / empty, it imports torch_sm90_sdpa, whose import
applies the variable (``torch_sm90_sdpa.routing.apply_env``), so that

    TORCH_SM90_SDPA=1 python train.py

routes the attention (backward, and masked forwards) of an unmodified script that never
imports the package.
Without the variable it does nothing: this module is top-level (not inside the package)
so that torch loading the entry point does not import torch_sm90_sdpa, and it imports
nothing but ``os``; ``import torch`` is not slower.

It never raises: torch turns an exception of an autoloaded backend into a RuntimeError of
``import torch``; a broken install warns (and logs on the ``torch_sm90_sdpa`` logger)
instead, and torch imports without the routing.
"""

import os

ENV_VAR = "TORCH_SM90_SDPA"
_OFF = ("", "0", "off", "false", "no")


def autoload() -> None:
    """The ``torch.backends`` entry point: applies ``TORCH_SM90_SDPA`` when it is set."""
    try:
        value = os.environ.get(ENV_VAR)
        if value is None or value.strip().lower() in _OFF:
            return
        import sys

        if "torch_sm90_sdpa" in sys.modules:
            # `import torch_sm90_sdpa` is what imports torch: the package applies the
            # variable itself at the end of its import
            return
        import torch_sm90_sdpa  # noqa: F401  (its import applies TORCH_SM90_SDPA)
    except Exception as exc:  # never break `import torch`
        _report(exc)


def _report(exc: BaseException) -> None:
    msg = (f"torch_sm90_sdpa: {ENV_VAR}={os.environ.get(ENV_VAR)!r} is set but routing could "
           f"not be enabled at `import torch` ({type(exc).__name__}: {exc}); torch works "
           "without it. `python -c \"import torch_sm90_sdpa\"` shows the full error.")
    try:
        import logging
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        logging.getLogger("torch_sm90_sdpa").debug("autoload failed", exc_info=exc)
    except Exception:
        pass
