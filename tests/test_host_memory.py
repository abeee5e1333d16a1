"""Store tensors on transparent huge pages (nestpipe.kernels.memory): the pages really are huge where the mode says
so, contents are zero, small tensors and the switch-off fall back to the torch allocator."""

import mmap

import pytest
import torch

from nestpipe.kernels import memory


def _smaps_field(t: torch.Tensor, field: str) -> str:
    """One field of the mapping holding ``t``'s data (from /proc/self/smaps), "" if absent."""
    addr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line[len(field):].strip()
    return ""


def _anon_huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding ``t``'s data."""
    value = _smaps_field(t, "AnonHugePages:")
    return int(value.split()[0]) if value else 0


def _asks_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s data is madvised MADV_HUGEPAGE (``hg`` among its VmFlags)."""
    return "hg" in _smaps_field(t, "VmFlags:").split()


needs_thp = pytest.mark.skipif(memory.huge_pages_mode() != "madvise",
                               reason=f"huge pages unavailable here: {memory.huge_pages_mode()}")


@needs_thp
def test_large_store_tensors_get_huge_pages_and_read_as_zero():
    t = memory.host_zeros((1 << 20, 16))  # 64 MiB
    assert t.shape == (1 << 20, 16) and t.dtype == torch.float32 and t.is_contiguous()
    assert float(t.abs().sum()) == 0.0  # reads map the zero page; writes allocate
    t.add_(1.0)
    assert _anon_huge_kib(t) >= 32 << 10, "no transparent huge pages behind the store tensor"
    e = memory.host_empty((1 << 20, 16))
    e.fill_(1.0)
    assert _anon_huge_kib(e) >= 32 << 10


@needs_thp
def test_negative_control_a_shared_mapping_gets_no_huge_pages():
    # the mapping a first version used: shared anonymous memory is shmem, which THP skips (shmem_enabled=never)
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        if "[never]" not in f.read():
            pytest.skip("shmem THP enabled here: the control needs shmem_enabled=never")
    buf = mmap.mmap(-1, 64 << 20)
    buf.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.float32)
    t.fill_(1.0)
    assert _anon_huge_kib(t) == 0


def test_small_tensors_and_the_switch_off_use_the_torch_allocator(monkeypatch):
    small = memory.host_zeros((100, 8))
    # the decision, not the pages: with THP "always" the torch allocator's heap may itself sit on huge pages
    assert float(small.abs().sum()) == 0.0 and memory._mapped((100, 8), torch.float32, True) is None
    if memory.huge_pages_mode() == "madvise":  # control: a large one is mapped
        assert memory._mapped((1 << 20, 16), torch.float32, True) is not None
    monkeypatch.setenv(memory.ENV, "0")
    assert memory.huge_pages_mode().startswith("off")
    big = memory.host_zeros((1 << 20, 16))
    assert float(big.abs().sum()) == 0.0
    assert memory.host_empty((4, 4), huge_pages=False).shape == (4, 4)


@needs_thp
def test_row_stores_use_huge_pages_when_resident():
    from nestpipe.trainer.embedding.store import RowStore
    from nestpipe.trainer.embedding.placement import make_placement

    pl = make_placement(0, 140_000, 1)  # 140k x 64 float32 = 34 MiB on the one rank
    eager = RowStore("t", pl, 0, 64, seed=1, init_scale=0.05, eager_rows=200_000)
    lazy = RowStore("t", pl, 0, 64, seed=1, init_scale=0.05, eager_rows=0)
    # whether a mapping asks for huge pages is read right after the store made it: later, a host's DAMON scheme may
    # advise hot regions of any mapping on its own (seen once in a full suite), which says nothing of this code
    lazy_asks = _asks_for_huge_pages(lazy.weight)
    forced = RowStore("t", pl, 0, 64, seed=1, init_scale=0.05, eager_rows=0, huge_pages="always")
    never = RowStore("t", pl, 0, 64, seed=1, init_scale=0.05, eager_rows=200_000, huge_pages="never")
    never_asks = _asks_for_huge_pages(never.weight)
    assert (eager.huge_pages, lazy.huge_pages, forced.huge_pages, never.huge_pages) == (True, False, True, False)
    assert _anon_huge_kib(eager.weight) >= 16 << 10  # written whole at start
    rows = torch.arange(0, 140_000, 8192)  # one row per 2 MiB: 4 KiB pages keep the lazy store small
    lazy.gather(rows)
    forced.gather(rows)
    # the lazy store asks for no huge pages (its mapping is not madvised; what its touched rows sit on is the host's
    # choice: khugepaged or a DAMON scheme may collapse its regions on their own, seen in full suites); the forced
    # one asks and gets them at the first touch
    assert not lazy_asks and not never_asks
    assert _asks_for_huge_pages(forced.weight) and _asks_for_huge_pages(eager.weight)
    assert _anon_huge_kib(forced.weight) >= 16 << 10
    assert torch.equal(lazy.gather(rows)[0], eager.gather(rows)[0])  # same values on any pages
