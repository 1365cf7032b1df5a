"""What the upstream series changes in SGLang: exact-string edits and commit messages.

Used by ``tools/upstream_patch.py``; every anchor is text of the sglang 0.5.23 wheel
(``python/sglang/...``) or of an upstream docs page recorded in ``pages.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SGLANG_VERSION = "0.5.23"
SRT = "python/sglang/srt"
MEM_CACHE = f"{SRT}/mem_cache"
TEST_DIR = "test/registered/unit/mem_cache"
DOCS = "docs/docs/advanced_features"
SUITE = "base-a-test-cpu"  # upstream's CPU suite ("stage-a-test-cpu" is gone)


class ExportError(RuntimeError):
    """The series cannot be built or is not fit to send: names the file or patch."""


@dataclass(frozen=True)
class Edit:
    """Put ``text`` after, before or instead of ``anchor``, which must occur once."""

    path: str  # in the upstream tree, e.g. python/sglang/srt/mem_cache/utils.py
    anchor: str
    text: str
    where: str = "after"  # "after", "before" or "replace"

    def apply(self, source: str) -> str:
        count = source.count(self.anchor)
        if count != 1:
            raise ExportError(
                f"{self.path}: anchor found {count} times (expected once); this is "
                f"not the sglang {SGLANG_VERSION} tree the series is made for:\n"
                f"{self.anchor}"
            )
        new = {
            "after": self.anchor + self.text,
            "before": self.text + self.anchor,
            "replace": self.text,
        }[self.where]
        return source.replace(self.anchor, new)


def apply_edits(tree: Path, edits: Sequence[Edit]) -> list[str]:
    """Apply ``edits`` to the files under ``tree``; return the paths changed."""
    changed: dict[str, str] = {}
    for edit in edits:
        if edit.path not in changed:
            path = tree / edit.path
            if not path.is_file():
                raise ExportError(f"{edit.path}: not in the base tree")
            changed[edit.path] = path.read_text()
        changed[edit.path] = edit.apply(changed[edit.path])
    for rel, text in changed.items():
        (tree / rel).write_text(text)
    return list(changed)


# 0001: the extension point ------------------------------------------------------

ON_EVICT = '''
    def on_evict(self, node: TreeNode) -> None:
        """Called by the tree with each device victim, just before it is evicted.

        ``node`` is an evictable leaf still in the tree (key, parent and counters
        as they were scored); victims come one call each, in eviction order. A
        strategy that learns from what it evicts overrides this and must not
        change the tree. RadixCache and the Python TreeCore call it; the Rust
        TreeCore (built-in policies only) does not. The default does nothing.
        """
'''

EDITS_0001 = (
    Edit(
        f"{MEM_CACHE}/evict_policy.py",
        "    def get_priority(self, node: TreeNode) -> Union[float, Tuple]:\n"
        "        pass\n",
        ON_EVICT,
    ),
    Edit(
        f"{MEM_CACHE}/unified_cache/components/full.py",
        "            self._evict_device_last_node = x\n            return x.id\n",
        "            self._evict_device_last_node = x\n"
        "            self.tree_core.eviction_strategy.on_evict(x)\n"
        "            return x.id\n",
        where="replace",
    ),
    Edit(
        f"{MEM_CACHE}/radix_cache.py",
        "            _priority, x = heapq.heappop(eviction_heap)\n",
        "            self.eviction_strategy.on_evict(x)\n",
    ),
)

# 0002: the policy, its flag and its wiring ----------------------------------------

FLAG_HELP = (
    "Evict radix-cache prefixes by what they cost to recompute per byte held, "
    "weighted by reuse and idle time: the same as --radix-eviction-policy "
    "mla_aware. Aimed at MLA/DSA models (DeepSeek V2/V3/R1/V3.2, Kimi K2), whose "
    "latent KV is small next to the prefill it saves; any model works. Tune it "
    "with --radix-eviction-policy-config."
)


def _help_lines(text: str, indent: str, width: int = 88) -> str:
    """``text`` as implicitly joined string literals that fit ``width``."""
    room = width - len(indent) - 3  # quotes and a trailing space in the literal
    words, lines, line = text.split(" "), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > room:
            lines.append(line + " ")
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "".join(f'{indent}"{part}"\n' for part in lines)


MEMORY_FIELD = (
    "    mla_aware_eviction: A[\n"
    "        bool,\n" + _help_lines(FLAG_HELP, " " * 8)[:-1] + ",\n    ] = False\n"
)

RESOLUTION_STEP = '''\
def handle_mla_aware_eviction(server_args: Any) -> None:
    """``--mla-aware-eviction`` selects ``--radix-eviction-policy mla_aware``.

    Any other explicit policy conflicts with the flag (ValueError). With the policy
    selected either way, ``--radix-eviction-policy-config`` is checked here, before
    any weights load (PolicyConfigError, a ValueError, names the key).
    """
    cfg = resolving_view(server_args)
    policy = cfg.radix_eviction_policy
    if cfg.mla_aware_eviction and policy != "mla_aware":
        if cfg._radix_eviction_policy_explicitly_set or policy != "lru":
            raise ValueError(
                f"--mla-aware-eviction conflicts with --radix-eviction-policy "
                f"{policy}; drop one of them."
            )
        declare_resolution(
            server_args, "handle_mla_aware_eviction", radix_eviction_policy="mla_aware"
        )
        policy = "mla_aware"
    if policy == "mla_aware":
        PolicyConfig.parse(cfg.radix_eviction_policy_config)


'''

COST_MODEL_STEP = '''\
def add_mla_aware_cost_model(
    params: CacheInitParams,
    model_config: ModelConfig,
    *,
    kv_cache_dtype: str,
    tp_size: int,
) -> None:
    """Give the ``mla_aware`` policy the served model's cost model.

    It prices a prefix by the prefill time of its tokens per byte they hold on one
    rank, so it needs the model's shapes, the KV dtype (one it cannot price counts
    as the model's dtype), the TP and page sizes. Other policies, and a disabled
    cache, are left as they are.
    """
    if params.disable or params.eviction_policy.lower() != POLICY_NAME:
        return
    config = PolicyConfig.parse(params.eviction_policy_config)
    dtype = str(kv_cache_dtype).lower()
    cost_model = KVCostModel.from_config(
        model_config.hf_config.to_dict(),
        kv_cache_dtype=dtype if dtype in KV_DTYPE_BYTES else "auto",
        tp_size=tp_size,
        page_size=params.page_size,
        calibration=config.calibration and Calibration.load(config.calibration),
    )
    logger.info(
        "mla_aware eviction: %s attention, %d B/token per rank, Python TreeCore",
        cost_model.attention.value.upper(),
        cost_model.bytes_per_token,
    )
    params.eviction_policy_config = {
        **(params.eviction_policy_config or {}),
        "cost_model": cost_model,
        "key_unit_tokens": 1,
    }


'''

EDITS_0002 = (
    Edit(
        f"{MEM_CACHE}/utils.py",
        "    TLRUStrategy,\n)\n",
        "from sglang.srt.mem_cache.mla_aware_policy import create_mla_aware_strategy\n",
    ),
    Edit(
        f"{MEM_CACHE}/utils.py",
        '    "tlru": TLRUStrategy,\n',
        '    "mla_aware": create_mla_aware_strategy,\n',
    ),
    Edit(
        f"{SRT}/arg_groups/choices.py",
        '"priority", "tlru"]\n',
        '"priority", "tlru", "mla_aware"]\n',
        where="replace",
    ),
    Edit(
        f"{SRT}/arg_groups/fields/memory.py",
        "    disable_radix_cache: A[\n",
        MEMORY_FIELD,
        where="before",
    ),
    Edit(
        f"{SRT}/arg_groups/field_order.py",
        '    "return_aux_hidden_state_layer_ids",\n',
        '    "mla_aware_eviction",\n',
    ),
    Edit(
        f"{SRT}/arg_groups/kv_cache_hook.py",
        "from sglang.srt.environ import envs\n",
        "from sglang.srt.mem_cache.mla_aware_policy import PolicyConfig\n",
    ),
    Edit(
        f"{SRT}/arg_groups/kv_cache_hook.py",
        "def handle_cache_compatibility(server_args: Any) -> None:\n",
        RESOLUTION_STEP,
        where="before",
    ),
    Edit(
        f"{SRT}/arg_groups/pipeline.py",
        "    run_hook(validate_sampling_mask_max_tokens, server_args)\n",
        "    from sglang.srt.arg_groups.kv_cache_hook import handle_mla_aware_eviction\n\n"
        "    # Before the model resolves: a bad policy config fails before any load.\n"
        "    run_hook(handle_mla_aware_eviction, server_args)\n",
    ),
    Edit(
        f"{SRT}/arg_groups/resolution_hooks.py",
        '        "validate_sampling_mask_max_tokens",\n',
        '        "handle_mla_aware_eviction",\n',
    ),
    Edit(
        f"{MEM_CACHE}/unified_cache/tree_core_registry.py",
        '        return "session-aware caching requires the Python TreeCore"\n',
        '    if params.eviction_policy.lower() == "mla_aware":\n'
        '        return "the mla_aware eviction policy requires the Python TreeCore"\n',
    ),
    Edit(
        f"{MEM_CACHE}/kv_cache_builder.py",
        "from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, "
        "MHATokenToKVPool\n",
        "from sglang.srt.mem_cache.mla_aware_policy import POLICY_NAME, PolicyConfig\n"
        "from sglang.srt.mem_cache.mla_cost_model import KV_DTYPE_BYTES, Calibration, "
        "KVCostModel\n",
    ),
    Edit(f"{MEM_CACHE}/kv_cache_builder.py", "    get_memory,\n", "    get_model,\n"),
    Edit(
        f"{MEM_CACHE}/kv_cache_builder.py",
        "def build_kv_cache(\n",
        COST_MODEL_STEP,
        where="before",
    ),
    Edit(
        f"{MEM_CACHE}/kv_cache_builder.py",
        "    if params.swa_retain_window != sliding_window_size:\n",
        "    add_mla_aware_cost_model(\n"
        "        params,\n"
        "        model_config,\n"
        "        kv_cache_dtype=get_model().kv_cache_dtype,\n"
        "        tp_size=parallel.tp_size,\n"
        "    )\n",
        where="before",
    ),
)

_CELL = '      <td style={{padding: "9px 12px", %sbackgroundColor: "rgba(255,255,255,%s)"}}>'
FLAG_ROW = (
    "        <tr>\n"
    + (_CELL % ("fontWeight: 500, ", "0.02") + "`--mla-aware-eviction`</td>\n")
    + (_CELL % ("", "0.05") + FLAG_HELP + "</td>\n")
    + (_CELL % ("", "0.02") + "`False`</td>\n")
    + (_CELL % ("", "0.05") + "bool flag (set to enable)</td>\n")
    + "    </tr>\n"
)
_RADIX_OPTIONS = "<code>slru</code>, <code>priority</code></td>\n    </tr>\n"
DOCS_EDITS_0002 = (
    Edit(
        f"{DOCS}/server_arguments.mdx",
        _RADIX_OPTIONS,
        "<code>slru</code>, <code>priority</code>, <code>mla_aware</code></td>\n"
        "    </tr>\n" + FLAG_ROW,
        where="replace",
    ),
)

# 0004: the eviction-policy page ------------------------------------------------------


def docs_edits_0004(with_page: bool) -> tuple[Edit, ...]:
    """The ``mla_aware`` rows of ``radix_eviction_policy.mdx`` (a link to the new page
    only when the series adds it)."""
    page = (
        " See [MLA-aware eviction](/docs/advanced_features/mla_aware_eviction)."
        if with_page
        else ""
    )
    path = f"{DOCS}/radix_eviction_policy.mdx"
    return (
        Edit(
            path,
            "Requires the unified radix cache (the default tree). |\n",
            "| `mla_aware` | The prefix cheapest to lose: least prefill time saved per "
            "byte it holds, weighted by its hits and its idle time; prefixes several "
            "requests share are kept longer. | MLA/DSA models (DeepSeek V2/V3/R1/V3.2, "
            "Kimi K2) under cache pressure, where what a prefix costs to recompute "
            "varies more than its size. Same as `--mla-aware-eviction`. See "
            "[`mla_aware` parameters](#mla_aware-parameters)." + page + " Runs on the "
            "Python tree core. |\n",
        ),
        Edit(
            path,
            "`slru` and `tlru` take parameters.",
            "`slru`, `tlru` and `mla_aware` take parameters.",
            where="replace",
        ),
        Edit(path, "## Which policy to pick\n", MLA_AWARE_PARAMETERS, where="before"),
    )


MLA_AWARE_PARAMETERS = """\
#### `mla_aware` parameters

`mla_aware` evicts first the leaf with the least restore value: prefill time per byte
held (from the served model's config, built by the server), times one plus its hit
count, aged by its idle time. It learns from evicted prefixes that come back how much
longer to keep shared prefixes and how much weight the restore value gets; the keys
below tune that and the cost model.

| Key | Type | Default | Meaning |
|---|---|---|---|
| `calibration` | string | none | Path of a GPU calibration JSON, `{"gpu_name": ..., "fit": {"prefill_s_per_token": ..., "prefill_s_per_token_per_position": ..., "h2d_s_per_token_per_layer": ...}}` (seconds per layer), whose measured prefill constants replace the nominal FLOP model. |
| `learn_factor` | bool | `true` | Learn how much longer to keep proven prefixes (shared by several requests, or back after an eviction); `false` keeps the factor at 1. |
| `learn_weight` | bool | `true` | Learn the exponent on restore time per byte; `false` keeps it at 1. |

```bash Command
python3 -m sglang.launch_server \\
  --model-path deepseek-ai/DeepSeek-V3 \\
  --mla-aware-eviction \\
  --radix-eviction-policy-config '{"learn_weight": false}'
```

"""


MESSAGES = {
    1: (
        "mem_cache: tell the eviction strategy of each device victim "
        "(EvictionStrategy.on_evict)\n\n"
        "A strategy only scores nodes; it never learns which of them the tree\n"
        "evicted. Policies that learn from their victims (ghost lists as in ARC,\n"
        "GreedyDual's inflation, hit-density estimates) need that signal.\n\n"
        "EvictionStrategy.on_evict(node) is a no-op by default. FullComponent's\n"
        "device eviction walk calls it with the victim it returns, and the legacy\n"
        "RadixCache.evict with each leaf before deleting it. No behaviour changes\n"
        "for the built-in policies.\n"
    ),
    2: (
        "mem_cache: mla_aware, a cost-aware radix eviction policy "
        "(--mla-aware-eviction)\n\n"
        "- mla_cost_model.py: bytes per token on one rank and prefill work of a\n"
        "  token span, from the model config (MHA/GQA/MQA, MLA, DSA);\n"
        "- mla_aware_policy.py: evicts first the leaf with the least prefill time\n"
        "  per byte, times hits, aged by idle time; learns from returning victims\n"
        "  through on_evict;\n"
        "- registered as 'mla_aware' (policy registry and CLI choices);\n"
        "- --mla-aware-eviction selects it; handle_mla_aware_eviction resolves the\n"
        "  flag (an explicit different policy conflicts) and validates\n"
        "  --radix-eviction-policy-config before anything loads;\n"
        "- the Rust TreeCore falls back to Python for it;\n"
        "- kv_cache_builder gives the policy the served model's cost model;\n"
        "- the flag's row in server_arguments.mdx.\n"
    ),
    3: (
        "test: mla_aware cost model, policy and wiring\n\n"
        f"CPU-only unit tests, registered in {SUITE}.\n"
    ),
    4: (
        "docs: mla_aware eviction\n\n"
        "The mla_aware row and parameters of the radix eviction policy page, and the\n"
        "policy's own page.\n"
    ),
}
