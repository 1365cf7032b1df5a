"""Replays a trace through SGLang's real prefix cache and allocator on CPU.

The tree (``UnifiedRadixCache`` on SGLang's Rust or Python tree core), the eviction
strategies and the token allocator are SGLang's own classes; this module plays the
scheduler's part around them, one request at a time, as ``managers/scheduler.py`` does:

    admit:  match_prefix -> lock(last node) -> alloc(new pages) -> on shortfall
            evict(shortfall) and retry -> still short: wait in a first-come queue
    finish: insert(prompt + output, page-aligned) -> free the partial page -> unlock

Keys are paged: one key element stands for one page of ``page_size`` tokens, the tree
runs with ``page_size=1`` and the allocator counts pages (SGLang's paged tree stores,
matches and evicts only whole pages, so the tree behaves the same with 1/page of the
index work). Element ids come from the trace's block ids: page ``j`` of block ``h`` is
``h * pages_per_block + j + 1``, for every page that the block's tokens fill; the
partial last page of a prompt and every page of output get ids no other request has
(``OUTPUT_ID_BASE`` and up, from a counter: the trace does not say what the output
was), unless ``sequence_hash_ids`` says a later prompt holds that content. As SGLang's
scheduler does (``max_prefix_len = input_len - 1``), a request matches at most
``(input_length - 1) // page_size`` pages: the last prompt token is always computed.

Strategies that learn from ``on_evict`` (``mla_aware`` and the peers) run on the Python
tree core with the plugin's eviction callback, as in a server; built-ins run on the tree
core asked for, unless SGLang falls back to the Python one (the row's ``tree_core`` says
which ran). ``optimal`` is Belady's offline bound.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from peers import PEERS
from traces import ID_LIMIT, Request, Trace

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.mla_aware_policy import POLICY_NAME, MLAAwareStrategy
from sglang.srt.mem_cache.mla_cost_model import Calibration, KVCostModel
from sglang.srt.mem_cache.mla_eviction_plugin import prepare_params, register
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES

OPTIMAL = "optimal"
# Element ids from here on: pages no later prompt holds. Content ids stay below it:
# ID_LIMIT * pages_per_block < 2**62 for any block of up to 2**22 pages.
OUTPUT_ID_BASE = 1 << 62
TREE_CORES = ("rust", "python")


@dataclass(frozen=True)
class ReplayConfig:
    policy: str
    capacity_tokens: int
    page_size: int = 64
    tree_core: str = "python"  # asked for; strategies with on_evict need "python"
    # user keys for mla_aware (PolicyConfig); a "calibration" file is loaded into the
    # policy's cost model (the accounting keeps the replay's)
    policy_config: Optional[dict] = None
    decode_s_per_token: float = 0.02
    capacity_fraction: Optional[float] = None
    capacity_label: str = ""


@dataclass
class ReplayResult:
    config: ReplayConfig
    tree_core: str = ""
    requests: int = 0
    rejected: int = 0  # larger than the whole pool: never admitted
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prompt_flops: float = 0.0
    saved_flops: float = 0.0
    evicted_tokens: int = 0
    evictions: int = 0
    cache_cpu_s: float = 0.0
    ttfts: list = field(default_factory=list, repr=False)  # (wait, prefill) seconds
    learnt: Optional[dict] = None

    def summary(self) -> dict:
        """One row of the replay's JSON."""
        cfg, served = self.config, max(self.requests - self.rejected, 1)
        ttft = np.asarray(self.ttfts).reshape(-1, 2).sum(axis=1)
        return {
            "policy": cfg.policy,
            "is_bound": cfg.policy == OPTIMAL,
            "is_peer": cfg.policy in PEERS,
            "tree_core": self.tree_core,
            "capacity": cfg.capacity_label,
            "capacity_fraction": cfg.capacity_fraction,
            "capacity_tokens": cfg.capacity_tokens,
            "page_size": cfg.page_size,
            "requests": self.requests,
            "rejected": self.rejected,
            "token_hit_rate": self.hit_tokens / max(self.prompt_tokens, 1),
            "flop_hit_rate": self.saved_flops / max(self.prompt_flops, 1.0),
            "ttft_p50_s": float(np.median(ttft)) if len(ttft) else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "cpu_us_per_request": 1e6 * self.cache_cpu_s / served,
            "learnt": self.learnt,
        }


class FutureIndex:
    """When each block is next requested: the oracle behind the ``optimal`` bound."""

    def __init__(self, trace: Trace):
        self.index(trace)

    def index(self, trace: Trace) -> None:
        """Index ``trace``'s block uses (forgetting any earlier trace's)."""
        self.trace = trace
        self.uses: dict[int, list[int]] = {}
        for i, req in enumerate(trace.requests):
            for block in req.hash_ids:
                self.uses.setdefault(block, []).append(i)
        self.now = 0  # index of the request being served

    def next_use(self, block: int) -> float:
        seq = self.uses.get(block)
        if seq is None:
            return float("inf")
        j = bisect.bisect_right(seq, self.now)
        return seq[j] if j < len(seq) else float("inf")


class BeladyStrategy(EvictionStrategy):
    """Offline bound: evict the leaf whose first block is requested furthest ahead.

    Every request that reuses part of a node passes through its first block, so that
    block's next use is the node's. It reads the future: a bound, never a policy.
    """

    def __init__(self, future: FutureIndex, pages_per_block: int):
        self.future, self.pages_per_block = future, pages_per_block

    def get_priority(self, node: Any) -> float:
        first = node.key.token_ids[0]
        if first >= OUTPUT_ID_BASE:
            return float("-inf")
        return -self.future.next_use((first - 1) // self.pages_per_block)


def needs_python_core(policy: str) -> bool:
    """Whether ``policy`` runs only on the Python tree core (it learns from
    ``on_evict``, or it is the bound)."""
    return policy in (POLICY_NAME, OPTIMAL) or policy in PEERS


def known_policies() -> list[str]:
    """SGLang's registry (with ``mla_aware``), the peers and the bound."""
    register()  # idempotent: mla_aware joins SGLang's registry
    return [*_EVICTION_POLICY_FACTORIES, *PEERS, OPTIMAL]


class Replayer:
    """One (trace, policy, capacity) replay; :meth:`run` returns a ReplayResult.

    Raises ValueError for an unknown policy or tree core, a page size below 1 or not
    dividing the trace's block size, or a capacity below one page.
    """

    def __init__(self, trace: Trace, cost_model: KVCostModel, config: ReplayConfig):
        page = config.page_size
        if type(page) is not int or page < 1 or trace.block_size % page:
            raise ValueError(
                f"page size {page!r} must be an integer >= 1 dividing block size "
                f"{trace.block_size}"
            )
        if ID_LIMIT * (trace.block_size // page) >= OUTPUT_ID_BASE:
            raise ValueError(f"block size {trace.block_size}: too many pages per block")
        if config.policy not in known_policies():
            raise ValueError(f"unknown policy {config.policy!r}")
        if config.tree_core not in TREE_CORES:
            raise ValueError(f"tree core must be one of {TREE_CORES}")
        self.trace, self.cfg, self.cost = trace, config, cost_model
        self.unit = page
        self.pages_per_block = trace.block_size // page
        self.future = FutureIndex(trace) if config.policy == OPTIMAL else None
        self._next_own_id = OUTPUT_ID_BASE
        self.cache, self.allocator, core = self._build_cache()
        self.result = ReplayResult(config, tree_core=core)

    def _build_cache(self) -> tuple[Any, Any, str]:
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
            select_tree_core_backend,
        )
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        pages = self.cfg.capacity_tokens // self.unit
        if pages < 1:
            raise ValueError(
                f"capacity of {self.cfg.capacity_tokens} tokens is below one page"
            )
        allocator = TokenToKVPoolAllocator(
            size=pages,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
        policy = self.cfg.policy
        python = needs_python_core(policy)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
            eviction_policy=policy if policy in _EVICTION_POLICY_FACTORIES else "lru",
            eviction_policy_config=self.cfg.policy_config,
            tree_components=(ComponentType.FULL,),
            tree_core_backend="python" if python else self.cfg.tree_core,
        )
        if python:
            prepare_params(params, self._policy_cost(), key_unit_tokens=self.unit)
        if policy != POLICY_NAME:
            params.eviction_policy_config = None
        # What SGLang will run (it may fall back to Python), reported per row.
        params.tree_core_backend = select_tree_core_backend(params)
        cache = UnifiedRadixCache(params)
        if policy in PEERS:
            cache.tree_core.eviction_strategy = PEERS[policy](self.cost, self.unit)
        elif policy == OPTIMAL:
            strategy = BeladyStrategy(self.future, self.pages_per_block)
            cache.tree_core.eviction_strategy = strategy
        return cache, allocator, params.tree_core_backend

    def _policy_cost(self) -> KVCostModel:
        """The cost model the policy prices with: the replay's, calibrated as the
        policy config says (as the plugin builds it for a server)."""
        path = (self.cfg.policy_config or {}).get("calibration")
        if self.cfg.policy != POLICY_NAME or path is None:
            return self.cost
        return self.cost.with_setup(calibration=Calibration.load(path))

    def _pages(self, req: Request, num_tokens: int) -> np.ndarray:
        """Element ids of the first ``ceil(num_tokens / unit)`` pages of the sequence."""
        n_pages = -(-num_tokens // self.unit)
        if req.sequence_hash_ids:  # a later prompt holds this output: known content
            blocks = req.sequence_hash_ids
            content = (req.input_length + req.output_length) // self.unit
        else:
            blocks, content = req.hash_ids, req.input_length // self.unit
        ppb = self.pages_per_block
        p = np.arange(min(n_pages, content), dtype=np.int64)
        ids = np.asarray(blocks, dtype=np.int64)[p // ppb] * ppb + p % ppb + 1
        if n_pages > len(p):
            start = self._next_own_id
            self._next_own_id += n_pages - len(p)
            own = np.arange(start, self._next_own_id, dtype=np.int64)
            ids = np.concatenate([ids, own])
        return ids

    def run(self, progress=None) -> ReplayResult:
        """Replay ``self.trace`` at its arrival times until every request finished;
        ``progress()`` is called once per finished or rejected request.

        A later call replays whatever ``trace`` is then, on the same cache, and adds
        to the same result (a soak sets one chunk after another)."""
        gc.collect()  # an earlier replay's garbage is not this one's cache CPU
        if self.future is not None and self.future.trace is not self.trace:
            self.future.index(self.trace)
        queue: deque = deque()
        events: list = []  # heap of (time, seq, step, state); step 0: prefill done
        arrivals = iter(enumerate(self.trace.requests))
        arrival = next(arrivals, None)
        seq = 0
        while arrival is not None or queue or events:
            t_arrive = arrival[1].timestamp_s if arrival else float("inf")
            if events and events[0][0] < t_arrive:
                now, _, step, state = heapq.heappop(events)
                if step == 0:
                    self._checkpoint(state, state["req"].input_length)
                    continue
                self._finish(state)
                if progress:
                    progress()
            else:
                now = t_arrive
                queue.append(arrival)
                arrival = next(arrivals, None)
            while queue:
                idx, req = queue[0]
                state = self._admit(idx, req, now)
                if state is None:
                    if not events and arrival is None:  # nothing will free memory
                        raise RuntimeError(f"request {idx} can never be admitted")
                    break
                queue.popleft()
                if state is _REJECTED:
                    if progress:
                        progress()
                    continue
                seq += 1
                heapq.heappush(events, (state["prefilled"], seq, 0, state))
                heapq.heappush(events, (state["finish"], seq, 1, state))
        strategy = getattr(self.cache.tree_core, "eviction_strategy", None)
        if isinstance(strategy, MLAAwareStrategy):
            self.result.learnt = {
                "log_factor": round(strategy.log_factor, 4),
                "weight": round(strategy.weight, 4),
            }
        return self.result

    def _timed(self, fn, *args):
        """One cache operation, its CPU time counted."""
        t0 = time.perf_counter()
        out = fn(*args)
        self.result.cache_cpu_s += time.perf_counter() - t0
        return out

    def _alloc(self, need: int):
        """Allocate ``need`` pages, evicting the shortfall first as SGLang does."""
        if need == 0:
            return torch.empty((0,), dtype=torch.int64)
        out = self.allocator.alloc(need)
        if out is None:
            shortfall = need - self.allocator.available_size()
            evicted = self._timed(self.cache.evict, EvictParams(num_tokens=shortfall))
            if evicted.num_tokens_evicted:
                self.result.evictions += 1
                self.result.evicted_tokens += evicted.num_tokens_evicted * self.unit
            out = self.allocator.alloc(need)
        return out

    def _admit(self, idx: int, req: Request, now: float):
        """Admit ``req`` at ``now``: its running state, _REJECTED, or None to wait."""
        r = self.result
        if self.future is not None:
            self.future.now = idx
        pages = self._pages(req, req.input_length + req.output_length)
        if len(pages) > self.allocator.size:
            r.requests += 1
            r.rejected += 1
            return _REJECTED
        # SGLang matches at most input_len - 1 tokens (the last one is computed).
        matchable = max(req.input_length - 1, 0) // self.unit
        key = RadixKey(array("q", pages[:matchable].tobytes()))
        match = self._timed(self.cache.match_prefix, MatchPrefixParams(key=key))
        prefix = match.device_prefix_len
        lock = self._timed(self.cache.lock, match.last_device_node)
        # As PrefillAdder: admit only what free plus evictable memory holds.
        need = len(pages) - prefix
        fits = need <= self.allocator.available_size() + self.cache.evictable_size()
        new = self._alloc(need) if fits else None
        if new is None:
            self._timed(self.cache.unlock, lock)
            return None
        hit = min(prefix * self.unit, req.input_length)
        r.requests += 1
        r.prompt_tokens += req.input_length
        r.hit_tokens += hit
        r.prompt_flops += self.cost.prefill_flops(0, req.input_length)
        r.saved_flops += self.cost.prefill_flops(0, hit)
        prefill_s = self.cost.prefill_seconds(hit, req.input_length)
        r.ttfts.append((now - req.timestamp_s, prefill_s))
        indices = self.cache.path_device_indices(match.last_device_node)[:prefix]
        return {
            "prefilled": now + prefill_s,
            "finish": now + prefill_s + req.output_length * self.cfg.decode_s_per_token,
            "req": req,
            "pages": pages,
            "protected": prefix,  # tree-owned head of the request's row, in pages
            "inserted": 0,
            "lock": lock,
            "values": torch.cat([indices, new]),
        }

    def _checkpoint(self, s: dict, up_to_tokens: int, finished: bool = False) -> None:
        """Publish the sequence's full pages up to a token count, as SGLang's
        ``checkpoint`` does (the lock moves to the new last node)."""
        aligned, protected = up_to_tokens // self.unit, s["protected"]
        if aligned <= protected:
            return
        key = RadixKey(array("q", s["pages"][:aligned].tobytes()))
        values = s["values"][:aligned].clone()
        res = self._timed(
            self.cache.insert,
            InsertParams(
                key=key,
                value=values,
                prev_prefix_len=protected,
                inserted_len=s["inserted"],
            ),
        )
        prompt = s["req"].input_length // self.unit
        if finished and 0 < prompt < aligned:
            # SGLang splits the leaf at the prompt boundary (prompt one priority up).
            self._timed(
                self.cache.insert,
                InsertParams(
                    key=key[:prompt],
                    value=values[:prompt],
                    prev_prefix_len=prompt,
                    inserted_len=prompt,
                    priority=1,
                ),
            )
        s["inserted"] = max(s["inserted"], aligned)
        tree_values = self.cache.path_device_indices(res.last_device_node)
        s["values"][protected : len(tree_values)] = tree_values[protected:]
        s["protected"] = len(tree_values)
        self._timed(self.cache.unlock, s["lock"])
        s["lock"] = self._timed(self.cache.lock, res.last_device_node)

    def _finish(self, s: dict) -> None:
        """Publish the whole sequence, free the partial last page, drop the lock."""
        req = s["req"]
        self._checkpoint(s, req.input_length + req.output_length, finished=True)
        self.allocator.free(s["values"][s["protected"] :])
        self._timed(self.cache.unlock, s["lock"])


_REJECTED = object()
