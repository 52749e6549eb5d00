"""transformers' attention interface: ``attn_implementation="sm90_sdpa"``.

    import torch_sm90_sdpa.transformers_attention as sm90_attention
    sm90_attention.register()        # once per process, before the model is built or loaded
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="sm90_sdpa")

:func:`register` adds :func:`sdpa_attention_forward` to transformers' ``AttentionInterface``
under the given name (and, where transformers has one, the mask function of ``"sdpa"`` to its
``AttentionMaskInterface``, so the model builds the masks it builds for ``"sdpa"``: a padded
batch gets its boolean mask, an unpadded causal one ``is_causal=True``). The forward does what
transformers' ``"sdpa"`` forward does (grouped-query heads, the ``is_causal`` rule, the layout
of the result) but calls :func:`torch_sm90_sdpa.scaled_dot_product_attention`, so training
runs our backward in eager mode and under ``torch.compile`` alike, with no routing switch;
calls the drop-in does not serve (no gradient, dropout, ...) run stock SDPA as ``"sdpa"``
runs them.

transformers is imported by :func:`register` only, never at package import. Versions 4.48
and later are supported: ``AttentionInterface`` from 4.51, the ``ALL_ATTENTION_FUNCTIONS``
dict it replaced before; before 4.53 the models build their masks themselves (there is no
mask interface to register with; Llama-style models then hand any name but "sdpa" a
materialized float mask, also where "sdpa" gets ``is_causal=True``).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from . import api

log = logging.getLogger("torch_sm90_sdpa")

DEFAULT_NAME = "sm90_sdpa"
MIN_TRANSFORMERS = "4.48"

_warned_output_attentions = False


def _grouped_heads(module) -> int:
    return int(getattr(module, "num_key_value_groups", 1) or 1)


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D], each key/value head repeated for the query
    heads of its group (what enable_gqa=True computes without the copy)."""
    b, h, s, d = t.shape
    return t.unsqueeze(2).expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _fold_single_query(t: Optional[torch.Tensor], groups: int) -> Optional[torch.Tensor]:
    """One query token (decoding): [B, Hq, 1, D] -> [B, Hkv, groups, D], the query heads of a
    group become query rows of their key/value head. A tensor with one head (a mask shared
    by every head) is left as it is."""
    if t is None or t.shape[1] == 1:
        return t
    b, h, _, d = t.shape
    return t.reshape(b, h // groups, groups, d)


def _stock_uses_gqa(attention_mask, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether transformers' "sdpa" forward passes enable_gqa=True rather than repeating the
    key/value heads: where stock SDPA has a fused kernel for it."""
    if os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1":
        return True
    device = key.device.type
    if device == "xpu":
        return True  # (torch >= 2.8, which we require anyway)
    if device == "mps":
        return tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)
    return attention_mask is None and key.shape[-1] == value.shape[-1] <= 256


def _bias_mask(position_bias: torch.Tensor, attention_mask, is_causal: bool,
               query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A float additive mask carrying a model's position bias (T5-style) on the visible
    positions and the lowest finite value of the dtype on the hidden ones."""
    lowest = max(torch.finfo(key.dtype).min, torch.finfo(position_bias.dtype).min)
    if attention_mask is None:
        if not is_causal:
            return position_bias.contiguous()
        sq, sk = query.shape[2], key.shape[2]
        rows = torch.arange(sq, device=key.device).view(sq, 1)
        cols = torch.arange(sk, device=key.device).view(1, sk)
        visible = (cols <= rows).view(1, 1, sq, sk)
        return torch.where(visible, position_bias, lowest).contiguous()
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, lowest).contiguous()
    return (attention_mask + position_bias).contiguous()


def sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, Hq, Sq, D], key / value
    [B, Hkv, Sk, D] (the module's ``num_key_value_groups`` = Hq / Hkv), the mask the model's
    mask function built (None, or boolean / additive, [B or 1, 1 or Hq, Sq, Sk]); returns
    (attention output [B, Sq, Hq, Dv] contiguous, None: no attention weights)."""
    global _warned_output_attentions
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "attn_implementation=\"sm90_sdpa\" does not support `softcap` (neither does "
            "\"sdpa\"): use \"eager\", \"flex_attention\" or a flash-attention kernel with it"
        )
    if kwargs.get("output_attentions", False) and not _warned_output_attentions:
        _warned_output_attentions = True
        log.warning("attn_implementation=\"sm90_sdpa\" returns no attention weights "
                    "(output_attentions=True); use \"eager\" to get them")

    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        # older transformers hand a mask sized for the whole (static) cache
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]

    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # The size test first: under torch.compile with dynamic shapes `q_len > 1` is a SymBool,
    # and leading with it keeps the result a plain bool.
    causal = q_len > 1 and attention_mask is None and causal
    if torch.jit.is_tracing() and isinstance(causal, torch.Tensor):
        causal = bool(causal.item())

    if causal and key.shape[2] > q_len:
        # prefill into an empty static cache: the keys past the queries are all hidden
        # (is_causal aligns to the upper left); dropping them keeps Sq == Sk
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if position_bias is not None:
        attention_mask = _bias_mask(position_bias, attention_mask, causal, query, key)
        causal = False

    groups = _grouped_heads(module)
    gqa = False
    folded = False
    served = False  # the drop-in's decision for the final arguments is made: ours
    if groups > 1:
        if api._unservable_reason(query, key, value, attention_mask, dropout, True, causal,
                                  scaling) is None:
            gqa = served = True  # our op takes grouped heads (with or without a mask) as they are
        elif _stock_uses_gqa(attention_mask, key, value):
            gqa = True
        elif q_len == 1 and not torch.compiler.is_compiling():
            query = _fold_single_query(query, groups)
            attention_mask = _fold_single_query(attention_mask, groups)
            folded = True
        else:
            key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)

    if served:  # (not decided a second time: the checks cost host time on every call)
        out = api._run_decided(None, query, key, value, attention_mask, dropout, causal, scaling,
                               gqa)
    else:
        out = api.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
            scale=scaling, enable_gqa=gqa,
        )
    if folded:  # back to [B, Hq, 1, Dv]
        out = out.reshape(out.shape[0], -1, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "torch_sm90_sdpa.transformers_attention.register() needs transformers "
            f">= {MIN_TRANSFORMERS} (its attention interface); it is not installed: "
            f"pip install 'transformers>={MIN_TRANSFORMERS}'"
        ) from e
    return getattr(transformers, "__version__", "?")


def _is_ours(fn) -> bool:
    # (by name, not identity: a reloaded module registers an equal function)
    return getattr(fn, "__module__", None) == __name__ and \
        getattr(fn, "__qualname__", None) == sdpa_attention_forward.__qualname__


def register(name: str = DEFAULT_NAME, *, replace: bool = False) -> str:
    """Register :func:`sdpa_attention_forward` with transformers as ``attn_implementation=name``
    (and the mask function of ``"sdpa"`` under the same name). Returns the name.

    Idempotent. A name transformers already maps to another function (``"sdpa"``, ...) is
    refused unless ``replace=True``, which makes every model asking for that name use ours.
    Raises ImportError, saying what to install, without transformers >= 4.48.
    """
    if not isinstance(name, str) or not name or name == "eager":
        raise ValueError(f"name: expected a non-empty string other than 'eager', got {name!r}")
    version = _transformers_version()
    table, add = _attention_table(version)
    current = table.get(name)
    if current is not None and not _is_ours(current) and not replace:
        raise ValueError(
            f"transformers already has an attention implementation named {name!r} "
            f"({getattr(current, '__qualname__', current)}); pick another name, or pass "
            "replace=True to make every model that asks for it use torch_sm90_sdpa"
        )
    masks = None
    try:  # transformers >= 4.53: masks are built by the function registered for the name
        from transformers.masking_utils import AttentionMaskInterface as masks
    except ImportError:
        pass  # older: each model builds its own mask, whatever the attention function
    if masks is not None and name != "sdpa":
        sdpa_mask = masks._global_mapping.get("sdpa")
        if sdpa_mask is None:
            raise ImportError(f"transformers {version}: its AttentionMaskInterface has no "
                              "'sdpa' mask function to reuse")
        masks.register(name, sdpa_mask)
    add(name, sdpa_attention_forward)
    return name


def _attention_table(version: str):
    """(transformers' global {name: attention function}, the function that adds to it)."""
    try:  # >= 4.51
        from transformers import AttentionInterface
    except ImportError:
        pass
    else:
        return AttentionInterface._global_mapping, AttentionInterface.register
    try:  # 4.48 - 4.50: a plain dict the models read
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as table
    except ImportError as e:
        raise ImportError(
            f"torch_sm90_sdpa.transformers_attention.register() needs transformers "
            f">= {MIN_TRANSFORMERS} (its attention interface); found transformers {version}: "
            f"pip install -U 'transformers>={MIN_TRANSFORMERS}'"
        ) from e
    return table, table.__setitem__
