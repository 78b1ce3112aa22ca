"""PagedKVCache: page accounting, growth, free/reuse, fork with copy-on-write, atomic
CacheFullError, and step tensors; end to end with append_kv + paged_decode vs the oracle."""

import contextlib
import random

import pytest
import torch

from pagedattn import paged_decode
from pagedattn.launch.append_kv import append_kv
from pagedattn.reference import paged_decode_reference
from pagedattn.serving.cache import CacheFullError, PagedKVCache
from pagedattn.testing import rel_l2_error, tolerance_for


def small_cache(num_pages=8, page_size=4, **kw):
    return PagedKVCache(2, 2, 16, num_pages=num_pages, page_size=page_size, **kw)


def check_invariants(cache: PagedKVCache):
    """Every page is free xor referenced, refcounts equal the references, tables fit lengths."""
    refs = [0] * cache.num_pages
    for sid in cache.seq_ids:
        table = cache.block_table(sid)
        assert len(table) == -(-cache.seq_len(sid) // cache.page_size)
        for p in table:
            refs[p] += 1
    free = set(cache._free)
    assert len(free) == len(cache._free)
    for p in range(cache.num_pages):
        assert cache.refcount(p) == refs[p]
        assert (p in free) == (refs[p] == 0)


def test_append_grows_pages_and_slots_are_contiguous_per_page():
    c = small_cache()
    c.add_sequence("a")
    slots = c.append("a", 6)
    table = c.block_table("a")
    assert len(table) == 2 and c.seq_len("a") == 6
    assert slots == [table[t // 4] * 4 + t % 4 for t in range(6)]
    assert c.append("a", 2) == [table[1] * 4 + 2, table[1] * 4 + 3]
    assert len(c.block_table("a")) == 2  # exactly full: no new page yet
    c.append("a", 1)
    assert len(c.block_table("a")) == 3
    check_invariants(c)


def test_free_returns_pages_and_they_are_reused():
    c = small_cache(num_pages=4)
    c.add_sequence(1)
    c.append(1, 16)
    assert c.num_free_pages == 0
    used = set(c.block_table(1))
    c.free(1)
    assert c.num_free_pages == 4
    c.add_sequence(2)
    c.append(2, 9)
    assert set(c.block_table(2)) <= used
    check_invariants(c)
    with pytest.raises(KeyError, match="1"):
        c.free(1)


def test_cache_full_is_atomic_and_names_the_sequence():
    c = small_cache(num_pages=5)
    for s in ("a", "b"):
        c.add_sequence(s)
    c.append("a", 8)  # 2 pages
    c.append("b", 7)  # 2 pages; 1 free
    before = ({s: c.block_table(s) for s in c.seq_ids}, {s: c.seq_len(s) for s in c.seq_ids},
              c.num_free_pages)
    with pytest.raises(CacheFullError, match="'b'") as e:
        c.reserve(["a", "b"], [1, 6])  # a needs 1 page, b needs 2: 3 > 1
    assert e.value.pages_needed == 3 and e.value.pages_free == 1 and e.value.seq_id == "b"
    assert isinstance(e.value, RuntimeError)
    after = ({s: c.block_table(s) for s in c.seq_ids}, {s: c.seq_len(s) for s in c.seq_ids},
             c.num_free_pages)
    assert after == before
    check_invariants(c)
    c.reserve(["a", "b"], [1, 1])  # still usable: a takes the last page, b fills its own
    check_invariants(c)


def test_reserve_rejects_bad_requests():
    c = small_cache()
    c.add_sequence(0)
    with pytest.raises(ValueError, match="seq_ids"):
        c.reserve([0, 0], [1, 1])
    with pytest.raises(ValueError, match="num_tokens"):
        c.reserve([0], [-1])
    with pytest.raises(KeyError, match="7"):
        c.reserve([7], [1])
    with pytest.raises(ValueError, match="already exists"):
        c.add_sequence(0)


def test_fork_shares_full_pages_and_copies_the_partial_page_on_write():
    c = small_cache(num_pages=10)
    c.add_sequence("p")
    c.append("p", 6)  # page 0 full, page 1 half
    c.kv.copy_(torch.randn(c.kv.shape))
    c.fork("p", "c")
    pt, ct = c.block_table("p"), c.block_table("c")
    assert pt == ct and all(c.refcount(p) == 2 for p in pt)
    shared_partial = c.kv[:, :, pt[1]].clone()
    c.append("c", 1)  # child writes into the shared partial page -> private copy
    ct2 = c.block_table("c")
    assert ct2[0] == pt[0] and ct2[1] != pt[1]
    assert c.refcount(pt[0]) == 2 and c.refcount(pt[1]) == 1 and c.refcount(ct2[1]) == 1
    assert torch.equal(c.kv[:, :, ct2[1]], shared_partial)  # every layer, K and V copied
    c.append("p", 1)  # the parent now owns its page alone: no copy
    assert c.block_table("p") == pt
    check_invariants(c)
    c.free("p")
    assert c.refcount(pt[0]) == 1
    check_invariants(c)
    c.free("c")
    assert c.num_free_pages == 10


def test_fork_at_a_page_boundary_needs_no_copy():
    c = small_cache()
    c.add_sequence(0)
    c.append(0, 8)
    c.fork(0, 1)
    assert c.pages_needed(1, 1) == 1
    c.append(1, 1)
    assert c.block_table(1)[:2] == c.block_table(0)
    check_invariants(c)


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    c = small_cache(num_pages=12, page_size=3)
    next_id = 0
    for _ in range(400):
        op = rng.random()
        ids = c.seq_ids
        if op < 0.2 or not ids:
            c.add_sequence(next_id)
            next_id += 1
        elif op < 0.35:
            c.free(rng.choice(ids))
        elif op < 0.45:
            c.fork(rng.choice(ids), next_id)
            next_id += 1
        else:
            batch = rng.sample(ids, rng.randint(1, len(ids)))
            with contextlib.suppress(CacheFullError):  # full is fine: nothing may change
                c.reserve(batch, [rng.randint(0, 4) for _ in batch])
        check_invariants(c)


def test_build_metadata_tensors():
    c = small_cache()
    for s in (0, 1):
        c.add_sequence(s)
    c.append(0, 5)
    meta = c.prepare_step([1, 0], [3, 1])
    assert meta.slot_mapping.dtype == torch.int32
    assert meta.context_lens.tolist() == [3, 6]
    assert meta.positions.tolist() == [0, 1, 2, 5]
    assert meta.query_start == [0, 3, 4]
    t1, t0 = c.block_table(1), c.block_table(0)
    assert meta.block_tables.tolist() == [t1 + [0], t0]
    assert meta.slot_mapping.tolist() == [t1[0] * 4, t1[0] * 4 + 1, t1[0] * 4 + 2, t0[1] * 4 + 1]
    wide = c.build_metadata([0], [[]], max_pages=5)
    assert wide.block_tables.shape == (1, 5)
    with pytest.raises(ValueError, match="max_pages"):
        c.build_metadata([0], [[]], max_pages=1)
    sm = c.slot_mapping([1], [2])
    assert sm.tolist() == [t1[0] * 4 + 3, c.block_table(1)[1] * 4]


def test_build_metadata_into_a_reused_staging_buffer():
    """A dirty staging buffer (the last step's values, here garbage) gives the same metadata
    as a fresh host buffer, padding rows and zeroed table tails included; a buffer of the
    wrong size or dtype is refused by name."""
    c = small_cache()
    for s in (0, 1):
        c.add_sequence(s)
    c.append(0, 9)
    c.append(1, 2)
    size = c.metadata_size(4, 4)
    new = c.reserve([0, 1], [1, 1])  # a decode step: one token each
    fresh = c.build_metadata([0, 1], new, max_pages=4, pad_to=4,
                             out=torch.full((size,), -5, dtype=torch.int32))
    staging = torch.full((size,), 77, dtype=torch.int32)
    out = torch.full((size,), -5, dtype=torch.int32)
    reused = c.build_metadata([0, 1], new, max_pages=4, pad_to=4, out=out,
                              staging=staging)
    for a, b in zip(fresh[:4], reused[:4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out, staging)
    for bad in (torch.zeros(size - 1, dtype=torch.int32), torch.zeros(size)):
        with pytest.raises(ValueError, match="staging"):
            c.build_metadata([0, 1], new, max_pages=4, pad_to=4, out=out, staging=bad)


def test_fp8_cache_scales():
    c = small_cache(dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=torch.tensor([1.0, 2.0]))
    assert c.k_scale.shape == () and c.v_scale.shape == (2,)
    with pytest.raises(ValueError, match="k_scale"):
        small_cache(k_scale=0.5)
    with pytest.raises(ValueError, match="v_scale"):
        small_cache(dtype=torch.float8_e4m3fn, v_scale=torch.ones(3))


def _dense_oracle(q, seqs, history, cache_dtype, k_scale, v_scale):
    """The oracle on an independent dense layout built from each sequence's own K/V history
    (one page per sequence), so a wrong page, slot or copy-on-write shows up."""
    lens = [len(history[s]) for s in seqs]
    width = max(lens)
    heads, dim = history[seqs[0]][0][0].shape
    kd = torch.zeros(len(seqs), width, heads, dim)
    vd = torch.zeros_like(kd)
    for b, s in enumerate(seqs):
        for t, (k, v) in enumerate(history[s]):
            kd[b, t], vd[b, t] = k, v
    if cache_dtype != torch.float32:
        fmax = torch.finfo(cache_dtype).max
        kd = (kd / k_scale).clamp(-fmax, fmax).to(cache_dtype)
        vd = (vd / v_scale).clamp(-fmax, fmax).to(cache_dtype)
    tables = torch.arange(len(seqs), dtype=torch.int32)[:, None]
    return paged_decode_reference(q.cpu(), kd, vd, tables, torch.tensor(lens),
                                  k_scale=k_scale, v_scale=v_scale).out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_cache_with_append_kv_and_paged_decode_matches_the_oracle(device, cache_dtype):
    """Ragged sequences grown step by step, one forked mid-page (copy-on-write), one freed and
    its pages reused: decode over the cache equals the float64 oracle on each sequence's own
    history (dequantized for fp8)."""
    g = torch.Generator().manual_seed(0)
    heads, dim, group = 2, 32, 3
    fp8 = cache_dtype != torch.float32
    ks, vs = (0.25, 0.5) if fp8 else (None, None)
    c = PagedKVCache(1, heads, dim, num_pages=12, page_size=4, dtype=cache_dtype, device=device,
                     k_scale=ks, v_scale=vs)
    c.kv.fill_(float("nan"))  # unused slots are poison
    history: dict = {}

    def step(seqs, counts):
        meta = c.prepare_step(seqs, counts)
        kv = torch.randn(2, sum(counts), heads, dim, generator=g)
        append_kv(kv[0].to(device), kv[1].to(device), c.key_cache(0), c.value_cache(0),
                  meta.slot_mapping, k_scale=c.k_scale, v_scale=c.v_scale)
        i = 0
        for s, n in zip(seqs, counts, strict=True):
            history.setdefault(s, [])
            history[s] += [(kv[0, j], kv[1, j]) for j in range(i, i + n)]
            i += n
        return meta

    for s in ("a", "b", "z"):
        c.add_sequence(s)
    step(["a", "b", "z"], [5, 9, 6])
    c.fork("a", "a2")
    history["a2"] = list(history["a"])
    c.free("z")  # its pages go back and get reused below
    del history["z"]
    for _ in range(4):
        seqs = ["a", "b", "a2"]
        meta = step(seqs, [1, 1, 1])
        q = torch.randn(3, heads * group, dim, generator=g).to(device)
        out = paged_decode(q, c.key_cache(0), c.value_cache(0), meta.block_tables,
                           meta.context_lens, k_scale=c.k_scale, v_scale=c.v_scale)
        ref = _dense_oracle(q, seqs, history, cache_dtype, ks or 1.0, vs or 1.0)
        assert rel_l2_error(out, ref) <= tolerance_for(cache_dtype)
    assert c.block_table("a")[0] == c.block_table("a2")[0]  # the full page is still shared
    assert c.block_table("a")[1] != c.block_table("a2")[1]  # the partial one was copied
    check_invariants(c)


def test_a_forked_pair_appending_together_copies_the_shared_page_once():
    """Parent and child share a partial page: appending to both in one step copies it once
    (the first writer copies, the second then holds the original alone). Counting a copy for
    each raised CacheFullError with one page free, where two separate appends succeeded."""
    c = PagedKVCache(1, 1, 16, num_pages=2, page_size=4, dtype=torch.float32)
    c.add_sequence("p")
    c.append("p", 2)
    c.fork("p", "c")
    assert c.num_free_pages == 1
    slots = c.reserve(["p", "c"], [1, 1])
    assert c.num_free_pages == 0 and [len(s) for s in slots] == [1, 1]
    assert c.block_table("p") != c.block_table("c")  # each now writes its own page
    assert all(c.refcount(p) == 1 for p in c.block_table("p") + c.block_table("c"))


def test_three_sequences_sharing_a_page_need_two_copies():
    c = PagedKVCache(1, 1, 16, num_pages=3, page_size=4, dtype=torch.float32)
    c.add_sequence("a")
    c.append("a", 1)
    c.fork("a", "b")
    c.fork("a", "c")
    with pytest.raises(CacheFullError):  # two copies and a second page for "c": 3 > 2 free
        c.reserve(["a", "b", "c"], [1, 1, 5])
    assert c.num_free_pages == 2 and c.seq_len("a") == 1  # nothing changed
    c.reserve(["a", "b", "c"], [1, 1, 1])
    assert c.num_free_pages == 0


@pytest.mark.parametrize("count", [1.5, float("nan"), "1", True])
def test_reserve_checks_every_count_before_changing_anything(count):
    """A non-int count raised TypeError from inside the append after a page was taken and
    the length set to 1.5 (or NaN): the cache promises errors leave it as it was."""
    c = PagedKVCache(1, 1, 16, num_pages=4, page_size=4, dtype=torch.float32)
    c.add_sequence("a")
    c.add_sequence("b")
    with pytest.raises(TypeError, match="num_tokens: expected ints"):
        c.reserve(["a", "b"], [1, count])
    assert c.seq_len("a") == 0 and c.seq_len("b") == 0 and c.num_free_pages == 4


@pytest.mark.parametrize("kw", [dict(max_pages=1), dict(pad_to=0), dict(out=torch.zeros(3)),
                                dict(staging=torch.zeros(3, dtype=torch.int32))])
def test_prepare_step_checks_its_metadata_arguments_before_reserving(kw):
    """prepare_step reserved the tokens, then build_metadata refused the arguments: the
    sequence kept 9 tokens and its pages after the error."""
    c = PagedKVCache(1, 1, 16, num_pages=4, page_size=4, dtype=torch.float32)
    c.add_sequence("a")
    with pytest.raises(ValueError, match=f"^{next(iter(kw))}: expected|^max_pages: "):
        c.prepare_step(["a"], [9], **kw)
    assert c.seq_len("a") == 0 and c.num_free_pages == 4
    meta = c.prepare_step(["a"], [9], max_pages=3, pad_to=2)  # the sizes it checks are right
    assert meta.block_tables.shape == (2, 3) and c.seq_len("a") == 9


@pytest.mark.parametrize("kw, exc", [(dict(num_pages=True), ValueError),
                                     (dict(dtype=torch.int8), TypeError)])
def test_cache_refuses_bool_sizes_and_integer_dtypes(kw, exc):
    args = dict(num_pages=4, page_size=4, dtype=torch.float32) | kw
    with pytest.raises(exc, match=f"^{next(iter(kw))}: expected"):
        PagedKVCache(1, 1, 16, **args)


def test_cpu_metadata_does_not_alias_the_staging_buffer():
    """On a CPU cache ``host.to(cpu)`` is the staging buffer itself, so the next step's
    ``prepare_step(..., staging=st)`` rewrote the previous step's slot mapping."""
    c = PagedKVCache(1, 1, 16, num_pages=4, page_size=4, dtype=torch.float32)
    c.add_sequence("a")
    c.prepare_step(["a"], [2])
    st = torch.zeros(PagedKVCache.metadata_size(1, 2), dtype=c.index_dtype)
    m1 = c.prepare_step(["a"], [1], max_pages=2, staging=st)
    before = m1.slot_mapping.clone()
    c.prepare_step(["a"], [1], max_pages=2, staging=st)
    assert torch.equal(m1.slot_mapping, before) and int(before[0]) == 2
