"""The local writer picks O_DIRECT or the page cache by the throughput each gave, and keeps trying both."""
from __future__ import annotations

import numpy as np

from ckptrepo.storage import _localwrite
from ckptrepo.storage._arrays import ArrayInfo
from ckptrepo.storage._write_mode import PROBE_EVERY, WriteModes


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
