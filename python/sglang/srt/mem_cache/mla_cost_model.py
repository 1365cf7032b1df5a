"""What a cached token costs: bytes on a GPU rank, and the work to restore it.

Everything here is computed once from a model config (a Hugging Face
``config.json``, a dict, or a named preset) into the frozen :class:`KVCostModel`;
eviction policies, the budget and the benchmarks derive every figure from it and
never rescale token counts afterwards.

Bytes per token and rank (``L`` layers, ``b`` bytes per KV element)::

    MHA / GQA / MQA   2 * ceil(kv_heads / tp) * head_dim * b * L   (K/V sharded by heads;
                      a KV head is replicated when there are fewer heads than ranks)
    MLA               (kv_lora_rank + qk_rope_head_dim) * b * L      (latent replicated)
    DSA (V3.2)        MLA latent (fp8: 512 + 4 scales * 4 B + 64 rope * 2 B = 656 B)
                      + indexer key (index_head_dim fp8 + 4 B scale per 128) per layer

Prefill cost of the token at position ``p`` (0-based)::

    flops(p) = 2 * active_params + attention_flops_per_position * (p + 1)

where ``active_params`` counts the weights one token passes through (MoE-aware:
shared plus top-k routed experts; embeddings and the LM head excluded) and the
attention term is the QK^T and AV work of that architecture (DSA attends to at most
``index_topk`` tokens, plus its indexer over all of them).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

ConfigSource = Union[str, Path, Mapping[str, Any]]


class AttentionKind(str, enum.Enum):
    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"
    DSA = "dsa"


# Attention kinds that cache one latent vector per token, replicated on every TP rank.
LATENT_KINDS = frozenset({AttentionKind.MLA, AttentionKind.DSA})


class ModelConfigError(ValueError):
    """A model config that cannot be turned into a cost model; names the field."""


# Bytes of one KV element by --kv-cache-dtype spelling.
KV_DTYPE_BYTES = {
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp32": 4,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# DeepSeek V3.2 stores the latent as fp8 with one fp32 scale per 128 values and the
# rope part in bf16 (FlashMLA sparse layout), and an fp8 indexer key with an fp32
# scale per 128 values.
_DSA_QUANT_BLOCK = 128

_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM")
_DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


@dataclass(frozen=True)
class Calibration:
    """Measured per-layer prefill constants and host reload time (see gpu_validation.py).

    ``prefill_s_per_token`` and ``prefill_s_per_token_per_position`` are for one layer;
    ``h2d_s_per_token_per_layer`` is the pinned host-to-device copy time of one token's
    cache row in one layer.
    """

    gpu_name: str
    prefill_s_per_token: float
    prefill_s_per_token_per_position: float
    h2d_s_per_token_per_layer: float

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Calibration":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{path}: cannot read calibration JSON: {e}") from None
        try:
            fit = data["fit"]
            return cls(
                gpu_name=str(data["gpu_name"]),
                prefill_s_per_token=float(fit["prefill_s_per_token"]),
                prefill_s_per_token_per_position=float(
                    fit["prefill_s_per_token_per_position"]
                ),
                h2d_s_per_token_per_layer=float(fit["h2d_s_per_token_per_layer"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelConfigError(
                f"{path}: calibration field missing or not a number: {e}"
            ) from None


@dataclass(frozen=True)
class KVCostModel:
    """Per-token sizes and restore costs of one model on one serving setup.

    Build it with :meth:`from_config` or :meth:`from_preset`; all derived figures are
    properties of these fields. Times are in seconds, sizes in bytes, work in FLOPs.
    """

    name: str
    attention: AttentionKind
    num_layers: int
    bytes_per_token_per_layer: float  # on one rank, before page rounding
    active_params: int
    attention_flops_per_position: float  # all layers, per attended token
    attention_window: Optional[int] = None  # DSA: at most this many tokens attended
    indexer_flops_per_position: float = 0.0  # DSA lightning indexer, all layers
    mha_equivalent_bytes_per_token: float = 0.0  # un-absorbed K/V, all layers, one rank
    tp_size: int = 1
    page_size: int = 1
    gpu_flops_per_s: float = 400e12  # sustained prefill throughput of one rank's share
    host_to_device_bytes_per_s: float = 25e9
    calibration: Optional[Calibration] = None

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, **setup: Any) -> "KVCostModel":
        """Cost model of a named preset (see ``PRESETS``); ``setup`` as in from_config."""
        key = name.lower()
        if key not in PRESETS:
            raise ModelConfigError(
                f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        return cls.from_config(PRESETS[key], name=key, **setup)

    @classmethod
    def from_config(
        cls,
        config: ConfigSource,
        *,
        name: Optional[str] = None,
        kv_cache_dtype: str = "auto",
        tp_size: int = 1,
        page_size: int = 1,
        gpu_flops_per_s: float = 400e12,
        host_to_device_bytes_per_s: float = 25e9,
        calibration: Optional[Calibration] = None,
    ) -> "KVCostModel":
        """Build from a ``config.json`` path, a directory holding one, a dict, or a preset name.

        ``kv_cache_dtype`` "auto" takes the model's ``torch_dtype``. Raises
        :class:`ModelConfigError` naming the missing or bad field.
        """
        if isinstance(config, (str, Path)) and str(config).lower() in PRESETS:
            name = str(config).lower()
            config = PRESETS[name]
        cfg, where = _load_config(config)
        _require_positive(tp_size, "tp_size", "the serving setup")
        _require_positive(page_size, "page_size", "the serving setup")
        fields = _ConfigReader(cfg, where)
        kind = _attention_kind(fields)
        layers = fields.int("num_hidden_layers")
        hidden = fields.int("hidden_size")
        heads = fields.int("num_attention_heads")
        dtype_bytes = _kv_dtype_bytes(kv_cache_dtype, cfg, where)

        if kind in LATENT_KINDS:
            latent = fields.int("kv_lora_rank")
            rope = fields.int("qk_rope_head_dim")
            nope = fields.int("qk_nope_head_dim")
            v_dim = fields.int("v_head_dim")
            qk_dim = nope + rope
            per_layer = (latent + rope) * dtype_bytes
            attn_flops = 2 * heads * (qk_dim + v_dim) * layers
            # Un-absorbed K/V in the same dtype, sharded by heads (replicated when
            # there are fewer heads than ranks), as the GQA branch below.
            mha_equiv = math.ceil(heads / tp_size) * (qk_dim + v_dim) * dtype_bytes * layers
            window = indexer_flops = None
            if kind is AttentionKind.DSA:
                index_dim = fields.int("index_head_dim")
                index_heads = fields.int("index_n_heads")
                window = fields.int("index_topk")
                if dtype_bytes == 1:
                    per_layer = latent + latent // _DSA_QUANT_BLOCK * 4 + rope * 2
                per_layer += index_dim + index_dim // _DSA_QUANT_BLOCK * 4
                # Sparse attention runs in the absorbed (MQA) form over the latent.
                attn_flops = 2 * heads * ((latent + rope) + latent) * layers
                indexer_flops = 2 * index_heads * index_dim * layers
        else:
            kv_heads = fields.int("num_key_value_heads", default=heads)
            head_dim = fields.int("head_dim", default=hidden // heads)
            kv_heads_per_rank = math.ceil(kv_heads / tp_size)
            per_layer = 2 * kv_heads_per_rank * head_dim * dtype_bytes
            attn_flops = 2 * heads * 2 * head_dim * layers
            mha_equiv = per_layer * layers
            window = indexer_flops = None

        return cls(
            name=name or cfg.get("_name_or_path") or cfg.get("model_type", "model"),
            attention=kind,
            num_layers=layers,
            bytes_per_token_per_layer=per_layer,
            active_params=_active_params(fields, kind),
            attention_flops_per_position=attn_flops,
            attention_window=window,
            indexer_flops_per_position=indexer_flops or 0.0,
            mha_equivalent_bytes_per_token=mha_equiv,
            tp_size=tp_size,
            page_size=page_size,
            gpu_flops_per_s=gpu_flops_per_s,
            host_to_device_bytes_per_s=host_to_device_bytes_per_s,
            calibration=calibration,
        )

    def with_setup(self, **changes: Any) -> "KVCostModel":
        """A copy with other serving knobs (page_size, bandwidths, calibration)."""
        return dataclasses.replace(self, **changes)

    # ---- bytes --------------------------------------------------------------

    @property
    def bytes_per_token(self) -> float:
        """Bytes one cached token takes on one GPU rank, all layers."""
        return self.bytes_per_token_per_layer * self.num_layers

    def bytes_for_tokens(self, num_tokens: int) -> float:
        """Bytes for ``num_tokens`` tokens, rounded up to whole pages."""
        pages = -(-num_tokens // self.page_size)
        return pages * self.page_size * self.bytes_per_token

    def tokens_for_bytes(self, num_bytes: float) -> int:
        """Whole pages' worth of tokens that fit in ``num_bytes`` (0 if negative)."""
        if num_bytes <= 0:
            return 0
        return whole_page_tokens(num_bytes, self.bytes_per_token, self.page_size)

    @property
    def compression_vs_mha(self) -> float:
        """Un-absorbed MHA-equivalent K/V bytes over cached bytes, per rank (1.0 for MHA)."""
        return self.mha_equivalent_bytes_per_token / self.bytes_per_token

    # ---- work and time ------------------------------------------------------

    def prefill_flops(self, start: int, end: int) -> float:
        """Prefill FLOPs of the tokens at positions ``[start, end)``; 0 when end <= start."""
        n = end - start
        if n <= 0:
            return 0.0
        flops = 2.0 * self.active_params * n
        flops += self.attention_flops_per_position * _attended_sum(
            start, end, self.attention_window
        )
        flops += self.indexer_flops_per_position * _attended_sum(start, end, None)
        return flops

    def prefill_seconds(self, start: int, end: int) -> float:
        """Time to recompute positions ``[start, end)`` (calibrated when available)."""
        if end <= start:
            return 0.0
        cal = self.calibration
        if cal is None:
            return self.prefill_flops(start, end) / self.gpu_flops_per_s
        attended = _attended_sum(start, end, self.attention_window)
        return self.num_layers * (
            cal.prefill_s_per_token * (end - start)
            + cal.prefill_s_per_token_per_position * attended
        )

    @property
    def reload_seconds_per_token(self) -> float:
        """Time to copy one token's cache row back from pinned host memory."""
        if self.calibration is not None:
            return self.calibration.h2d_s_per_token_per_layer * self.num_layers
        return self.bytes_per_token / self.host_to_device_bytes_per_s

    def restore_seconds(self, start: int, end: int, backed_up: bool = False) -> float:
        """Cheapest way back for positions ``[start, end)``: recompute, or reload if on host."""
        recompute = self.prefill_seconds(start, end)
        if not backed_up:
            return recompute
        return min(recompute, self.reload_seconds_per_token * (end - start))


def _attended_sum(start: int, end: int, window: Optional[int]) -> int:
    """Sum over positions p in [start, end) of tokens attended, min(p + 1, window)."""
    if end <= start:
        return 0

    def upto(n: int) -> int:  # sum_{p=0}^{n-1} min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return upto(end) - upto(start)


class _ConfigReader:
    """Typed field access that names the file and field on error."""

    def __init__(self, cfg: Mapping[str, Any], where: str):
        self.cfg = cfg
        self.where = where

    def int(self, key: str, default: Optional[int] = None) -> int:
        value = self.cfg.get(key, default)
        if value is None:
            if default is not None:
                return default
            raise ModelConfigError(f"{self.where}: missing field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelConfigError(
                f"{self.where}: field {key!r} must be a non-negative integer, got {value!r}"
            )
        return value

    def optional_int(self, key: str) -> Optional[int]:
        return None if self.cfg.get(key) is None else self.int(key)


def _load_config(config: ConfigSource) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, "model config"
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(
            f"{path}: no such config.json, and {str(config)!r} is not a preset "
            f"({', '.join(sorted(PRESETS))})"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: not a readable JSON config: {e}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: top level must be a JSON object")
    return data, str(path)


def _attention_kind(fields: _ConfigReader) -> AttentionKind:
    cfg = fields.cfg
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ModelConfigError(f"{fields.where}: missing field 'architectures'")
    if any(a in _DSA_ARCHITECTURES for a in archs) or cfg.get("index_topk"):
        return AttentionKind.DSA
    if any(a in _MLA_ARCHITECTURES for a in archs) or cfg.get("kv_lora_rank"):
        return AttentionKind.MLA
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelConfigError(
            f"{fields.where}: field 'architectures' = {archs!r} names no causal LM "
            "this cost model knows"
        )
    heads = fields.int("num_attention_heads")
    kv_heads = fields.int("num_key_value_heads", default=heads)
    if kv_heads == heads:
        return AttentionKind.MHA
    return AttentionKind.MQA if kv_heads == 1 else AttentionKind.GQA


def whole_page_tokens(num_bytes: float, bytes_per_token: float, page_size: int) -> int:
    """Tokens in the whole pages that ``num_bytes`` holds at ``bytes_per_token`` each."""
    return int(num_bytes // (bytes_per_token * page_size)) * page_size


def _active_params(fields: _ConfigReader, kind: AttentionKind) -> int:
    """Weights one prompt token multiplies through (no embeddings, no LM head)."""
    cfg = fields.cfg
    hidden = fields.int("hidden_size")
    layers = fields.int("num_hidden_layers")
    heads = fields.int("num_attention_heads")
    if kind in LATENT_KINDS:
        nope, rope = fields.int("qk_nope_head_dim"), fields.int("qk_rope_head_dim")
        v_dim, latent = fields.int("v_head_dim"), fields.int("kv_lora_rank")
        q_lora = fields.optional_int("q_lora_rank")
        qk = nope + rope
        q = hidden * heads * qk if not q_lora else hidden * q_lora + q_lora * heads * qk
        attn = q + hidden * (latent + rope) + latent * heads * (nope + v_dim)
        attn += heads * v_dim * hidden
        if kind is AttentionKind.DSA:
            idx_dim, idx_heads = fields.int("index_head_dim"), fields.int("index_n_heads")
            attn += (q_lora or hidden) * idx_heads * idx_dim + hidden * (idx_dim + idx_heads)
    else:
        kv_heads = fields.int("num_key_value_heads", default=heads)
        head_dim = fields.int("head_dim", default=hidden // heads)
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim

    dense_mlp = 3 * hidden * fields.int("intermediate_size")
    routed = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if not routed:
        return layers * (attn + dense_mlp)
    moe_inter = fields.int("moe_intermediate_size")
    top_k = fields.int("num_experts_per_tok")
    shared = fields.int("n_shared_experts", default=0)
    first_dense = fields.int("first_k_dense_replace", default=0)
    moe_mlp = (shared + top_k) * 3 * hidden * moe_inter + hidden * routed
    return layers * attn + first_dense * dense_mlp + (layers - first_dense) * moe_mlp


def _kv_dtype_bytes(kv_cache_dtype: str, cfg: Mapping[str, Any], where: str) -> int:
    dtype = kv_cache_dtype.lower()
    if dtype == "auto":
        field = "torch_dtype" if cfg.get("torch_dtype") else "dtype"
        dtype = str(cfg.get(field) or "bfloat16").lower()
        if dtype not in KV_DTYPE_BYTES:
            raise ModelConfigError(
                f"{where}: field {field!r} = {dtype!r} is no KV cache dtype; pass "
                f"kv_cache_dtype, one of {', '.join(sorted(KV_DTYPE_BYTES))}"
            )
    if dtype not in KV_DTYPE_BYTES:
        raise ModelConfigError(
            f"{where}: kv cache dtype {kv_cache_dtype!r} unknown; "
            f"use one of {', '.join(sorted(KV_DTYPE_BYTES))}"
        )
    return KV_DTYPE_BYTES[dtype]


def _require_positive(value: int, field: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{where}: {field} must be a positive integer, got {value!r}")


def _deepseek(**overrides: Any) -> dict:
    base = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        vocab_size=129280,
        torch_dtype="bfloat16",
    )
    base.update(overrides)
    return base


def _llama(**overrides: Any) -> dict:
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=128,
        torch_dtype="bfloat16",
    )
    base.update(overrides)
    return base


# The fields of each model's published config.json that the cost model reads.
PRESETS: dict[str, dict] = {
    "deepseek-v3": _deepseek(),
    "deepseek-r1": _deepseek(),
    "deepseek-v3.2": _deepseek(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        index_head_dim=128,
        index_n_heads=64,
        index_topk=2048,
    ),
    "deepseek-v2": _deepseek(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        hidden_size=5120,
        num_hidden_layers=60,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        n_routed_experts=160,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        vocab_size=102400,
    ),
    "deepseek-v2-lite": _deepseek(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        vocab_size=102400,
    ),
    "llama-3-8b": _llama(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "llama-3-70b": _llama(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    "qwen2.5-7b": _llama(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
    ),
    "mistral-7b": _llama(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32768,
    ),
}
