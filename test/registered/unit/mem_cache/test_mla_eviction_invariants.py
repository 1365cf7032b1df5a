"""Accounting invariants of SGLang's real prefix caches under the mla_aware policy.

A driver plays many simulated requests against a real ``UnifiedRadixCache`` (Python
tree core, FULL component) or legacy ``RadixCache`` over a real CPU allocator
(``TokenToKVPoolAllocator`` or ``PagedTokenToKVPoolAllocator`` with page size 4),
interleaving match, lock, allocate, insert, unlock, free and evict at random. It keeps
its own model of which slots each request holds and, after EVERY operation, checks:

* free + cached in the tree (evictable + protected) + held by requests == pool size;
* no page is freed twice, and nothing the driver does not know as allocated is freed
  (the allocator's free paths are wrapped);
* the device indices on every locked path are unchanged and still allocated;
* ``evict(n)`` frees at least ``min(n, evictable before)`` tokens, and with victims
  trimmed (``mla_victim_trim``; off in the other unified configurations) exactly
  ``min(n rounded up to a page, evictable before)``, or more by less than
  ``MIN_SURPLUS_SHARE`` of the pool;
* every ``_mla_prefix_end`` memo equals the node's real depth, and no node marked closed
  (``mla_sessions``) belongs to a session the policy's book holds open.

Requests carry one of a few session ids (or none) and sessions close at random; two
configurations run SGLang's session radix cache, each insert with a session registering
its leaf with the session as ``cache_finished_req`` does.

The seeded loop runs ``MLA_INVARIANT_OPS`` operations in total (default 100,000) over
the configurations below; a Hypothesis test replays short generated operation lists on
the same driver so a failure shrinks to a minimal sequence. Seed: ``MLA_INVARIANT_SEED``
(printed on every run); Hypothesis also prints its falsifying example.
"""

import json
import os
import random
import sys
import tempfile
import time
import unittest
from array import array
from types import SimpleNamespace
from unittest import mock
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from sglang.srt.mem_cache import mla_leaf_index, mla_sessions, mla_victim_trim
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import (
    GhostLearning,
    MLAAwareStrategy,
    PolicyConfigError,
    create_mla_aware_strategy,
)
from sglang.srt.mem_cache.mla_cost_model import PRESETS, KVCostModel, ModelConfigError
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=90, suite="stage-a-test-cpu")

SEED = int(os.environ.get("MLA_INVARIANT_SEED", random.SystemRandom().randrange(2**32)))
TOTAL_OPS = int(os.environ.get("MLA_INVARIANT_OPS", 100_000))
POOL_TOKENS = 256
POLICY_CONFIG = {"model": "deepseek-v3"}

# (cache kind, page size, policy, host tier, victims trimmed, session radix cache)
CONFIGS = [
    (kind, page, policy, False, False, False)
    for kind in ("unified", "radix")
    for page in (1, 4)
    for policy in ("mla_aware", "lru")
] + [("radix", 1, "mla_aware", True, False, False), ("radix", 4, "mla_aware", True, False, False)] + [
    ("unified", page, policy, False, True, False) for page in (1, 4) for policy in ("mla_aware", "lru")
] + [("unified", page, "mla_aware", False, False, True) for page in (1, 4)]

print(f"[mla invariants] MLA_INVARIANT_SEED={SEED} MLA_INVARIANT_OPS={TOTAL_OPS}", file=sys.stderr)


class InvariantError(AssertionError):
    pass


class CacheDriver:
    """Plays the scheduler around one real cache and checks the accounting after each op.

    A request goes ``match`` (lock the matched node) -> ``alloc`` (the rest of its
    tokens, evicting the shortfall first as SGLang does) -> ``insert`` (publish, unlock)
    or ``free`` (abort: return its slots, unlock). ``pin``/``unpin`` take and drop extra
    locks on cached prefixes.
    """

    def __init__(self, kind, page_size, policy, host_tier=False, trim=False, session_radix=False,
                 pool_tokens=POOL_TOKENS, seed=0):
        self.kind, self.page, self.policy, self.host_tier = kind, page_size, policy, host_tier
        self.trim, self.session_radix = trim, session_radix
        self.size = pool_tokens
        self.rng = random.Random(seed)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(
                pool_tokens, torch.bfloat16, "cpu", kvcache=None, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                pool_tokens, page_size, torch.bfloat16, "cpu", kvcache=None, need_sort=False
            )
        # Page ids run from 1 (page 0 is the padded dummy page).
        self.allocated = np.zeros(pool_tokens // page_size + 1, dtype=bool)
        self._wrap_allocator()
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
            eviction_policy=policy,
            eviction_policy_config=POLICY_CONFIG if policy == "mla_aware" else None,
            tree_core_backend="python",
            enable_session_radix_cache=session_radix,
        )
        if kind == "radix":
            self.cache = RadixCache(params)
            self.strategy = self.cache.eviction_strategy
        else:
            params.tree_components = (ComponentType.FULL,)
            self.cache = UnifiedRadixCache(params)
            self.strategy = self.cache.tree_core.eviction_strategy
            self.strategy.trim_victims = trim
            if mla_victim_trim.trims(self.cache) != trim:
                raise InvariantError(f"trimming not {'on' if trim else 'off'} as asked")
        self.requests = {}  # rid -> dict(tokens, prefix, lock, new, locked_path)
        self.pins = []  # (lock, node, expected path indices)
        self.next_rid = 0
        self.ops = 0
        self.checks = 0

    # ---- allocator instrumentation -------------------------------------------

    def _wrap_allocator(self):
        alloc = self.allocator.alloc
        ps = self.page

        def checked_alloc(need):
            out = alloc(need)
            if out is not None and len(out):
                pages = np.unique(out.numpy() // ps)
                if self.allocated[pages].any():
                    raise InvariantError(f"alloc handed out allocated pages {pages[self.allocated[pages]]}")
                self.allocated[pages] = True
            return out

        def mark_free(pages):
            pages = np.asarray(pages, dtype=np.int64)
            if len(np.unique(pages)) != len(pages):
                raise InvariantError(f"one free() call frees a page twice: {sorted(pages)}")
            bad = pages[~self.allocated[pages]]
            if len(bad):
                raise InvariantError(f"double free (or free of never-allocated) pages {bad.tolist()}")
            self.allocated[pages] = False

        self.allocator.alloc = checked_alloc
        if ps == 1:
            free = self.allocator.free

            def checked_free(idx):
                if idx.numel():
                    mark_free(idx.numpy())
                free(idx)

            self.allocator.free = checked_free
        else:
            release = self.allocator._release_page_ids

            def checked_release(*page_ids):
                mark_free(np.concatenate([p.numpy() for p in page_ids]))
                release(*page_ids)

            self.allocator._release_page_ids = checked_release

    # ---- tree helpers ----------------------------------------------------------

    def _node_obj(self, handle):
        return self.cache.tree_core.node_by_id(handle) if self.kind == "unified" else handle

    def _root(self):
        return self.cache.tree_core.root_node if self.kind == "unified" else self.cache.root_node

    def _nodes(self):
        stack, out = list(self._root().children.values()), []
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _tokens(self):
        """A prompt sharing a random prefix with a few 'documents' (so prefixes collide)."""
        r = self.rng
        doc = r.randrange(4)
        n_shared = r.randrange(0, 12) * self.page
        n_own = r.randrange(1, 10) * self.page
        shared = [doc * 1000 + i for i in range(n_shared)]
        if r.random() < 0.3:  # a branch off the shared text
            shared = shared[: r.randrange(0, n_shared + 1)] + [5000 + r.randrange(3)]
        own = [r.randrange(10_000, 10_050) for _ in range(n_own)]
        tokens = (shared + own)[: (len(shared) + n_own) // self.page * self.page]
        return tokens or own

    # ---- operations ------------------------------------------------------------

    def op_match(self):
        tokens = self._tokens()
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        lock = self.cache.lock(m.last_device_node)
        path = self.cache.path_device_indices(m.last_device_node).clone()
        assert len(path) >= m.device_prefix_len
        rid = self.next_rid
        self.next_rid += 1
        session = self.rng.choice(self.SESSIONS)
        generation = None
        if self.session_radix and session is not None:  # as the scheduler makes a request
            generation = self.cache.ensure_session_generation(session)
        self.requests[rid] = dict(
            tokens=tokens, prefix=m.device_prefix_len, lock=lock, node=m.last_device_node,
            path=path, new=None, session=session, generation=generation,
        )

    def op_alloc(self):
        pending = [r for r, s in self.requests.items() if s["new"] is None]
        if not pending:
            return self.op_match()
        rid = self.rng.choice(pending)
        s = self.requests[rid]
        need = len(s["tokens"]) - s["prefix"]
        out = self.allocator.alloc(need) if need else torch.empty((0,), dtype=torch.int64)
        if out is None:
            shortfall = need - self.allocator.available_size()
            self._evict(shortfall)
            out = self.allocator.alloc(need)
        if out is None:  # cannot fit: the scheduler would requeue it
            self._drop(rid)
            return
        s["new"] = out

    def op_insert(self):
        ready = [r for r, s in self.requests.items() if s["new"] is not None]
        if not ready:
            return self.op_alloc()
        rid = self.rng.choice(ready)
        s = self.requests.pop(rid)
        prefix = s["prefix"]
        values = torch.cat([s["path"][:prefix], s["new"]])
        res = self.cache.insert(InsertParams(
            key=RadixKey(array("q", s["tokens"])), value=values, prev_prefix_len=prefix,
            session_id=s["session"],
        ))
        if self.kind == "radix":  # the unified tree frees its duplicates itself
            self.allocator.free(values[prefix : res.prefix_len])
        if s["generation"] is not None:  # as cache_finished_req: the session keeps the leaf
            self.cache.session_refs.register_session_ref(SimpleNamespace(
                session_id=s["session"], session=None, session_generation=s["generation"],
            ), res.last_device_node)
        self.cache.unlock(s["lock"])
        if self.host_tier:
            self._mark_backed_up()

    def op_free(self):
        if not self.requests:
            return self.op_match()
        self._drop(self.rng.choice(list(self.requests)))

    def _drop(self, rid):
        s = self.requests.pop(rid)
        if s["new"] is not None:
            self.allocator.free(s["new"])
        self.cache.unlock(s["lock"])

    def op_pin(self):
        tokens = self._tokens()
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        if m.device_prefix_len == 0:
            return
        lock = self.cache.lock(m.last_device_node)
        self.pins.append((lock, m.last_device_node, self.cache.path_device_indices(m.last_device_node).clone()))

    def op_unpin(self):
        if self.pins:
            lock, _, _ = self.pins.pop(self.rng.randrange(len(self.pins)))
            self.cache.unlock(lock)

    def op_close(self):
        """A client closes a session (``mla_sessions``: what only it used goes first);
        session ids are reused, as a client may."""
        self.cache.release_radix_session(self.rng.choice(self.SESSIONS[1:]))

    def op_evict(self):
        self._evict(self.rng.choice([1, self.page, 7, 16, 64, 1000]))

    def _evict(self, n):
        before = self.cache.evictable_size()
        got = self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        after = self.cache.evictable_size()
        if got < min(n, before):
            raise InvariantError(f"evict({n}) freed {got} < min({n}, evictable {before})")
        rounded = -(-n // self.page) * self.page
        surplus = mla_victim_trim.MIN_SURPLUS_SHARE * self.size  # what is worth a trim
        if self.trim and got != min(rounded, before) and not rounded < got < rounded + surplus:
            raise InvariantError(f"evict({n}) trimmed freed {got}, evictable before {before}")
        if before - after != got:
            raise InvariantError(f"evict({n}) reports {got} but evictable fell by {before - after}")

    def _mark_backed_up(self):
        """Host tier: random legacy nodes get a host copy (scored by reload cost)."""
        for n in self._nodes():
            if self.rng.random() < 0.3:
                n.backuped = True

    OPS = ("match", "alloc", "insert", "free", "pin", "unpin", "evict", "close")
    WEIGHTS = (6, 6, 6, 1, 1, 1, 2, 1)
    SESSIONS = (None, "s0", "s1", "s2", "s3")  # a request's session (None: it has none)

    def step(self, op):
        getattr(self, "op_" + op)()
        self.ops += 1
        self.check()

    def run(self, n):
        for op in self.rng.choices(self.OPS, self.WEIGHTS, k=n):
            if op == "match" and len(self.requests) >= 6:
                op = "insert"
            if op == "pin" and len(self.pins) >= 3:
                op = "unpin"
            self.step(op)
        self.check(deep=True)

    def close(self):
        for rid in list(self.requests):
            self._drop(rid)
        while self.pins:
            self.op_unpin()
        self.check(deep=True)
        self._evict(self.size)
        self.check(deep=True)
        if self.cache.evictable_size() or self.allocator.available_size() != self.size:
            raise InvariantError("after releasing everything the pool is not whole again")

    # ---- invariants ------------------------------------------------------------

    def check(self, deep=False):
        self.checks += 1
        free = self.allocator.available_size()
        tree = self.cache.evictable_size() + self.cache.protected_size()
        held = sum(len(s["new"]) for s in self.requests.values() if s["new"] is not None)
        if free + tree + held != self.size:
            raise InvariantError(
                f"after op {self.ops}: free {free} + tree {tree} + held {held} != pool {self.size}"
            )
        if free != self.size - int(self.allocated[1:].sum()) * self.page:
            raise InvariantError(f"after op {self.ops}: allocator free {free} disagrees with the model")
        locked = [(s["node"], s["path"]) for s in self.requests.values()]
        locked += [(node, path) for _, node, path in self.pins]
        for node, path in locked:
            try:
                now = self.cache.path_device_indices(node)
            except KeyError:  # the unified tree dropped the node from its arena
                raise InvariantError(f"after op {self.ops}: a locked node was evicted") from None
            if not torch.equal(now, path):
                raise InvariantError(f"after op {self.ops}: a locked path changed")
            if len(path) and not self.allocated[np.unique(path.numpy() // self.page)].all():
                raise InvariantError(f"after op {self.ops}: a locked path's slots were freed")
        if deep or self.ops % 256 == 0:
            self._deep_check(held)

    def _deep_check(self, held):
        nodes = self._nodes()
        in_tree = [self._value(n) for n in nodes]
        in_tree = torch.cat(in_tree) if in_tree else torch.empty((0,), dtype=torch.int64)
        owned = [s["new"] for s in self.requests.values() if s["new"] is not None]
        everything = torch.cat([in_tree, *owned]) if owned else in_tree
        pages = everything.numpy() // self.page
        if len(np.unique(everything.numpy())) != len(everything):
            raise InvariantError(f"after op {self.ops}: a slot is owned twice (tree/requests)")
        expect = np.flatnonzero(self.allocated)
        if not np.array_equal(np.unique(pages), expect):
            raise InvariantError(f"after op {self.ops}: tree + requests != allocated pages")
        if isinstance(self.strategy, MLAAwareStrategy):
            for n in nodes:
                memo = getattr(n, "_mla_prefix_end", None)
                if memo is not None and memo != _depth(n):
                    raise InvariantError(f"after op {self.ops}: stale _mla_prefix_end {memo} != {_depth(n)}")
                if mla_sessions.CLOSED_HITS in n.__dict__:
                    entry = self.strategy.sessions._sessions.get(n.__dict__.get(mla_sessions.SESSION))
                    if entry is not None and not entry.closed:  # (a forgotten one stays closed)
                        raise InvariantError(f"after op {self.ops}: a node closed in an open session")

    def _value(self, node):
        if self.kind == "unified":
            return node.component_data[ComponentType.FULL].value
        return node.value


def _depth(node):
    d = 0
    while node.parent is not None:
        d += len(node.key)
        node = node.parent
    return d


def _name(cfg):
    kind, page, policy, host, trim, session_radix = cfg
    return (f"{kind}/page{page}/{policy}{'/host-tier' if host else ''}{'/trimmed' if trim else ''}"
            f"{'/session-radix' if session_radix else ''}")


class TestRandomInterleavings(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()
        HookRegistry.apply_hooks()  # the trimming hooks, as a server applies them

    def test_100k_seeded_operations(self):
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
                        f"{_name(cfg)} failed; rerun with MLA_INVARIANT_SEED={SEED}: {e}"
                    ) from e
                total += d.ops
        print(
            f"[mla invariants] seed {SEED}: {total} operations over {len(CONFIGS)} "
            f"configurations in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        self.assertGreaterEqual(total, TOTAL_OPS - len(CONFIGS))


_op_lists = st.lists(st.sampled_from(CacheDriver.OPS), min_size=1, max_size=60)


class TestHypothesisInterleavings(CustomTestCase):
    """Generated operation lists, shrunk to a minimal failing one on error."""

    @classmethod
    def setUpClass(cls):
        register()
        HookRegistry.apply_hooks()  # the trimming hooks, as a server applies them

    @hypothesis_seed(SEED)
    @settings(derandomize=False, max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    @given(cfg=st.sampled_from(CONFIGS), ops=_op_lists, rng_seed=st.integers(0, 2**16))
    def test_generated_sequences(self, cfg, ops, rng_seed):
        d = CacheDriver(*cfg, pool_tokens=64, seed=rng_seed)
        for op in ops:
            d.step(op)
        d.close()


class TestIndexedWalkTakesTheSameVictims(CustomTestCase):
    """The leaf index (``mla_leaf_index``) walks the evictable leaves by score class; the
    full heap scores them all. Two drivers play the same operations on the same seed, one
    with ``indexed_eviction`` off: after every operation both trees hold the same nodes
    with the same hit counts, and both learnings the same factor and weight."""

    @classmethod
    def setUpClass(cls):
        register()
        HookRegistry.apply_hooks()

    def test_same_trees_after_every_operation(self):
        ops_per_config = max(TOTAL_OPS // 20, 500)
        for i, (page, trim) in enumerate([(1, False), (4, False), (1, True), (4, True)]):
            with self.subTest(page=page, trim=trim):
                ops = random.Random(SEED + i).choices(CacheDriver.OPS, CacheDriver.WEIGHTS, k=ops_per_config)
                # One driver after the other from the same reading of the tree's clock (a
                # module-level counter that both would advance if run side by side).
                start = unified_clock.read()
                indexed = CacheDriver("unified", page, "mla_aware", trim=trim, seed=SEED + i)
                states = [_state(indexed) for op in ops if indexed.step(op) is None]
                unified_clock.set(start)
                full = CacheDriver("unified", page, "mla_aware", trim=trim, seed=SEED + i)
                full.strategy.indexed_eviction = False
                for n, (op, state) in enumerate(zip(ops, states)):
                    full.step(op)
                    self.assertEqual(state, _state(full), f"seed {SEED}, operation {n} ({op})")
                walks = [
                    d.cache.tree_core.components_by_type[ComponentType.FULL].__dict__[
                        mla_leaf_index._INDEX].walks
                    for d in (indexed, full)
                ]
                self.assertGreater(walks[0], 0)
                self.assertEqual(walks[1], 0)
                self.assertGreater(sum(indexed.strategy.learning.returns), 0)
                self.assertGreater(indexed.strategy.learning.returns_closed, 0)


class unified_clock:
    """The unified tree's clock: a module-level counter stamped on every node touched."""

    @staticmethod
    def read():
        from sglang.srt.mem_cache.unified_cache.components import base

        return base._LAST_ACCESS_TIME_COUNTER_FLOAT

    @staticmethod
    def set(value):
        from sglang.srt.mem_cache.unified_cache.components import base

        base._LAST_ACCESS_TIME_COUNTER_FLOAT = value


def _state(driver):
    """The driver's tree, every node as (its tokens from the root, hit count, last access),
    sorted, with the learnt factor and weight."""
    nodes = []
    for node in driver._nodes():
        path, n = [], node
        while n is not driver._root():
            path[:0] = list(getattr(n.key, "token_ids", n.key))
            n = n.parent
        nodes.append((tuple(path), node.hit_count, node.last_access_time))
    learning = driver.strategy.learning
    return sorted(nodes), learning.factor, learning.weight


class TestSoakHasNoGrowth(CustomTestCase):
    def test_policy_state_stays_within_the_tree(self):
        sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))
        import soak

        # A small pool keeps eviction (which scores every evictable leaf) cheap; a small
        # table of returning victims shows it filled and held at its bound.
        with mock.patch.object(GhostLearning, "MAX_GHOSTS", 512):
            samples = soak.run_soak(requests=20_000, cache="unified", workload="chat",
                                    capacity_tokens=64 * 512, chunk=5_000, sample_every=2_000,
                                    seed=SEED % 1000, progress=False, trace_memory=False)
            self.assertEqual(soak.check(samples), [])
        print(f"[mla soak] {samples[-1]}", file=sys.stderr)
        self.assertEqual(samples[-1]["requests"], 20_000)
        self.assertEqual(max(s["ghosts"] for s in samples), 512)
        for s in samples:
            # Only nodes the policy has scored (or their ancestors) carry a memo.
            self.assertLessEqual(s["memo_nodes"], s["tree_nodes"], s)
            self.assertEqual(s["stray_memos"], 0, s)
            self.assertLessEqual(s["tree_nodes"], s["pool_pages"], s)
        self.assertGreater(samples[-1]["evictions"], 1000)


class TestBadPolicyConfig(CustomTestCase):
    """Each bad --radix-eviction-policy-config raises PolicyConfigError naming the key."""

    CASES = [
        ({"bogus": 1}, "unknown --radix-eviction-policy-config key 'bogus'"),
        ({"hit_exponent": "2"}, "key 'hit_exponent' has bad value '2' (expected an integer or a number)"),
        ({"depth_aware": 1}, "key 'depth_aware' has bad value 1 (expected true or false)"),
        ({"tp_size": True}, "key 'tp_size' has bad value True (expected an integer)"),
        ({"tp_size": 0}, "key 'tp_size' must be > 0, got 0"),
        ({"page_size": -4}, "key 'page_size' must be > 0, got -4"),
        ({"gpu_tflops": -1.0}, "key 'gpu_tflops' must be > 0, got -1.0"),
        ({"h2d_gbps": 0}, "key 'h2d_gbps' must be > 0, got 0"),
        ({"key_unit_tokens": 0}, "key 'key_unit_tokens' must be > 0, got 0"),
        ({"hit_exponent": -0.5}, "key 'hit_exponent' must be >= 0, got -0.5"),
        ({"model": 3}, "key 'model' has bad value 3 (expected a string or an object)"),
        ({"model": "llama-9000"}, "key 'model':"),
    ]

    def test_messages(self):
        for cfg, fragment in self.CASES:
            with self.subTest(cfg=cfg):
                with self.assertRaises(PolicyConfigError) as ctx:
                    create_mla_aware_strategy(**cfg)
                self.assertIn(fragment, str(ctx.exception))


_V3 = dict(PRESETS["deepseek-v3"])
_NO_LATENT = {k: v for k, v in _V3.items() if k != "kv_lora_rank"}
_NO_ARCH = {k: v for k, v in _V3.items() if k != "architectures"}

# (model config, from_config kwargs, message fragment), measured on this tree.
MODEL_CASES = [
    ("llama-9000", {}, "llama-9000: no such config.json, and 'llama-9000' is not a preset (deepseek-r1,"),
    (_NO_LATENT, {}, "model config: missing field 'kv_lora_rank'"),
    (_NO_ARCH, {}, "model config: missing field 'architectures'"),
    (dict(_V3, num_hidden_layers=-1), {}, "field 'num_hidden_layers' must be a non-negative integer, got -1"),
    ({"architectures": ["BertModel"]}, {}, "field 'architectures' = ['BertModel'] names no causal LM"),
    ("deepseek-v3", {"kv_cache_dtype": "int3"}, "kv cache dtype 'int3' unknown; use one of bf16,"),
    # A model whose torch_dtype is no KV dtype: the message names the field.
    (dict(_V3, torch_dtype="float64"), {}, "field 'torch_dtype' = 'float64' is no KV cache dtype"),
]


class TestBadModelConfig(CustomTestCase):
    """KVCostModel.from_config rejects a model it cannot describe, naming what is wrong."""

    def test_messages(self):
        for cfg, kwargs, fragment in MODEL_CASES:
            with self.subTest(cfg=cfg if isinstance(cfg, str) else "<dict>", kwargs=kwargs):
                with self.assertRaises(ModelConfigError) as ctx:
                    KVCostModel.from_config(cfg, **kwargs)
                self.assertIn(fragment, str(ctx.exception))

    def test_setup_values(self):
        with self.assertRaisesRegex(ModelConfigError, "the serving setup: tp_size must be a positive integer, got 0"):
            KVCostModel.from_config("deepseek-v3", tp_size=0)

    def test_config_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(_NO_LATENT))
            broken = Path(tmp) / "broken.json"
            broken.write_text("{not json")
            listed = Path(tmp) / "list.json"
            listed.write_text("[1, 2]")
            cases = [
                (model_dir, f"{model_dir}/config.json: missing field 'kv_lora_rank'"),
                (model_dir / "config.json", f"{model_dir}/config.json: missing field 'kv_lora_rank'"),
                (broken, f"{broken}: not a readable JSON config: Expecting property name"),
                (listed, f"{listed}: top level must be a JSON object"),
                (Path(tmp) / "absent", "no such config.json"),
            ]
            for path, fragment in cases:
                with self.subTest(path=path.name):
                    with self.assertRaises(ModelConfigError) as ctx:
                        KVCostModel.from_config(str(path))
                    self.assertIn(fragment, str(ctx.exception))

    def test_policy_wraps_model_errors(self):
        for cfg, kwargs, fragment in MODEL_CASES:
            policy_cfg = {"model": cfg, **kwargs}
            with self.subTest(cfg=cfg if isinstance(cfg, str) else "<dict>", kwargs=kwargs):
                with self.assertRaises(PolicyConfigError) as ctx:
                    create_mla_aware_strategy(**policy_cfg)
                key = "kv_cache_dtype" if "kv_cache_dtype" in kwargs else "model"
                self.assertIn(f"mla_aware: key '{key}': ", str(ctx.exception))
                if key == "model":
                    self.assertIn(fragment, str(ctx.exception))

    def test_missing_calibration_file(self):
        with self.assertRaisesRegex(
            PolicyConfigError, "mla_aware: key 'calibration': .*cannot read calibration JSON"
        ):
            create_mla_aware_strategy(calibration="/nonexistent/calibration.json")


if __name__ == "__main__":
    unittest.main()
