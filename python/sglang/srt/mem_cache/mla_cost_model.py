"""What a cached token costs: bytes on a GPU rank, and the work to recompute it.

Computed once from a model config (a ``config.json``, a dict or a preset name) into
the frozen :class:`KVCostModel`; callers derive every figure from it.

Bytes per token and rank (``L`` layers, ``b`` bytes per KV element)::

    MHA / GQA / MQA  2 * ceil(kv_heads / tp) * head_dim * b * L
                     (K/V sharded by heads; a head is replicated when tp > kv_heads)
    MLA              (kv_lora_rank + qk_rope_head_dim) * b * L   (latent replicated)
    DSA (V3.2)       (latent + index_head_dim + 4 * index_head_dim // 128) * L, where
                     latent = (kv_lora_rank + qk_rope_head_dim) * b, or with an fp8
                     cache kv_lora_rank + 4 * kv_lora_rank // 128 + 2 * qk_rope_head_dim

Prefill FLOPs of the token at position ``p`` (0-based; only DSA has a ``window``,
``index_topk``, and an indexer, which scores every earlier token)::

    flops(p) = 2 * active_params + attention_flops_per_position * min(p + 1, window)
               + indexer_flops_per_position * (p + 1)

``active_params``: the weights one token passes through (MoE: shared plus top-k routed
experts; no embeddings or LM head); the attention term is the QK^T and AV work.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
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
    """An input that cannot be turned into a cost model; names the source and field."""


# Bytes of one KV element by --kv-cache-dtype spelling.
KV_DTYPE_BYTES = {
    **dict.fromkeys(("bf16", "bfloat16", "fp16", "float16", "half"), 2),
    **dict.fromkeys(("fp32", "float32"), 4),
    **dict.fromkeys(("fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2"), 1),
}

# DSA's fp8 latent and indexer key carry an fp32 scale per 128 values; rope stays bf16.
_DSA_QUANT_BLOCK = 128
_MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM")
_DSA_ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
_SETUP = "serving setup"


def _check_int(value: Any, field: str, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelConfigError(
            f"{where}: field {field!r} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _check_real(value: Any, field: str, where: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > 0 or (allow_zero and value == 0))
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ModelConfigError(
            f"{where}: field {field!r} must be a finite number {bound}, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class Calibration:
    """Measured per-layer constants of one GPU, written by gpu_validation.py.

    Prefill of ``[s, e)`` takes ``prefill_s_per_token * (e - s) +
    prefill_s_per_token_per_position * attended`` seconds per layer. No cost uses
    ``h2d_s_per_token_per_layer``. Values must be finite and > 0 (the per-position one
    >= 0), else :class:`ModelConfigError`.
    """

    gpu_name: str
    prefill_s_per_token: float
    prefill_s_per_token_per_position: float
    h2d_s_per_token_per_layer: float

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self)[1:]:
            zero_ok = field.name == "prefill_s_per_token_per_position"
            _check_real(getattr(self, field.name), field.name, "calibration", zero_ok)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Calibration":
        """Read the JSON gpu_validation.py writes (``gpu_name``, ``fit`` object)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            values = [data["fit"][field.name] for field in dataclasses.fields(cls)[1:]]
            return cls(str(data["gpu_name"]), *values)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from None
        except KeyError as e:
            raise ModelConfigError(f"{path}: missing calibration field {e}") from None
        except (OSError, ValueError, TypeError) as e:
            raise ModelConfigError(f"{path}: bad calibration JSON: {e}") from None


@dataclass(frozen=True)
class KVCostModel:
    """Per-token sizes and prefill costs of one model on one serving setup.

    Built by :meth:`from_config` or :meth:`from_preset`, which raise
    :class:`ModelConfigError` naming the source and field of a bad input. Times in
    seconds, sizes in bytes (per TP rank; all layers unless per layer), work in FLOPs.
    """

    name: str
    attention: AttentionKind
    num_layers: int
    bytes_per_token_per_layer: int  # on one rank, before page rounding
    active_params: int
    attention_flops_per_position: int  # all layers, per attended token
    attention_window: Optional[int] = None  # DSA: at most this many tokens attended
    indexer_flops_per_position: int = 0  # DSA lightning indexer, all layers
    mha_equivalent_bytes_per_token: int = 0  # un-absorbed K/V, all layers, one rank
    tp_size: int = 1
    page_size: int = 1
    gpu_flops_per_s: float = 400e12  # sustained prefill throughput of one rank
    calibration: Optional[Calibration] = None

    def __post_init__(self) -> None:
        _check_int(self.tp_size, "tp_size", _SETUP)
        _check_int(self.page_size, "page_size", _SETUP)
        _check_real(self.gpu_flops_per_s, "gpu_flops_per_s", _SETUP)

    @classmethod
    def from_preset(cls, name: str, **setup: Any) -> "KVCostModel":
        """Cost model of a preset in ``PRESETS``; ``setup`` as in from_config."""
        key = str(name).lower()
        if key not in PRESETS:
            known = ", ".join(sorted(PRESETS))
            raise ModelConfigError(f"unknown model preset {name!r}; known: {known}")
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
        calibration: Optional[Calibration] = None,
    ) -> "KVCostModel":
        """From a config.json (or its directory), a dict or a preset name.

        ``kv_cache_dtype`` "auto" takes the model's ``torch_dtype``.
        """
        _check_int(tp_size, "tp_size", _SETUP)  # needed before __post_init__ runs
        if isinstance(config, (str, Path)) and str(config).lower() in PRESETS:
            name = name or str(config).lower()
            config = PRESETS[str(config).lower()]
        f = _Fields(*_load_config(config))
        kind = _latent_kind(f)
        b = _kv_dtype_bytes(kv_cache_dtype, f)
        layers, hidden = f.size("num_hidden_layers"), f.size("hidden_size")
        heads = f.size("num_attention_heads")
        window, indexer_flops = None, 0
        if kind is None:
            kv_heads = f.size("num_key_value_heads", default=heads)
            head_dim = f.size("head_dim", default=hidden // heads)
            kind = AttentionKind.MQA if kv_heads == 1 else AttentionKind.GQA
            kind = AttentionKind.MHA if kv_heads == heads else kind
            per_layer = 2 * math.ceil(kv_heads / tp_size) * head_dim * b
            attn_flops = 2 * heads * 2 * head_dim * layers
            mha_equiv = per_layer * layers
            attn_params = 2 * hidden * (heads + kv_heads) * head_dim
        else:
            latent, rope = f.size("kv_lora_rank"), f.size("qk_rope_head_dim")
            nope, v_dim = f.size("qk_nope_head_dim"), f.size("v_head_dim")
            q_lora = f.size("q_lora_rank", default=0, minimum=0)  # 0: no low-rank query
            per_layer = (latent + rope) * b
            attn_flops = 2 * heads * (nope + rope + v_dim) * layers
            # Un-absorbed K/V in the same dtype, sharded by heads as in the GQA branch.
            mha_equiv = math.ceil(heads / tp_size) * (nope + rope + v_dim) * b * layers
            q_in = q_lora or hidden  # what the query (and the indexer) projects from
            attn_params = hidden * q_lora + q_in * heads * (nope + rope)
            attn_params += hidden * (latent + rope) + latent * heads * (nope + v_dim)
            attn_params += heads * v_dim * hidden
            if kind is AttentionKind.DSA:
                idx_dim, idx_heads = f.size("index_head_dim"), f.size("index_n_heads")
                window = f.size("index_topk")
                if b == 1:
                    per_layer = latent + latent // _DSA_QUANT_BLOCK * 4 + rope * 2
                per_layer += idx_dim + idx_dim // _DSA_QUANT_BLOCK * 4
                # Sparse attention runs in the absorbed (MQA) form over the latent.
                attn_flops = 2 * heads * (2 * latent + rope) * layers
                indexer_flops = 2 * idx_heads * idx_dim * layers
                # indexer: queries from q_in; a key and per-head weights from hidden
                attn_params += q_in * idx_heads * idx_dim + hidden * idx_dim
                attn_params += hidden * idx_heads
        name = name or f.cfg.get("_name_or_path") or f.cfg.get("model_type")
        return cls(
            name=str(name or "model"),
            attention=kind,
            num_layers=layers,
            bytes_per_token_per_layer=per_layer,
            active_params=layers * attn_params + _mlp_params(f, hidden, layers),
            attention_flops_per_position=attn_flops,
            attention_window=window,
            indexer_flops_per_position=indexer_flops,
            mha_equivalent_bytes_per_token=mha_equiv,
            tp_size=tp_size,
            page_size=page_size,
            gpu_flops_per_s=gpu_flops_per_s,
            calibration=calibration,
        )

    def with_setup(self, **changes: Any) -> "KVCostModel":
        """A copy with another ``page_size``, ``gpu_flops_per_s`` or ``calibration``.

        The other fields follow from the model config (rebuild with from_config).
        """
        fixed = sorted(set(changes) - {"page_size", "gpu_flops_per_s", "calibration"})
        if fixed:
            raise ModelConfigError(f"{_SETUP}: with_setup cannot change {fixed}")
        return dataclasses.replace(self, **changes)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes on one GPU rank, all layers."""
        return self.bytes_per_token_per_layer * self.num_layers

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes for ``num_tokens`` tokens rounded up to whole pages; 0 when <= 0."""
        pages = max(0, -(-num_tokens // self.page_size))
        return pages * self.page_size * self.bytes_per_token

    def tokens_for_bytes(self, num_bytes: float) -> int:
        """Tokens in the whole pages that ``num_bytes`` holds; 0 when not positive."""
        if not num_bytes > 0:
            return 0
        page = self.page_size
        return int(num_bytes // (self.bytes_per_token * page)) * page

    @property
    def compression_vs_mha(self) -> float:
        """MHA-equivalent K/V bytes over cached bytes per rank (1.0 unless latent)."""
        return self.mha_equivalent_bytes_per_token / self.bytes_per_token

    def prefill_flops(self, start: int, end: int) -> float:
        """Prefill FLOPs of positions ``[start, end)``; 0 if end <= start."""
        if end <= start:
            return 0.0
        attended = _attended_sum(start, end, self.attention_window)
        flops = 2 * self.active_params * (end - start)
        flops += self.attention_flops_per_position * attended
        flops += self.indexer_flops_per_position * _attended_sum(start, end, None)
        return float(flops)

    def prefill_seconds(self, start: int, end: int) -> float:
        """Seconds to recompute ``[start, end)``: calibrated, else FLOPs / FLOP/s."""
        if end <= start:
            return 0.0
        cal = self.calibration
        if cal is None:
            return self.prefill_flops(start, end) / self.gpu_flops_per_s
        attended = _attended_sum(start, end, self.attention_window)
        seconds = cal.prefill_s_per_token * (end - start)
        seconds += cal.prefill_s_per_token_per_position * attended
        return self.num_layers * seconds

    def seconds_per_byte(self, num_tokens: int) -> float:
        """Prefill seconds per cached byte of a span of ``num_tokens`` tokens that
        begins a prompt (its restore cost over its size); 0 when not positive."""
        if num_tokens <= 0:
            return 0.0
        return self.prefill_seconds(0, num_tokens) / self.bytes_for_tokens(num_tokens)


def _attended_sum(start: int, end: int, window: Optional[int]) -> int:
    """Sum over positions p in [start, end) of min(p + 1, window); needs end > start."""
    if start < 0:
        raise ValueError(f"positions must be >= 0, got [{start}, {end})")

    def upto(n: int) -> int:  # sum_{p=0}^{n-1} min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return upto(end) - upto(start)


class _Fields:
    """Integer fields of a model config, checked once, naming source and field."""

    def __init__(self, cfg: Mapping[str, Any], where: str):
        self.cfg, self.where = cfg, where

    def size(self, key: str, default: Optional[int] = None, minimum: int = 1) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(f"{self.where}: missing field {key!r}")
            value = default
        return _check_int(value, key, self.where, minimum)


def _load_config(config: Any) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, "model config"
    if not isinstance(config, (str, Path)):
        raise ModelConfigError(f"model config must be a path or a dict, got {config!r}")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        msg = f"{path}: no such config.json, and {str(config)!r} is not a preset"
        raise ModelConfigError(f"{msg} ({', '.join(sorted(PRESETS))})") from None
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path}: not a readable JSON config: {e}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: top level must be a JSON object")
    return data, str(path)


def _latent_kind(f: _Fields) -> Optional[AttentionKind]:
    """DSA or MLA for a latent-cache model, None for one with K/V heads."""
    archs = f.cfg.get("architectures")
    if archs is None:
        raise ModelConfigError(f"{f.where}: missing field 'architectures'")
    strings = isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    if not (strings and archs):
        raise ModelConfigError(
            f"{f.where}: field 'architectures' must be a non-empty list of strings, "
            f"got {archs!r}"
        )
    if any(a in _DSA_ARCHS for a in archs) or f.cfg.get("index_topk"):
        return AttentionKind.DSA
    if any(a in _MLA_ARCHS for a in archs) or f.cfg.get("kv_lora_rank"):
        return AttentionKind.MLA
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelConfigError(
            f"{f.where}: field 'architectures' = {archs!r} names no causal LM"
        )
    return None


def _mlp_params(f: _Fields, hidden: int, layers: int) -> int:
    """MLP weights one token passes through, all layers (MoE: shared plus top-k)."""
    dense_mlp = 3 * hidden * f.size("intermediate_size")
    key = "n_routed_experts" if "n_routed_experts" in f.cfg else "num_local_experts"
    routed = f.size(key, default=0, minimum=0)
    if not routed:
        return layers * dense_mlp
    moe_inter, top_k = f.size("moe_intermediate_size"), f.size("num_experts_per_tok")
    shared = f.size("n_shared_experts", default=0, minimum=0)
    first_dense = f.size("first_k_dense_replace", default=0, minimum=0)
    if first_dense > layers:
        raise ModelConfigError(
            f"{f.where}: field 'first_k_dense_replace' must be <= "
            f"num_hidden_layers ({layers}), got {first_dense}"
        )
    moe_mlp = (shared + top_k) * 3 * hidden * moe_inter + hidden * routed
    return first_dense * dense_mlp + (layers - first_dense) * moe_mlp


def _kv_dtype_bytes(kv_cache_dtype: Any, f: _Fields) -> int:
    where, field, dtype = _SETUP, "kv_cache_dtype", kv_cache_dtype
    if isinstance(dtype, str) and dtype.lower() == "auto":
        field = "torch_dtype" if f.cfg.get("torch_dtype") else "dtype"
        where, dtype = f.where, f.cfg.get(field) or "bfloat16"
    if not isinstance(dtype, str) or dtype.lower() not in KV_DTYPE_BYTES:
        raise ModelConfigError(
            f"{where}: field {field!r} = {dtype!r} is no KV cache dtype; "
            f"use one of {', '.join(sorted(KV_DTYPE_BYTES))}"
        )
    return KV_DTYPE_BYTES[dtype.lower()]


def _dense(arch: str, hidden: int, layers: int, heads: int, kv: int, mlp: int) -> dict:
    """A Llama-style config with 128-wide heads."""
    sizes = dict(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers)
    attn = dict(num_attention_heads=heads, num_key_value_heads=kv, head_dim=128)
    return dict(sizes, **attn, architectures=[arch], torch_dtype="bfloat16")


# The fields of each model's published config.json that the cost model reads.
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "torch_dtype": "bfloat16",
    **dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128),
    **dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64),
    **dict(qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432),
    **dict(moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1),
    **dict(num_experts_per_tok=8, first_k_dense_replace=3),
}
_V32_INDEXER = dict(index_head_dim=128, index_n_heads=64, index_topk=2048)
PRESETS: dict[str, dict] = {
    "deepseek-v3": dict(_DEEPSEEK_V3),
    "deepseek-r1": dict(_DEEPSEEK_V3),
    "deepseek-v3.2": dict(_DEEPSEEK_V3, **_V32_INDEXER, architectures=[_DSA_ARCHS[0]]),
    "llama-3-8b": _dense("LlamaForCausalLM", 4096, 32, 32, 8, 14336),
    "llama-3-70b": _dense("LlamaForCausalLM", 8192, 80, 64, 8, 28672),
    "qwen2.5-7b": _dense("Qwen2ForCausalLM", 3584, 28, 28, 4, 18944),
    "mistral-7b": _dense("MistralForCausalLM", 4096, 32, 32, 8, 14336),
}
