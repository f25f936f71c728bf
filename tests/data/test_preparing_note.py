"""A run's first preparation of a large corpus says how far it has got, instead of a silent wait."""

from __future__ import annotations

import io

from accelrun.data.documents import PreparingNote


def test_quiet_until_it_takes_a_while_then_a_line_every_interval():
    now = [0.0]
    out = io.StringIO()
    note = PreparingNote(every_s=10, clock=lambda: now[0], out=out)
    note(2**20, 100 * 2**20, 5)
    now[0] = 9.0
    note(2 * 2**20, 100 * 2**20, 9)
    assert out.getvalue() == ""  # a small corpus prepares without a word
    now[0] = 12.5
    note(50 * 2**20, 100 * 2**20, 1234)
    now[0] = 15.0
    note(60 * 2**20, 100 * 2**20, 2000)  # within the interval: no second line yet
    lines = out.getvalue().splitlines()
    assert lines == ["preparing data.paths into the cache (once; later runs map it): 50 of 100 MiB (50%), "
                     "4.0 MiB/s, 1,234 tokens"]
