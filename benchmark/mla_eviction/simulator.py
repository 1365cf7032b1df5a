"""Replays a trace through SGLang's real prefix cache and allocator on CPU.

The tree (``UnifiedRadixCache`` with the Python tree core, or the legacy
``RadixCache``), the eviction strategies and the token allocator are SGLang's own
classes; this module only plays the scheduler's part around them, the way
``managers/scheduler.py`` does for one request at a time:

    admit:  match_prefix -> lock(last node) -> alloc(new tokens) -> on shortfall
            evict(shortfall) and retry -> still short: wait in a first-come queue
    finish: insert(prompt + output, page-aligned) -> free duplicates and the
            unaligned tail -> unlock

Keys are paged: one key element stands for one page of ``unit`` tokens, the tree runs
with ``page_size=1`` and the allocator counts pages. SGLang's paged tree stores, matches
and evicts only whole pages and allocates page-aligned, so this is the same tree
behaviour with 1/unit of the index-tensor work. Element ids come from the trace's
block ids, so equal ids mean equal content: page ``j`` of block ``h`` is
``h * pages_per_block + j + 1``. Output pages carry content ids too where the trace
knows the output (``Request.sequence_hash_ids``: a generated conversation's next turn
includes it, as real chat does); a page holding unknown output or a partial block gets
an id no other request can have. ``timed`` mode uses the serving page size as the unit,
``sequential`` mode one element per block (the block hit rate of the trace README).

The optional host tier is modelled here (SGLang's HiCache controller needs CUDA
streams): an LRU of pages keyed by content, written through at every insert (the
prompt's at the prefill checkpoint, the output's at the finish), as HiCache's default
``write_through`` policy backs up each node an insert adds. A node whose pages were
written through is marked ``backuped`` (legacy ``RadixCache`` only, where that
attribute is free), and pages found there after the device prefix are reloaded at the
cost model's reload time instead of recomputed.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import heapq
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.mem_cache import mla_victim_trim
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.srt.mem_cache.mla_eviction_plugin import register_tree_hooks
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES

from traces import Request, Trace

OPTIMAL = "optimal"
OUTPUT_TOKEN_BASE = 1 << 48  # element ids from here on: output pages no later prompt holds


@dataclass(frozen=True)
class ReplayConfig:
    policy: str
    capacity_tokens: int
    mode: str = "timed"  # "timed" or "sequential"
    cache: str = "unified"  # "unified" or "radix"
    page_size: int = 64
    host_tier_tokens: int = 0
    clock: str = "tick"  # legacy tree's clock: "tick", or "per-read" (moves at every read)
    policy_config: Optional[dict] = None
    # Trim the last victim of an eviction to the shortfall (mla_victim_trim): "policy" where
    # the strategy asks for it (as the server does; mla_aware and the bound), "all" for
    # every policy, "none".
    trim: str = "policy"
    decode_s_per_token: float = 0.03
    # When a client ends a session (requests with a session_id): "last-turn", when its
    # last request in the trace finishes (as /close_session does), or "never".
    session_close: str = "last-turn"
    # SGLang's --enable-session-radix-cache (unified tree): each finished request's KV is
    # referenced by its session until the session closes, and referenced leaves go last.
    session_radix: bool = False
    capacity_fraction: Optional[float] = None
    capacity_label: str = ""


@dataclass
class ReplayResult:
    config: ReplayConfig
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    prompt_flops: float = 0.0
    saved_flops: float = 0.0
    evicted_tokens: int = 0
    shortfall_tokens: int = 0  # what the evictions were asked for; evicted_tokens may be more
    evictions: int = 0
    cache_cpu_s: float = 0.0
    prefill_s: float = 0.0  # modelled prefill (recompute + reload) of admitted requests
    # Per admitted request (timed mode): its TTFT's (wait, recompute, reload) seconds.
    ttfts: list = dataclasses.field(default_factory=list, repr=False)
    learnt: Optional[dict] = None  # mla_aware: what its GhostLearning ended with
    trimmed: bool = False  # the tree trimmed victims to the shortfall

    def summary(self) -> dict:
        parts = np.asarray(self.ttfts).reshape(-1, 3)
        ttft = ttft_seconds(parts) if len(parts) else None
        served = max(self.requests - self.rejected, 1)
        cfg = self.config
        return {
            "policy": cfg.policy,
            "is_bound": cfg.policy == OPTIMAL,
            "capacity": cfg.capacity_label,
            "capacity_fraction": cfg.capacity_fraction,
            "capacity_tokens": cfg.capacity_tokens,
            "mode": cfg.mode,
            "cache": cfg.cache,
            "host_tier_tokens": cfg.host_tier_tokens,
            "requests": self.requests,
            "rejected": self.rejected,
            "token_hit_rate": self.hit_tokens / max(self.prompt_tokens, 1),
            "block_hit_rate": self.hit_blocks / max(self.prompt_blocks, 1),
            "host_hit_rate": self.host_hit_tokens / max(self.prompt_tokens, 1),
            "flop_hit_rate": self.saved_flops / max(self.prompt_flops, 1.0),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft is not None else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft is not None else None,
            "ttft_mean_s": float(ttft.mean()) if ttft is not None else None,
            "ttft_p50_parts_s": median_make_up(parts),
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "shortfall_tokens": self.shortfall_tokens,
            "trimmed": self.trimmed,
            "cpu_us_per_request": 1e6 * self.cache_cpu_s / served,
            "prefill_ms_per_request": 1e3 * self.prefill_s / served,
            "learnt": self.learnt,
        }


def ttft_seconds(parts: np.ndarray) -> np.ndarray:
    """TTFTs from rows of ``(wait, recompute, reload)`` seconds: wait plus prefill."""
    return parts[:, 0] + (parts[:, 1] + parts[:, 2])


def median_make_up(parts: np.ndarray) -> Optional[dict]:
    """What the median TTFT is made of: the mean wait, recompute and reload seconds, from
    rows of ``(wait, recompute, reload)``, of the ``n`` requests' ranks ``n // 2 - n // 200``
    to ``n // 2 + n // 200`` by TTFT (the middle 1 %, at least one request); None without
    rows. The three sum to that band's mean TTFT."""
    if not len(parts):
        return None
    order = np.argsort(ttft_seconds(parts), kind="stable")
    half = len(order) // 200
    mid = len(order) // 2
    band = parts[order[max(mid - half, 0): mid + half + 1]].mean(axis=0)
    return dict(zip(("wait", "recompute", "reload"), map(float, band)))


class FutureIndex:
    """When each block is next requested: the oracle behind the ``optimal`` bound."""

    def __init__(self, trace: Trace):
        uses: dict[int, list[int]] = {}
        for i, req in enumerate(trace.requests):
            for h in req.hash_ids:
                uses.setdefault(h, []).append(i)
        self.uses = uses
        self.now = 0  # index of the request being served

    def reused_prefix(self, hash_ids) -> int:
        """Leading blocks of a request that some later request uses again."""
        for i, block in enumerate(hash_ids):
            if self.next_use(block) == float("inf"):
                return i
        return len(hash_ids)

    def next_use(self, block: int) -> float:
        seq = self.uses.get(block)
        if seq is None:
            return float("inf")
        j = bisect.bisect_right(seq, self.now)
        return seq[j] if j < len(seq) else float("inf")


class BeladyStrategy(EvictionStrategy):
    """Offline bound: evict the leaf whose first block is requested furthest ahead.

    Any request that reuses part of a node passes through the node's first block, so
    that block's next use is the node's. Needs the whole trace up front; a bound for
    comparison, never a deployable policy. It asks for trimmed victims, as ``mla_aware``
    does: a bound that freed whole nodes would fall below a policy that frees only the
    shortfall.
    """

    trim_victims = True

    def __init__(self, future: FutureIndex, pages_per_block: int):
        self.future = future
        self.pages_per_block = pages_per_block

    def get_priority(self, node: Any) -> tuple[float, float]:
        first = node.key.token_ids[0]
        if first >= OUTPUT_TOKEN_BASE:
            return (float("-inf"), node.last_access_time)
        block = (first - 1) // self.pages_per_block
        return (-self.future.next_use(block), node.last_access_time)


class HostTier:
    """Write-through host copies of pages (by content id), least recently used dropped first."""

    def __init__(self, capacity_pages: int):
        self.capacity = capacity_pages
        self.pages: OrderedDict[Any, None] = OrderedDict()

    def write(self, page_keys: list) -> None:
        for key in page_keys:
            self.pages[key] = None
            self.pages.move_to_end(key)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)

    def hit_pages(self, page_keys: list, start: int) -> int:
        """Consecutive pages from ``start`` held on host (refreshed on hit)."""
        n = 0
        for key in page_keys[start:]:
            if key not in self.pages:
                break
            self.pages.move_to_end(key)
            n += 1
        return n


class TickClock:
    """Stands in for the ``time`` module of ``radix_cache`` during a replay.

    ``RadixCache`` stamps ``last_access_time`` with wall-clock ``time.monotonic()``, which
    would make a replay's eviction order (and every age-based score) depend on how fast
    the machine runs it. Here ``monotonic()`` reads a counter that the replay advances once
    per cache operation, as the unified tree's access counter does; everything else is
    the real ``time`` module.

    With ``per_read``, every read returns a later time than the one before (by 1e-7 of a
    tick), as wall time does in a server, where no two scores of one heap build see the
    same clock; the order of operations is the same.
    """

    def __init__(self, per_read: bool = False):
        self.ticks = 0.0
        self.per_read = per_read
        self._reads = 0

    def advance(self) -> None:
        self.ticks += 1.0
        self._reads = 0

    def monotonic(self) -> float:
        if not self.per_read:
            return self.ticks
        self._reads += 1
        return self.ticks + self._reads * 1e-7

    def __getattr__(self, name):
        return getattr(time, name)


@contextlib.contextmanager
def radix_clock(clock: TickClock):
    """``radix_cache`` reads ``clock`` instead of wall time inside the block."""
    from sglang.srt.mem_cache import radix_cache

    saved, radix_cache.time = radix_cache.time, clock
    try:
        yield
    finally:
        radix_cache.time = saved


class Replayer:
    """One (trace, policy, capacity) replay; :meth:`run` returns a ReplayResult."""

    def __init__(self, trace: Trace, cost_model: KVCostModel, config: ReplayConfig):
        self.trace = trace
        self.cfg = config
        self.sequential = config.mode == "sequential"
        self.unit = trace.block_size if self.sequential else config.page_size
        if trace.block_size % self.unit:
            raise ValueError(f"page size {self.unit} must divide block size {trace.block_size}")
        self.pages_per_block = trace.block_size // self.unit
        self.cost = cost_model
        self.future = FutureIndex(trace) if config.policy == OPTIMAL else None
        self.clock = TickClock(per_read=config.clock == "per-read")
        with radix_clock(self.clock):
            self.cache, self.allocator = self._build_cache()
        self.host = HostTier(config.host_tier_tokens // self.unit) if config.host_tier_tokens else None
        self.result = ReplayResult(config)
        self.result.trimmed = self._trim_victims()
        self._session_ends: tuple = (None, {})  # (trace, session -> its last request)

    # ---- cache construction -------------------------------------------------

    def _build_cache(self):
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

        pages = self.cfg.capacity_tokens // self.unit
        if pages < 1:
            raise ValueError(f"capacity of {self.cfg.capacity_tokens} tokens is below one page")
        allocator = TokenToKVPoolAllocator(
            size=pages, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
        )
        policy, policy_config = self.cfg.policy, self.cfg.policy_config
        if policy == OPTIMAL:
            policy, policy_config = "lru", None
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
            eviction_policy=policy,
            eviction_policy_config=policy_config,
            tree_core_backend="python",
            enable_session_radix_cache=self.cfg.session_radix,
        )
        if self.cfg.cache == "radix":
            cache = RadixCache(params)
        else:
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            params.tree_components = (ComponentType.FULL,)
            cache = UnifiedRadixCache(params)
        if self.cfg.policy == OPTIMAL:
            _strategy_owner(cache).eviction_strategy = BeladyStrategy(
                self.future, self.pages_per_block
            )
        return cache, allocator

    def _trim_victims(self) -> bool:
        """Set victim trimming as ``cfg.trim`` says; whether the tree trims."""
        from sglang.srt.plugins.hook_registry import HookRegistry

        if self.cfg.trim != "policy":
            self.strategy.trim_victims = self.cfg.trim == "all"
        register_tree_hooks()
        HookRegistry.apply_hooks()
        return mla_victim_trim.trims(self.cache)

    @property
    def strategy(self):
        """The eviction strategy the cache scores leaves with."""
        return _strategy_owner(self.cache).eviction_strategy

    def watch_victims(self, note) -> None:
        """Call ``note(node)`` with each device leaf this replay's tree evicts, before it
        goes: wraps the unified core's ``_delete_unbacked_device_leaf`` (how a device leaf
        leaves the tree without a host tier) on this replay's core only."""
        core = _strategy_owner(self.cache)
        delete = core._delete_unbacked_device_leaf

        def noting(node, *args, **kwargs):
            note(node)
            return delete(node, *args, **kwargs)

        core._delete_unbacked_device_leaf = noting  # looked up on the core at each call

    # ---- keys ---------------------------------------------------------------

    def _pages(self, idx: int, req: Request, num_tokens: int) -> np.ndarray:
        """Element ids of the first ``ceil(num_tokens / unit)`` pages of the sequence."""
        n_pages = -(-num_tokens // self.unit)
        # Pages wholly inside known content (the prompt; prompt + output where a later
        # prompt holds the output) carry content ids; in the block model (sequential)
        # so does the partial last block: an id is its content.
        if self.sequential:
            blocks, content_pages = req.hash_ids, len(req.hash_ids)
        elif req.sequence_hash_ids:
            blocks = req.sequence_hash_ids
            content_pages = (req.input_length + req.output_length) // self.unit
        else:
            blocks, content_pages = req.hash_ids, req.input_length // self.unit
        ppb = self.pages_per_block
        p = np.arange(min(n_pages, content_pages), dtype=np.int64)
        ids = np.asarray(blocks, dtype=np.int64)[p // ppb] * ppb + p % ppb + 1
        if n_pages > len(p):
            own = OUTPUT_TOKEN_BASE + (idx << 24) + np.arange(len(p), n_pages, dtype=np.int64)
            ids = np.concatenate([ids, own])
        return ids

    def run(self, progress=None, first_index: int = 0) -> ReplayResult:
        """Replay ``self.trace``; ``first_index`` numbers its first request (output ids
        are per index, so a caller replaying chunk after chunk on one cache keeps them
        unique; the ``optimal`` bound needs 0)."""
        gc.collect()  # an earlier replay's garbage is not this one's cache CPU
        with radix_clock(self.clock):
            result = self._run(progress, first_index)
        learning = getattr(self.strategy, "learning", None)
        if learning is not None:
            result.learnt = {
                "weight": round(learning.weight, 4),
                "log_factor": round(learning.log_factor, 4),
                "log_superseded": round(learning.log_superseded, 4),
                "returned_proven_probationary": list(learning.returns),
                "returned_young_old": list(learning.returns_by_age),
            }
        return result

    def _run(self, progress, first_index: int) -> ReplayResult:
        reqs = self.trace.requests
        if self.sequential:
            for i, req in enumerate(reqs, first_index):
                self._sequential_step(i, req)
                if progress:
                    progress()
            return self.result
        queue: deque = deque()
        events: list = []  # heap of (time, seq, step, state); step 0 prefill done, 1 finish
        arrivals = iter(enumerate(reqs, first_index))
        next_arrival = next(arrivals, None)
        seq = 0
        while next_arrival is not None or queue or events:
            t_arrive = next_arrival[1].timestamp_s if next_arrival else float("inf")
            if events and events[0][0] < t_arrive:
                now, _, step, state = heapq.heappop(events)
                if step == 0:
                    self._checkpoint(state, state["req"].input_length, finished=False)
                    continue
                self._finish(state)
                if progress:
                    progress()
            else:
                now = t_arrive
                queue.append(next_arrival)
                next_arrival = next(arrivals, None)
            while queue:
                idx, req = queue[0]
                state = self._admit(idx, req, now)
                if state is None:
                    break
                queue.popleft()
                if state is _REJECTED:
                    if progress:
                        progress()
                    continue
                seq += 1
                heapq.heappush(events, (state["prefilled"], seq, 0, state))
                heapq.heappush(events, (state["finish"], seq, 1, state))
        return self.result

    def _timed(self, fn, *args):
        """One cache operation: a new tick of the tree's clock, CPU time counted."""
        self.clock.advance()
        t0 = time.perf_counter()
        out = fn(*args)
        self._spent(fn, time.perf_counter() - t0)
        return out

    def _spent(self, fn, seconds: float) -> None:
        """The cache operation ``fn`` took ``seconds``: counted as cache CPU (a subclass may
        break it down by operation, as cpu_breakdown.py does)."""
        self.result.cache_cpu_s += seconds

    def _alloc(self, need: int):
        """Allocate ``need`` slots, evicting the shortfall first as SGLang does."""
        if need == 0:
            return torch.empty((0,), dtype=torch.int64)
        out = self.allocator.alloc(need)
        if out is None:
            shortfall = need - self.allocator.available_size()
            evicted = self._timed(
                self.cache.evict, EvictParams(num_tokens=shortfall)
            ).num_tokens_evicted
            if evicted:
                self.result.evictions += 1
                # The tree counts key elements: one per page (per block in sequential mode).
                self.result.evicted_tokens += evicted * self.unit
                self.result.shortfall_tokens += shortfall * self.unit
            out = self.allocator.alloc(need)
        return out

    def _account_hit(self, req: Request, device_pages: int, host_pages: int) -> tuple[int, int]:
        """Count a served request; return its (hit, host-reloaded) prompt tokens."""
        r = self.result
        r.requests += 1
        hit = min((device_pages + host_pages) * self.unit, req.input_length)
        host = min(host_pages * self.unit, hit)
        r.prompt_blocks += len(req.hash_ids)
        r.hit_blocks += -(-hit // self.trace.block_size) if self.sequential else hit // self.trace.block_size
        r.prompt_tokens += req.input_length
        r.hit_tokens += hit
        r.host_hit_tokens += host
        r.prompt_flops += self.cost.prefill_flops(0, req.input_length)
        r.saved_flops += self.cost.prefill_flops(0, hit)
        return hit, host

    def _reject(self):
        self.result.requests += 1
        self.result.rejected += 1
        return _REJECTED

    def _sequential_step(self, idx: int, req: Request) -> None:
        state = self._admit(idx, req, req.timestamp_s)
        if state is None:  # cannot fit even with everything evicted
            self._reject()
        if state is None or state is _REJECTED:
            return
        # One node per block, so eviction is block-granular like the trace's figures:
        # the tree splits nodes but never merges them, so block-by-block inserts stick.
        # Nothing is evicted between these inserts, so the prefix needs no lock.
        self._timed(self.cache.unlock, state["lock"])
        key = RadixKey(array("q", state["pages"].tobytes()))
        values, prefix = state["values"], state["protected"]
        for end in range(min(prefix + 1, len(key)), len(key) + 1):
            # The first insert counts a hit on every node of the path, as SGLang's does.
            inserted = 0 if end <= prefix + 1 else end - 1
            self._timed(self.cache.insert, InsertParams(
                key=key[:end], value=values[:end], prev_prefix_len=max(prefix, end - 1),
                inserted_len=inserted, session_id=req.session_id,
            ))
        self._close_if_last(req)

    def _admit(self, idx: int, req: Request, now: float):
        """Admit ``req`` at ``now``: a running state, _REJECTED, or None to keep waiting."""
        if self.future is not None:
            self.future.now = idx
        total = req.input_length if self.sequential else req.input_length + req.output_length
        pages = self._pages(idx, req, total)
        if len(pages) > self.allocator.size:
            return self._reject()
        prompt_pages = req.input_length // self.unit
        key = RadixKey(array("q", pages[: -(-req.input_length // self.unit)].tobytes()))
        match = self._timed(self.cache.match_prefix, MatchPrefixParams(key=key))
        prefix = match.device_prefix_len
        if self.sequential and self.future is not None:
            # The bound may bypass: blocks no later request uses are never cached (a
            # block's successors are then unused too), as block-level Belady does.
            pages = pages[: max(prefix, self.future.reused_prefix(req.hash_ids))]
        need = len(pages) - prefix
        lock = self._timed(self.cache.lock, match.last_device_node)
        # As PrefillAdder: admit only what available + evictable memory can hold,
        # so nothing is evicted for a request that has to wait anyway.
        fits = need <= self.allocator.available_size() + self.cache.evictable_size()
        new = self._alloc(need) if fits else None
        if new is None:
            self._timed(self.cache.unlock, lock)
            return None
        host = 0
        if self.host is not None:
            host = self.host.hit_pages(pages[:prompt_pages].tolist(), prefix)
        hit, host_tokens = self._account_hit(req, prefix, host)
        recompute_s = self.cost.prefill_seconds(hit, req.input_length)
        reload_s = host_tokens * self.cost.reload_seconds_per_token
        prefill_s = recompute_s + reload_s
        self.result.prefill_s += prefill_s
        if not self.sequential:
            self.result.ttfts.append((now - req.timestamp_s, recompute_s, reload_s))
        prefix_values = self.cache.path_device_indices(match.last_device_node)[:prefix]
        return {
            "prefilled": now + prefill_s,
            "finish": now + prefill_s + req.output_length * self.cfg.decode_s_per_token,
            "idx": idx,
            "req": req,
            "pages": pages,
            "protected": prefix,  # tree-owned head of the request's row, in pages
            "inserted": 0,
            "lock": lock,
            "last_node": match.last_device_node,  # where the request's cached path ends
            # The session's incarnation, taken when the scheduler makes the request.
            "generation": self.cache.ensure_session_generation(req.session_id)
            if self.cfg.session_radix and req.session_id is not None else None,
            "values": torch.cat([prefix_values, new]),
        }

    def _checkpoint(self, s: dict, up_to_tokens: int, finished: bool) -> None:
        """Publish the sequence's full pages up to a token count, as SGLang's
        ``checkpoint`` does (duplicates freed, lock moved to the new last node)."""
        if self.future is not None:
            self.future.now = s["idx"]
        aligned = up_to_tokens // self.unit
        protected = s["protected"]
        if aligned <= protected:
            return
        key = RadixKey(array("q", s["pages"][:aligned].tobytes()))
        values = s["values"][:aligned].clone()
        session = s["req"].session_id
        res = self._timed(self.cache.insert, InsertParams(
            key=key, value=values, prev_prefix_len=protected, inserted_len=s["inserted"],
            session_id=session,
        ))
        if self.cfg.cache == "radix":  # the unified tree frees its duplicates itself
            self.allocator.free(values[protected : res.prefix_len])
        prompt_len = s["req"].input_length // self.unit
        if finished and 0 < prompt_len < aligned:
            # SGLang splits the leaf at the prompt boundary (prompt one priority up).
            self._timed(self.cache.insert, InsertParams(
                key=key[:prompt_len], value=values[:prompt_len], prev_prefix_len=prompt_len,
                inserted_len=prompt_len, priority=1, session_id=session,
            ))
        s["inserted"] = max(s["inserted"], aligned)
        s["last_node"] = res.last_device_node
        tree_values = self.cache.path_device_indices(res.last_device_node)
        s["values"][protected : len(tree_values)] = tree_values[protected:]
        s["protected"] = len(tree_values)
        self._timed(self.cache.unlock, s["lock"])
        s["lock"] = self._timed(self.cache.lock, res.last_device_node)
        if self.host is not None:
            # HiCache's default write_through backs up every node an insert creates
            # (write threshold 1), the prompt's at the prefill checkpoint included.
            self.host.write(s["pages"][:aligned].tolist())
            if self.cfg.cache == "radix":
                self._mark_backed_up(res.last_device_node)

    def _finish(self, s: dict) -> None:
        """Publish the whole sequence, free the partial last page, drop the lock."""
        req = s["req"]
        self._checkpoint(s, req.input_length + req.output_length, finished=True)
        if self.cfg.session_radix and req.session_id is not None:
            # As cache_finished_req: the session references the leaf its insert ended on.
            self._timed(self.cache.session_refs.register_session_ref, SimpleNamespace(
                session_id=req.session_id, session=None, session_generation=s["generation"],
            ), s["last_node"])
        self.allocator.free(s["values"][s["protected"] :])
        self._timed(self.cache.unlock, s["lock"])
        self._close_if_last(req)

    def _close_if_last(self, req: Request) -> None:
        """After ``req`` finished: the client closes its session if it was the last
        request of it in ``self.trace`` (``cfg.session_close``), and the scheduler tells
        the tree."""
        if req.session_id is None or self.cfg.session_close == "never":
            return
        trace, ends = self._session_ends
        if trace is not self.trace:  # a caller replaying chunk after chunk sets a new one
            ends = {r.session_id: r for r in self.trace.requests if r.session_id is not None}
            self._session_ends = (self.trace, ends)
        if ends.get(req.session_id) is req:
            self._timed(self.cache.release_radix_session, req.session_id)

    def _mark_backed_up(self, node: Any) -> None:
        """Flag a written-through path as host-backed (legacy tree only)."""
        while node is not None and node is not self.cache.root_node:
            node.backuped = True
            node = node.parent


_REJECTED = object()


def holds_own_output(node: Any) -> bool:
    """Whether ``node`` begins with output pages of its own request (ids from
    :data:`OUTPUT_TOKEN_BASE`), which no later prompt holds."""
    return node.key.token_ids[0] >= OUTPUT_TOKEN_BASE


def _strategy_owner(cache):
    """What holds ``eviction_strategy``: the legacy tree itself, the unified tree's core."""
    return cache if isinstance(cache, RadixCache) else cache.tree_core


def known_policies() -> list[str]:
    """Names of the policies a replay can run: SGLang's registry plus the bound."""
    return [*_EVICTION_POLICY_FACTORIES, OPTIMAL]
