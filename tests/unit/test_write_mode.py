"""The local writer picks O_DIRECT or the page cache by the throughput each gave, and keeps trying both."""
from __future__ import annotations

import numpy as np

from ckptrepo.storage import _localwrite
from ckptrepo.storage._arrays import ArrayInfo
from ckptrepo.storage._write_mode import PAGE_CACHE_MARGIN, PROBE_EVERY, WriteModes


def test_each_mode_is_tried_then_the_faster_kept_and_the_slower_probed():
    modes = WriteModes()
    assert modes.pick() is True              # O_DIRECT first
    modes.record(True, 100 << 20, 1.0)       # 100 MiB/s
    assert modes.pick() is False             # then the page cache, once
    modes.record(False, 300 << 20, 1.0)      # 300 MiB/s
    picks = [modes.pick() for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 2 and picks.count(False) == 2 * PROBE_EVERY - 2
    for _ in range(4):                       # O_DIRECT grows faster: it takes over
        modes.record(True, 900 << 20, 1.0)
    assert [modes.pick() for _ in range(PROBE_EVERY)].count(True) == PROBE_EVERY - 1


def test_o_direct_is_kept_unless_the_page_cache_is_clearly_faster():
    modes = WriteModes()
    assert modes.pick() is True
    modes.record(True, 100 << 20, 1.0)
    assert modes.pick() is False
    modes.record(False, int(0.9 * PAGE_CACHE_MARGIN * (100 << 20)), 1.0)   # faster, but not by the margin
    assert modes.preferred() is True
    picks = [modes.pick() for _ in range(2 * PROBE_EVERY)]
    assert picks.count(False) == 2 and picks.count(True) == 2 * PROBE_EVERY - 2
    for _ in range(4):   # the page cache pulls well ahead (a virtual disk that merges writeback): it is used
        modes.record(False, 4 * (100 << 20), 1.0)
    assert modes.preferred() is False
    assert [modes.pick() for _ in range(PROBE_EVERY)].count(False) == PROBE_EVERY - 1


def test_an_untried_mode_is_tried_by_one_object_at_a_time():
    modes = WriteModes()
    assert [modes.pick() for _ in range(4)] == [True] * 4   # a writer's threads start together: all O_DIRECT
    modes.record(True, 100 << 20, 1.0)
    # one object tries the page cache; the others, picked while it is in flight, keep to O_DIRECT
    assert [modes.pick() for _ in range(4)] == [False, True, True, True]
    modes.abandon(False)   # that trial failed: the next object tries again
    assert [modes.pick() for _ in range(3)] == [False, True, True]
    modes.record(False, 50 << 20, 1.0)
    assert modes.preferred() is True


def test_the_writer_follows_the_faster_mode(tmp_path, monkeypatch):
    seen = []
    real = _localwrite.write_object

    def spy(path, total, write, make_dir=None, direct_io=False):
        seen.append(direct_io)
        return real(path, total, write, make_dir or (lambda d: None), direct_io=direct_io)
    monkeypatch.setattr(_localwrite, "write_object", spy)
    writer = _localwrite.DirectWriter(str(tmp_path))
    if not writer.direct_io:
        return   # no O_DIRECT here: every object goes through the page cache anyway
    writer.modes.record(True, 1 << 20, 1.0)
    writer.modes.record(False, 1 << 30, 1.0)
    info = ArrayInfo("data/v/0/float32", "float32", 1 << 14, 1 << 14, 1 << 12)
    (tmp_path / "data/v/0/float32/c").mkdir(parents=True)
    data = np.arange(1 << 14, dtype="<f4")
    bounce = _localwrite._bounce_buffer()
    crcs = writer.write_shard(info, 0, data, bounce)
    assert seen == [False] and len(crcs) == 4
    assert (tmp_path / "data/v/0/float32/c/0").stat().st_size > data.nbytes


def test_rates_are_the_devices_not_one_objects():
    modes = WriteModes()
    flights = [modes.begin() for _ in range(4)]   # four O_DIRECT objects share the device...
    assert [f.over() for f in flights] == [2.5] * 4   # ...each, on average over its start and its end (4 to 1)
    assert flights[0].over() == 2.5   # once
    modes.record(True, 100 << 20, 1.0, sharing=4.0)     # each got 100 MiB/s of a device that wrote 400
    modes.record(False, 300 << 20, 1.0, sharing=1.0)    # the page cache's trial ran alone at 300
    assert modes.preferred() is True
