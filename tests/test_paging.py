"""Properties of the page allocator and prefix cache under random operation sequences (hypothesis)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxinfer.engine.paging import OutOfPages, PageAllocator, block_hashes

PAGE = 4


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences allocate, share cached prefixes, register blocks and finish, in any order."""

    def __init__(self):
        super().__init__()
        self.pages = PageAllocator(12)
        self.seqs: list[list[int]] = []           # pages held by each live sequence

    @rule(n=st.integers(1, 6))
    def allocate(self, n):
        try:
            got = self.pages.allocate(n)
        except OutOfPages:
            assert n > self.pages.num_free
            return
        assert len(set(got)) == n and 0 not in got
        held = {p for s in self.seqs for p in s}
        assert not held & set(got), "a page is owned twice"
        self.seqs.append(got)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=PAGE, max_size=4 * PAGE))
    def share_prefix(self, tokens):
        """A new sequence takes the cached pages of its prefix and registers the rest of its blocks."""
        hashes = block_hashes(tokens, PAGE)
        cached = self.pages.lookup(hashes)
        need = len(hashes) - len(cached)
        if need > self.pages.num_free:
            self.pages.release(cached)
            return
        pages = cached + self.pages.allocate(need)
        for page, h in zip(pages, hashes):
            self.pages.register(page, h)
        self.seqs.append(pages)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self.pages.release(self.seqs.pop(i % len(self.seqs)))

    @invariant()
    def consistent(self):
        self.pages.check()
        refs = {}
        for s in self.seqs:
            for p in s:
                refs[p] = refs.get(p, 0) + 1
        for p in range(1, self.pages.num_pages):
            assert self.pages.refcount(p) == refs.get(p, 0)
        assert self.pages.num_in_use == len(refs)

    def teardown(self):
        while self.seqs:
            self.pages.release(self.seqs.pop())
        self.pages.check()
        assert self.pages.num_free == self.pages.capacity, "the pool is not full again"
        assert all(self.pages.refcount(p) == 0 for p in range(self.pages.num_pages))


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_eviction_takes_least_recently_used_unheld_pages():
    pages = PageAllocator(5)                      # 4 usable
    a, b = pages.allocate(2), pages.allocate(2)
    for p, h in zip(a, block_hashes(list(range(8)), PAGE)):
        pages.register(p, h)
    pages.register(b[0], 999)
    pages.release(a)                              # cached, unheld, evictable (a[0] then a[1])
    assert pages.num_free == 2
    got = pages.allocate(1)                       # no free page: evicts a[0], the oldest
    assert got == [a[0]]
    assert pages.lookup(block_hashes(list(range(8)), PAGE)) == []   # chain broken at block 0
    pages.check()


def test_lookup_takes_longest_cached_prefix_and_holds_it():
    pages = PageAllocator(8)
    tokens = list(range(3 * PAGE))
    held = pages.allocate(3)
    for p, h in zip(held, block_hashes(tokens, PAGE)):
        pages.register(p, h)
    other = tokens[:2 * PAGE] + [99] * PAGE
    got = pages.lookup(block_hashes(other, PAGE))
    assert got == held[:2]
    assert [pages.refcount(p) for p in held] == [2, 2, 1]
    assert pages.hit_rate == 2 / 3
