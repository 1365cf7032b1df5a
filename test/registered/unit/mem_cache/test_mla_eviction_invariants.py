"""Accounting invariants of SGLang's real prefix caches under the mla_aware policy.

A driver plays the scheduler around one real cache, built as a server builds it
(``prepare_params`` puts the cost model in the policy config and installs
``EvictionCallbackFullComponent``): ``UnifiedRadixCache`` on the Python tree core or the
legacy ``RadixCache``, over a real CPU allocator (``TokenToKVPoolAllocator``, or
``PagedTokenToKVPoolAllocator`` with page size 4), with ``mla_aware`` or ``lru`` as the
control. Requests arrive (match, lock the matched node), allocate the rest of their
tokens (evicting the shortfall first through ``evict_to_free_tokens``, SGLang's path),
prefill in chunks (insert the prefix so far, lock the new last node, unlock the previous
one: the scheduler's ``checkpoint``), finish (insert prompt + output, split at the prompt,
free the partial page, unlock) or abort; other holders pin and unpin cached prefixes;
``evict(n)`` runs with random ``n``. After EVERY operation the driver checks:

* free + cached (evictable + protected) + held by requests == pool size, and the
  allocator's free count agrees with the driver's bitmap of allocated pages;
* no page is handed out twice, freed twice or freed while not allocated (the allocator
  subclasses below check every alloc and every release against that bitmap);
* every locked path (requests and pins) still holds the device indices it held;
* every slot is owned exactly once, by the tree or by one request, and together they
  are exactly the allocated pages;
* ``evict(n)`` frees at least ``min(n, evictable before)`` tokens and evictable drops by
  what it reports; an allocation after evicting its shortfall succeeds whenever free +
  evictable covered it (the policy never makes the tree free less than the shortfall);
* SGLang's own tree check: ``UnifiedRadixCache.sanity_check()`` (which calls
  ``UnifiedTreeCore.sanity_check``); the legacy ``RadixCache`` of 0.5.23 has none, so
  :func:`legacy_sanity_check` checks the same properties on what it exposes
  (``total_size()``, ``evictable_leaves``, the sizes, the child-key map);
* the strategy's state stays bounded: its ghosts within ``MAX_GHOSTS`` (patched to 32,
  so the bound is reached), its clock of walks within ``MAX_WALKS`` (patched to 64)
  and, on the unified tree (which reports every victim through ``on_evict``), every
  node it keeps is live in the tree; on the legacy tree (no callback) its table within
  ``MAX_SEEN`` (patched to 64, so it is reached and cleared).

The seeded loop runs ``MLA_INVARIANT_OPS`` operations in total (default 24,000) over the
configurations; a Hypothesis test replays short generated operation lists on the same
driver so a failure shrinks. Seed: ``MLA_INVARIANT_SEED`` (printed on every run).
"""

import os
import random
import sys
import time
import unittest
from array import array
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.srt.mem_cache.mla_eviction_plugin import (
    EvictionCallbackFullComponent,
    prepare_params,
    register,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

SEED = int(os.environ.get("MLA_INVARIANT_SEED", random.SystemRandom().randrange(2**32)))
TOTAL_OPS = int(os.environ.get("MLA_INVARIANT_OPS", 24_000))
POOL_TOKENS = 256
GHOST_CAP = 32  # MAX_GHOSTS on the drivers' strategies, so the bound is reached
SEEN_CAP = 64  # MAX_SEEN on the legacy tree's strategies (no on_evict there)
WALK_CAP = 64  # MAX_WALKS on the drivers' strategies, so the clock is trimmed
CONFIGS = [
    (kind, page, policy)
    for kind in ("unified", "radix")
    for page in (1, 4)
    for policy in ("mla_aware", "lru")
]
FULL = ComponentType.FULL
REPO = Path(__file__).resolve().parents[4]
print(
    f"[mla invariants] MLA_INVARIANT_SEED={SEED} MLA_INVARIANT_OPS={TOTAL_OPS}",
    file=sys.stderr,
)


def setUpModule():
    register()  # mla_aware in SGLang's policy registry, as the entry point does


class InvariantError(AssertionError):
    pass


class PageBook:
    """Which pages are allocated, by page id (page 0 is the allocator's padding)."""

    def __init__(self, pages: int, page_size: int):
        self.page_size = page_size
        self.allocated = np.zeros(pages + 1, dtype=bool)

    def take(self, indices: torch.Tensor) -> None:
        pages = np.unique(indices.numpy() // self.page_size)
        if self.allocated[pages].any():
            raise InvariantError(f"alloc handed out allocated pages {pages.tolist()}")
        self.allocated[pages] = True

    def release(self, pages: np.ndarray) -> None:
        if len(np.unique(pages)) != len(pages):
            raise InvariantError(f"one release frees a page twice: {sorted(pages)}")
        stale = pages[~self.allocated[pages]]
        if len(stale):
            raise InvariantError(f"double free or free of unallocated {stale.tolist()}")
        self.allocated[pages] = False

    def free_tokens(self) -> int:
        return (len(self.allocated) - 1 - int(self.allocated.sum())) * self.page_size


class CheckedTokenAllocator(TokenToKVPoolAllocator):
    """SGLang's page-1 allocator; every alloc and free is checked against a book
    (``free_segment``, ``free_page_ids`` and a free group's flush all end in ``free``)."""

    def __init__(self, size: int):
        super().__init__(size, torch.bfloat16, "cpu", kvcache=None, need_sort=False)
        self.book = PageBook(size, 1)

    def alloc(self, need_size: int):
        out = super().alloc(need_size)
        if out is not None:
            self.book.take(out)
        return out

    def free(self, free_index: torch.Tensor):
        if self.free_group is None and free_index.numel():
            self.book.release(free_index.numpy())
        super().free(free_index)


class CheckedPagedAllocator(PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator; every release path ends in ``_release_page_ids``."""

    def __init__(self, size: int, page_size: int):
        super().__init__(
            size, page_size, torch.bfloat16, "cpu", kvcache=None, need_sort=False
        )
        self.book = PageBook(size // page_size, page_size)

    def alloc(self, need_size: int):
        out = super().alloc(need_size)
        if out is not None:
            self.book.take(out)
        return out

    def _release_page_ids(self, *page_ids: torch.Tensor):
        self.book.release(torch.cat(page_ids).numpy())
        super()._release_page_ids(*page_ids)


def build_cache(kind: str, page: int, policy: str, allocator):
    """The cache a server builds: for mla_aware, through the plugin's
    ``prepare_params`` (cost model in the config, the callback component)."""
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page,
        eviction_policy=policy,
    )
    if policy == "mla_aware":
        prepare_params(params, KVCostModel.from_preset("deepseek-v3", page_size=page))
    if kind == "radix":
        return RadixCache(params)
    params.tree_components = (FULL,)  # as create_unified_radix_cache sets them
    if policy != "mla_aware":
        params.tree_core_backend = "python"  # the control runs on the same core
    return UnifiedRadixCache(params)


def legacy_sanity_check(cache: RadixCache) -> None:
    """SGLang 0.5.23's ``RadixCache`` has no sanity check: the properties the unified
    tree's ``sanity_check`` verifies, on what the legacy tree exposes."""
    errors, page = [], cache.page_size
    evictable = protected = 0
    leaves, stack = set(), list(cache.root_node.children.items())
    if cache.root_node.lock_ref != 1 or cache.root_node.parent is not None:
        errors.append(f"root lock_ref {cache.root_node.lock_ref} or has a parent")
    while stack:
        child_key, node = stack.pop()
        stack.extend(node.children.items())
        if child_key != node.key.child_key(page):  # as _print_helper asserts
            errors.append(f"node {node.id} under key {child_key!r}")
        if node.parent.children.get(child_key) is not node:
            errors.append(f"node {node.id} not its parent's child")
        if len(node.key) % page or len(node.value) != len(node.key):
            errors.append(
                f"node {node.id}: key {len(node.key)}, value {len(node.value)}"
            )
        if node.lock_ref < 0 or (
            node.parent is not cache.root_node and node.parent.lock_ref < node.lock_ref
        ):
            errors.append(f"node {node.id} lock_ref {node.lock_ref} above its parent's")
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                leaves.add(node)
    sizes = (cache.evictable_size(), cache.protected_size(), cache.total_size())
    if sizes != (evictable, protected, evictable + protected):
        errors.append(f"sizes {sizes} != recomputed {evictable}, {protected}")
    if cache.evictable_leaves != leaves:
        errors.append(
            f"evictable_leaves {len(cache.evictable_leaves)} != {len(leaves)}"
        )
    if errors:
        raise InvariantError("legacy tree: " + "; ".join(errors))


class Request:
    """One request's view: its tokens, its lock, its KV row."""

    __slots__ = ("tokens", "prompt", "node", "lock", "row", "protected")
    __slots__ += ("inserted", "allocated")

    def __init__(self, tokens, prompt, node, lock, head):
        self.tokens, self.prompt, self.node, self.lock = tokens, prompt, node, lock
        self.row = head  # the KV row: tree-owned [0, protected), then its own slots
        self.protected = len(head)
        self.inserted = 0  # cache_inserted_len
        self.allocated = False


class CacheDriver:
    """Plays the scheduler around one real cache and checks it after every operation."""

    OPS = ("arrive", "alloc", "chunk", "finish", "abort", "pin", "unpin", "evict")
    WEIGHTS = (5, 5, 4, 4, 1, 1, 1, 2)

    def __init__(self, kind, page, policy, pool_tokens=POOL_TOKENS, seed=0):
        self.kind, self.page, self.policy, self.size = kind, page, policy, pool_tokens
        self.rng = random.Random(seed)
        if page == 1:
            self.allocator = CheckedTokenAllocator(pool_tokens)
        else:
            self.allocator = CheckedPagedAllocator(pool_tokens, page)
        self.book = self.allocator.book
        self.cache = build_cache(kind, page, policy, self.allocator)
        if kind == "unified":
            core = self.cache.tree_core
            self.strategy = core.eviction_strategy
            if policy == "mla_aware":  # what a server gets: the Python core, callback
                assert self.cache._tree_core_backend == "python"
                assert isinstance(
                    core.components_by_type[FULL], EvictionCallbackFullComponent
                )
        else:
            self.strategy = self.cache.eviction_strategy
        self.learns = isinstance(self.strategy, MLAAwareStrategy)
        if self.learns:
            assert self.strategy.cost_model.page_size == page
            self.strategy.MAX_GHOSTS = GHOST_CAP
            self.strategy.MAX_WALKS = WALK_CAP
            if kind == "radix":
                self.strategy.MAX_SEEN = SEEN_CAP
        self.requests: dict[int, Request] = {}
        self.pins = []  # (lock, node, its path when pinned)
        self.next_rid = self.ops = self.evictions = self.chunks = 0
        self.max_ghosts = self.max_seen = self.max_stamps = 0

    # ---- the scheduler's side -----------------------------------------------------

    def _tokens(self):
        """A prompt sharing a prefix with one of a few documents, and an output."""
        r = self.rng
        doc = r.randrange(4)
        shared = [doc * 1000 + i for i in range(r.randrange(0, 12) * self.page)]
        if r.random() < 0.3:  # a branch off the shared text
            shared = shared[: r.randrange(0, len(shared) + 1)] + [5000 + r.randrange(3)]
        prompt = shared + [
            r.randrange(10_000, 10_050) for _ in range(r.randrange(1, 24))
        ]
        output = [r.randrange(20_000, 20_050) for _ in range(r.randrange(0, 6))]
        return prompt + output, len(prompt)

    def _key(self, tokens):
        return RadixKey(array("q", tokens))

    def op_arrive(self):
        tokens, prompt = self._tokens()
        m = self.cache.match_prefix(MatchPrefixParams(key=self._key(tokens[:prompt])))
        head = self.cache.path_device_indices(m.last_device_node)
        if len(head) != m.device_prefix_len or m.device_prefix_len % self.page:
            raise InvariantError(f"match of {m.device_prefix_len} has path {len(head)}")
        lock = self.cache.lock(m.last_device_node)
        self.requests[self.next_rid] = Request(
            tokens, prompt, m.last_device_node, lock, head.clone()
        )
        self.next_rid += 1

    def op_alloc(self):
        waiting = [r for r, q in self.requests.items() if not q.allocated]
        if not waiting:
            return self.op_arrive()
        rid = self.rng.choice(waiting)
        req = self.requests[rid]
        need = -(-len(req.tokens) // self.page) * self.page - req.protected
        free, evictable = self.allocator.available_size(), self.cache.evictable_size()
        if need > free:  # SGLang's path: evict_for_alloc(the shortfall)
            self.allocator.evict_to_free_tokens(self.cache, need)
            self._check_eviction(need - free, free, evictable)
        out = self.allocator.alloc(need)
        if out is None:
            if need <= free + evictable:
                raise InvariantError(
                    f"alloc({need}) failed after evicting the shortfall although "
                    f"free {free} + evictable {evictable} covered it"
                )
            self._release(rid)  # the scheduler would keep it waiting
            return
        req.row, req.allocated = torch.cat([req.row, out]), True

    def op_chunk(self):
        """Chunked prefill: publish the prompt up to the next chunk boundary."""
        running = [
            q for q in self.requests.values() if q.allocated and q.protected < q.prompt
        ]
        if not running:
            return self.op_alloc()
        req = self.rng.choice(running)
        up_to = min(req.protected + self.rng.randrange(1, 4) * self.page, req.prompt)
        self.checkpoint(req, up_to)
        self.chunks += 1

    def checkpoint(self, req: Request, up_to: int, finished: bool = False) -> None:
        """As ``RadixCache.checkpoint`` / ``UnifiedRadixCache.checkpoint_into_tree``:
        insert ``[0, up_to)`` page-aligned, free what the tree already held (the legacy
        tree's caller does; the unified tree frees its duplicates itself), re-read the
        path, then hand the lock from the old last node to the new one."""
        aligned = up_to // self.page * self.page
        if aligned == 0:
            return
        key, values = self._key(req.tokens[:aligned]), req.row[:aligned].clone()
        res = self.cache.insert(
            InsertParams(
                key=key,
                value=values,
                prev_prefix_len=req.protected,
                inserted_len=req.inserted,
            )
        )
        req.inserted = max(req.inserted, aligned)
        prompt = req.prompt // self.page * self.page
        if finished and 0 < prompt < aligned:  # split at the prompt, one priority up
            self.cache.insert(
                InsertParams(
                    key=key[:prompt],
                    value=values[:prompt],
                    prev_prefix_len=prompt,
                    inserted_len=prompt,
                    priority=1,
                )
            )
        if self.kind == "radix":
            dup = req.row[req.protected : res.prefix_len]
            self.allocator.free_segment(dup, start_pos=req.protected)
            node = self.cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
        else:
            node = res.last_device_node
        path = self.cache.path_device_indices(node)
        if len(path) != aligned or res.prefix_len > aligned:
            raise InvariantError(f"insert of {aligned}: path {len(path)}, {res}")
        req.row[req.protected : aligned] = path[req.protected :]
        self.cache.unlock(req.lock)
        req.lock, req.node, req.protected = self.cache.lock(node), node, aligned

    def op_finish(self):
        running = [r for r, q in self.requests.items() if q.allocated]
        if not running:
            return self.op_alloc()
        rid = self.rng.choice(running)
        self.checkpoint(self.requests[rid], len(self.requests[rid].tokens), True)
        self._release(rid)

    def op_abort(self):
        if not self.requests:
            return self.op_arrive()
        self._release(self.rng.choice(list(self.requests)))

    def _release(self, rid):
        """Free the request's own slots (the partial page too) and unlock."""
        req = self.requests.pop(rid)
        self.allocator.free(req.row[req.protected :])
        self.cache.unlock(req.lock)

    def op_pin(self):
        tokens, prompt = self._tokens()
        m = self.cache.match_prefix(MatchPrefixParams(key=self._key(tokens[:prompt])))
        if m.device_prefix_len:
            path = self.cache.path_device_indices(m.last_device_node).clone()
            lock = self.cache.lock(m.last_device_node)
            self.pins.append((lock, m.last_device_node, path))

    def op_unpin(self):
        if self.pins:
            self.cache.unlock(self.pins.pop(self.rng.randrange(len(self.pins)))[0])

    def op_evict(self):
        n = self.rng.choice([1, self.page, 7, 16, 64, 1000])
        free, evictable = self.allocator.available_size(), self.cache.evictable_size()
        got = self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        if evictable - self.cache.evictable_size() != got:
            raise InvariantError(f"evict({n}) reported {got}, evictable fell otherwise")
        self._check_eviction(n, free, evictable)

    def _check_eviction(self, n, free, evictable):
        freed = self.allocator.available_size() - free
        if freed < min(n, evictable):
            raise InvariantError(
                f"evicting {n} freed {freed} < min({n}, evictable {evictable})"
            )
        self.evictions += freed > 0

    def step(self, op: str) -> None:
        if op == "arrive" and len(self.requests) >= 6:
            op = "finish"
        if op == "pin" and len(self.pins) >= 3:
            op = "unpin"
        getattr(self, "op_" + op)()
        self.ops += 1
        self.check()

    def run(self, n: int) -> None:
        for op in self.rng.choices(self.OPS, self.WEIGHTS, k=n):
            self.step(op)

    def close(self) -> None:
        """Every request finishes, every pin goes; then the whole tree is evictable
        and evicting the pool returns the pool whole."""
        for rid in list(self.requests):
            if self.requests[rid].allocated:
                self.checkpoint(
                    self.requests[rid], len(self.requests[rid].tokens), True
                )
            self._release(rid)
        while self.pins:
            self.op_unpin()
        self.check()
        if self.cache.protected_size():
            raise InvariantError(f"protected {self.cache.protected_size()} when idle")
        free, evictable = self.allocator.available_size(), self.cache.evictable_size()
        self.cache.evict(EvictParams(num_tokens=self.size))
        self._check_eviction(self.size, free, evictable)
        self.check()
        if self.allocator.available_size() != self.size:
            raise InvariantError(f"pool not whole: {self.allocator.available_size()}")

    # ---- the checks -----------------------------------------------------------------

    def check(self) -> None:
        for req in self.requests.values():
            self._check_locked(req.node, req.row[: req.protected])
        for _, node, path in self.pins:
            self._check_locked(node, path)
        free = self.allocator.available_size()
        tree = self.cache.evictable_size() + self.cache.protected_size()
        held = sum(len(q.row) - q.protected for q in self.requests.values())
        if free + tree + held != self.size:
            raise InvariantError(
                f"op {self.ops}: free {free} + tree {tree} + held {held} != {self.size}"
            )
        if free != self.book.free_tokens():
            raise InvariantError(f"op {self.ops}: allocator free {free} != the book's")
        if self.kind == "unified":
            self.cache.sanity_check()
        else:
            legacy_sanity_check(self.cache)
        self._check_owners()
        if self.learns:
            self._check_policy_state()

    def _check_locked(self, node, path):
        try:
            now = self.cache.path_device_indices(node)
        except KeyError:  # the unified tree dropped the node from its arena
            raise InvariantError(f"op {self.ops}: a locked node was evicted") from None
        if not torch.equal(now, path):
            raise InvariantError(f"op {self.ops}: a locked path changed")
        while self.kind == "radix" and node is not self.cache.root_node:
            # An evicted legacy node keeps its value and parent: is it still a child?
            child_key = node.key.child_key(self.page)
            if node.parent is None or node.parent.children.get(child_key) is not node:
                raise InvariantError(f"op {self.ops}: a locked node was evicted")
            node = node.parent

    def nodes(self):
        root = self.cache.tree_core.root_node if self.kind == "unified" else None
        stack = list((root or self.cache.root_node).children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _value(self, node):
        if self.kind == "unified":
            return node.component_data[FULL].value
        return node.value

    def _check_owners(self):
        owned = [self._value(n) for n in self.nodes()]
        owned += [q.row[q.protected :] for q in self.requests.values()]
        slots = torch.cat(owned).numpy() if owned else np.zeros(0, dtype=np.int64)
        if len(np.unique(slots)) != len(slots):
            raise InvariantError(f"op {self.ops}: a slot is owned twice")
        pages = np.unique(slots // self.page)
        if not np.array_equal(pages, np.flatnonzero(self.book.allocated)):
            raise InvariantError(f"op {self.ops}: tree + requests != allocated pages")

    def _check_policy_state(self):
        s = self.strategy
        self.max_ghosts = max(self.max_ghosts, len(s._ghosts))
        self.max_seen = max(self.max_seen, len(s._seen))
        self.max_stamps = max(self.max_stamps, len(s._stamps))
        if len(s._ghosts) > GHOST_CAP:
            raise InvariantError(f"{len(s._ghosts)} ghosts > {GHOST_CAP}")
        if len(s._stamps) > WALK_CAP:
            raise InvariantError(f"{len(s._stamps)} walk stamps > {WALK_CAP}")
        if self.kind == "radix":
            if len(s._seen) > SEEN_CAP:
                raise InvariantError(f"{len(s._seen)} seen > {SEEN_CAP}")
            return
        live = {n.id for n in self.nodes()}
        if not set(s._seen) <= live:
            raise InvariantError(f"state kept for dead nodes {set(s._seen) - live}")
        root = self.cache.tree_core.root_node.id
        if not set(s._children) <= live | {root}:
            raise InvariantError(f"children counted for dead {set(s._children) - live}")


def _name(cfg):
    return "{}/page{}/{}".format(*cfg)


class TestRandomInterleavings(CustomTestCase):
    def test_seeded_operations(self):
        per_config = max(TOTAL_OPS // len(CONFIGS), 1)
        total, t0 = 0, time.perf_counter()
        for i, cfg in enumerate(CONFIGS):
            with self.subTest(config=_name(cfg)):
                d = CacheDriver(*cfg, seed=SEED + i)
                try:
                    d.run(per_config)
                    d.close()
                except Exception as e:
                    raise AssertionError(
                        f"{_name(cfg)}: rerun with MLA_INVARIANT_SEED={SEED}: {e}"
                    ) from e
                total += d.ops
                # The run exercised what it checks.
                self.assertGreater(d.evictions, per_config // 50, _name(cfg))
                self.assertGreater(d.chunks, per_config // 50, _name(cfg))
                if d.learns and per_config >= 1000:  # the bounds were reached
                    unified = cfg[0] == "unified"
                    self.assertEqual(d.max_ghosts, GHOST_CAP if unified else 0)
                    self.assertEqual(d.max_stamps, WALK_CAP, _name(cfg))
                    if not unified:
                        self.assertEqual(d.max_seen, SEEN_CAP, _name(cfg))
        print(
            f"[mla invariants] seed {SEED}: {total} operations over {len(CONFIGS)} "
            f"configurations in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        self.assertEqual(total, per_config * len(CONFIGS))


class TestHypothesisInterleavings(CustomTestCase):
    """Generated operation lists, shrunk to a minimal failing one on error."""

    @hypothesis_seed(SEED)
    @settings(
        max_examples=int(os.environ.get("MLA_INVARIANT_EXAMPLES", 100)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    @given(
        cfg=st.sampled_from(CONFIGS),
        ops=st.lists(st.sampled_from(CacheDriver.OPS), min_size=1, max_size=40),
        rng_seed=st.integers(0, 2**16),
    )
    def test_generated_sequences(self, cfg, ops, rng_seed):
        d = CacheDriver(*cfg, pool_tokens=64, seed=rng_seed)
        for op in ops:
            d.step(op)
        d.close()


def _lock_refs(driver, node):
    """The lock count of each node on the path from ``node`` up to the root."""
    if driver.kind == "unified":
        node = driver.cache.tree_core.node_by_id(node)
        refs = []
        while node.parent is not None:
            refs.append(node.component_data[FULL].lock_ref)
            node = node.parent
        return refs
    refs = []
    while node is not driver.cache.root_node:
        refs.append(node.lock_ref)
        node = node.parent
    return refs


class TestChunkedPrefillHandover(CustomTestCase):
    """A request publishes its prompt in chunks, as the scheduler's chunked prefill
    does: after each chunk exactly its path is locked, once; no eviction touches it;
    the previous chunk's lock is gone; at the end nothing is locked."""

    def test_each_chunk_moves_the_lock(self):
        for kind in ("unified", "radix"):
            for page in (1, 4):
                with self.subTest(kind=kind, page=page):
                    self._run(kind, page)

    def _run(self, kind, page):
        d = CacheDriver(kind, page, "mla_aware", seed=SEED)
        prompt = list(range(100, 100 + 6 * page))  # six pages, then a partial one
        tokens = prompt + [7] * (page + 1)
        d.requests[0] = req = Request(tokens, len(prompt), None, None, torch.empty(0))
        m = d.cache.match_prefix(MatchPrefixParams(key=d._key(prompt)))
        req.node, req.lock = m.last_device_node, d.cache.lock(m.last_device_node)
        req.row, req.protected = torch.empty(0, dtype=torch.int64), 0
        need = -(-len(tokens) // page) * page
        req.row, req.allocated = d.allocator.alloc(need), True
        for pages in (2, 4, 6):
            d.checkpoint(req, pages * page)
            d.check()
            self.assertEqual(req.protected, pages * page)
            self.assertEqual(d.cache.protected_size(), pages * page)
            self.assertEqual(set(_lock_refs(d, req.node)), {1})
            self.assertEqual(
                d.cache.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted, 0
            )
            d.check()  # the locked path is intact
        d.checkpoint(req, len(tokens), finished=True)
        d._release(0)
        d.check()
        self.assertEqual(d.cache.protected_size(), 0)
        # Prompt and output are cached, split at the prompt; the partial page freed.
        aligned = len(tokens) // page * page
        self.assertEqual(d.cache.evictable_size(), aligned)
        self.assertEqual(d.allocator.available_size(), POOL_TOKENS - aligned)
        d.close()


def _snapshot(driver):
    """The tree's content (every node as its tokens from the root and its hit count)
    and what the strategy learnt: equal snapshots mean equal eviction histories."""
    nodes = []
    for node in driver.nodes():
        path, n = [], node
        while n.parent is not None:
            path[:0] = list(n.key.token_ids)
            n = n.parent
        nodes.append((tuple(path), node.hit_count))
    s = driver.strategy
    return sorted(nodes), getattr(s, "factor", None), getattr(s, "weight", None)


class TestTwoCachesInOneProcess(CustomTestCase):
    """Two unified caches with their own strategies, operations interleaved: each
    must evict as it does alone. (The legacy tree stamps nodes with the wall clock,
    time.monotonic(), so no run of it is repeatable, alone or not.)"""

    OPS = 800

    def _history(self, policy, seed, ops, other=None, swap_clock=False):
        """Snapshots of a driver after each of ``ops``, with ``other`` (a (driver,
        ops) pair) stepped between its operations. ``swap_clock`` gives each cache
        its own copy of SGLang's process-wide access-time counter."""
        from sglang.srt.mem_cache.unified_cache.components import base

        start = base._LAST_ACCESS_TIME_COUNTER_FLOAT
        clocks = [start, start]
        d = CacheDriver("unified", 1, policy, seed=seed)
        history = []
        for i, op in enumerate(ops):
            if other is not None:
                if swap_clock:
                    clocks[0] = base._LAST_ACCESS_TIME_COUNTER_FLOAT
                    base._LAST_ACCESS_TIME_COUNTER_FLOAT = clocks[1]
                other[0].step(other[1][i])
                if swap_clock:
                    clocks[1] = base._LAST_ACCESS_TIME_COUNTER_FLOAT
                    base._LAST_ACCESS_TIME_COUNTER_FLOAT = clocks[0]
            d.step(op)
            history.append(_snapshot(d))
        return d, history

    def _ops(self, seed):
        rng = random.Random(seed)
        return rng.choices(CacheDriver.OPS, CacheDriver.WEIGHTS, k=self.OPS)

    def _interleaved(self, policy_a, policy_b, swap_clock=False, seed=SEED):
        ops_a, ops_b = self._ops(seed), self._ops(seed + 1)
        _, alone = self._history(policy_a, seed, ops_a)
        b = CacheDriver("unified", 1, policy_b, seed=seed + 1)
        a, mixed = self._history(policy_a, seed, ops_a, (b, ops_b), swap_clock)
        first = next((i for i, (x, y) in enumerate(zip(alone, mixed)) if x != y), None)
        self.assertGreater(a.evictions, self.OPS // 20)  # the order was exercised
        return a, b, first

    def test_state_is_separate(self):
        a, b, _ = self._interleaved("mla_aware", "mla_aware")
        self.assertIsNot(a.strategy, b.strategy)
        for name, value in vars(MLAAwareStrategy).items():  # no shared mutable state
            self.assertNotIsInstance(value, (dict, list, set), name)
        for d in (a, b):
            s = d.strategy
            self.assertIs(s._root, d.cache.tree_core.root_node)
            live = {n.id for n in d.nodes()}
            self.assertLessEqual(set(s._seen), live)
            self.assertGreater(len(s._ghosts), 0)
        for attr in ("_seen", "_children", "_ghosts", "_densities", "_steps"):
            self.assertIsNot(getattr(a.strategy, attr), getattr(b.strategy, attr))

    def test_lru_order_is_unchanged_by_another_cache(self):
        """The control: LRU orders by stamps alone, so another cache moving the
        shared counter between them changes nothing."""
        self.assertIsNone(self._interleaved("lru", "mla_aware")[2])

    def test_mla_aware_order_is_unchanged_by_another_cache(self):
        """SGLang 0.5.23's unified tree stamps ``last_access_time`` from one
        process-wide counter (``unified_cache/components/base.py``), which another
        cache's operations move; mla_aware counts a leaf's age in its own tree's
        eviction walks, so its order does not change. (Before 18a3246 it took the
        difference of stamps, and this failed on every seed tried.) The assertion
        names the first operation after which the histories differ."""
        first = self._interleaved("mla_aware", "mla_aware")[2]
        self.assertIsNone(first, "first operation after which the orders differ")

    def test_with_a_counter_each_nothing_couples_them(self):
        """With each cache given its own copy of SGLang's counter, the interleaved
        run equals the run alone, operation by operation (the control that found the
        counter to be the coupling)."""
        self.assertIsNone(self._interleaved("mla_aware", "mla_aware", True)[2])


class TestHiCacheOnCPU(CustomTestCase):
    """UnifiedRadixCache's HiCache cannot run on CPU in SGLang 0.5.23. The server's
    path (``create_tree_cache`` -> our backend -> ``create_unified_radix_cache`` ->
    ``UnifiedRadixCache.init_hicache``) builds ``MLATokenToKVPoolHost`` with pinned
    memory: ``pool_host.common.alloc_with_host_register`` calls ``_cuda_host_register``,
    i.e. ``torch.cuda.cudart()``. With that call skipped the cache builds, and the
    first write-through backup fails in ``MLATokenToKVPoolHost.
    backup_from_device_all_layer``: the ``sgl_kernel.kvcacheio`` copy kernels are
    imported only on CUDA/HIP/XPU (and the error path then calls ``synchronize`` on a
    ``torch.cpu.Stream``, which has none). If this test fails, HiCache runs here: add it to
    the driver's configurations."""

    def tearDown(self):
        from sglang.srt.runtime_context import reset_context

        reset_context()

    @unittest.skipIf(torch.cuda.is_available(), "CUDA present: not the CPU case")
    def test_what_needs_cuda(self):
        from sglang.srt.mem_cache.pool_host import common

        with self.assertRaisesRegex(AssertionError, "Torch not compiled with CUDA"):
            self._build()
        with mock.patch.object(common, "_cuda_host_register"):
            cache, allocator = self._build()
        self.assertIsNotNone(cache.cache_controller)
        self.assertIsInstance(cache.tree_core.eviction_strategy, MLAAwareStrategy)
        key = RadixKey(array("q", [1, 2, 3, 4]))
        cache.insert(InsertParams(key=key, value=allocator.alloc(4)))
        # The NameError, then torch.cpu.Stream lacking synchronize() on its way out.
        with self.assertRaises(AttributeError) as ctx:
            cache.check_hicache_events()
        self.assertIn(
            "'Stream' object has no attribute 'synchronize'", str(ctx.exception)
        )
        cause = ctx.exception.__context__
        self.assertIsInstance(cause, NameError)
        self.assertIn("'transfer_kv_all_layer_mla_lf_pf' is not defined", str(cause))

    def _build(self):
        from types import SimpleNamespace

        from transformers import PretrainedConfig

        from sglang.srt.mem_cache import registry
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.mla_cost_model import PRESETS
        from sglang.srt.runtime_context import get_parallel, publish, reset_context
        from sglang.srt.server_args import ServerArgs

        reset_context()
        server_args = ServerArgs(
            model_path="dummy",
            device="cpu",
            enable_hierarchical_cache=True,
            radix_eviction_policy="mla_aware",
            radix_cache_backend="mla_aware",
        )
        publish(server_args, role="scheduler")
        with get_parallel().override(
            attn_dcp_size=1, dcp_enabled=False, attn_dcp_rank=0
        ):
            kv = MLATokenToKVPool(
                size=64,
                page_size=1,
                dtype=torch.bfloat16,
                kv_lora_rank=8,
                qk_rope_head_dim=4,
                layer_num=1,
                device="cpu",
                enable_memory_saver=False,
            )
            allocator = TokenToKVPoolAllocator(
                64, torch.bfloat16, "cpu", kv, need_sort=False
            )
            params = CacheInitParams(
                disable=False,
                req_to_token_pool=ReqToTokenPool(
                    size=4, max_context_len=128, device="cpu", enable_memory_saver=False
                ),
                token_to_kv_pool_allocator=allocator,
                page_size=1,
                eviction_policy="mla_aware",
            )
            ctx = registry.TreeCacheBuildContext(
                server_args=server_args,
                params=params,
                is_hybrid_swa=False,
                is_hybrid_ssm=False,
                enable_hierarchical_cache=True,
                disable_radix_cache=False,
                tp_worker=SimpleNamespace(
                    register_hicache_layer_transfer_counter=lambda counter: None
                ),
                model_config=SimpleNamespace(
                    hf_config=PretrainedConfig(**PRESETS["deepseek-v3"])
                ),
                tp_size=1,
                tp_rank=0,
                tp_group=None,
            )
            return registry.create_tree_cache(ctx), allocator


class TestTheChecksCatchFaults(CustomTestCase):
    """Each check can fail: a fault injected into the driver's play is caught within
    a few hundred operations, on both trees."""

    def _caught(self, kind, inject, ops=400):
        d = CacheDriver(kind, 4, "mla_aware", seed=SEED)
        inject(d)
        with self.assertRaises(AssertionError) as ctx:  # InvariantError or SGLang's
            d.run(ops)
            d.close()
        return str(ctx.exception)

    def test_faults(self):
        def double_free(d):  # a finished or aborted request frees its slots twice
            release = d._release

            def faulty(rid):
                req = d.requests[rid]
                release(rid)
                d.allocator.free(req.row[req.protected :])

            d._release = faulty

        def leaked_lock(d):  # the handover forgets to unlock the old node
            d.cache.unlock = lambda lock: None

        def short_eviction(d):  # the tree frees half of what is asked
            evict = d.cache.evict
            d.cache.evict = lambda p: evict(EvictParams(num_tokens=p.num_tokens // 2))

        def lost_lock(d):  # a request's lock dropped behind the scheduler's back
            step = d.step

            def faulty(op):
                step(op)
                for req in d.requests.values():
                    if req.protected and req.lock is not None:
                        d.cache.unlock(req.lock)
                        req.lock = None
                        break

            d.step = faulty

        faults = {
            "double free": (double_free, "double free or free of unallocated"),
            "leaked lock": (leaked_lock, "protected"),
            "short eviction": (short_eviction, "freed"),
            "lost lock": (lost_lock, "locked"),
        }
        for kind in ("unified", "radix"):
            for name, (inject, words) in faults.items():
                with self.subTest(kind=kind, fault=name):
                    self.assertIn(words, self._caught(kind, inject))

    def test_sglang_tree_checks(self):
        """A lock count changed under the tree: SGLang's sanity check (unified) and
        the legacy check both see the sizes no longer add up."""
        for kind in ("unified", "radix"):
            with self.subTest(kind=kind):
                d = CacheDriver(kind, 1, "lru", seed=SEED)
                while not any(d.nodes()):
                    d.step("finish")
                node = next(iter(d.nodes()))
                if kind == "unified":
                    node.component_data[FULL].lock_ref += 1
                else:
                    node.lock_ref += 1
                with self.assertRaisesRegex(AssertionError, "(?i)size|leaves"):
                    d.check()


class TestBadInputTable(CustomTestCase):
    """Every row of docs/reliability.md's bad-input table, run: each bad input is
    rejected as its row says, naming what is at fault, and the doc holds the table
    verbatim (``tools/reliability/bad_inputs.py`` prints it)."""

    def test_rows_and_doc(self):
        sys.path.insert(0, str(REPO / "tools" / "reliability"))
        import bad_inputs

        rows = bad_inputs.collect()
        self.assertEqual(bad_inputs.problems(rows), [])
        surfaces = {case.surface for case, _, _ in rows}
        self.assertEqual(len(surfaces), 7, surfaces)
        shown = [(case.surface, case.shown) for case, _, _ in rows]
        self.assertEqual(len(shown), len(set(shown)))
        self.assertEqual(
            bad_inputs.documented(),
            bad_inputs.markdown(rows),
            "docs/reliability.md is out of date: .venv/bin/python "
            "tools/reliability/bad_inputs.py prints the table",
        )


if __name__ == "__main__":
    unittest.main()
