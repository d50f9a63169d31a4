"""A receipt run's side_by_side setting: untimed sections share the machine, timed ones (the bench) run alone.

The notebooks are replaced by a stand-in for runner._execute that records when each one started and ended, so the
schedule itself is what is checked (no kernels run).
"""
from __future__ import annotations

import threading
import time

from exactness.receipt import runner
from exactness.receipt.profiles import get_profile
from exactness.receipt.sections import SECTIONS

NOTEBOOKS = [s.notebook for s in SECTIONS.values() if s.runs_on == "reference"]


def _schedule(monkeypatch, tmp_path, side_by_side: int) -> tuple[list, dict]:
    spans, lock = {}, threading.Lock()

    def fake_execute(nb, src, tmp, params, kernel_name, position=""):
        t0 = time.perf_counter()
        time.sleep(0.2)
        with lock:
            spans[nb] = (t0, time.perf_counter())
        return {"name": nb, "status": "ok", "position": position}

    monkeypatch.setattr(runner, "_execute", fake_execute)
    entries = runner._execute_all(tmp_path, tmp_path, {nb: {} for nb in NOTEBOOKS}, "k", side_by_side)
    return entries, spans


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_untimed_sections_run_together_and_the_bench_alone(monkeypatch, tmp_path):
    entries, spans = _schedule(monkeypatch, tmp_path, 4)
    assert [e["name"] for e in entries] == NOTEBOOKS                      # table order kept in the receipt
    timed = [nb for nb in NOTEBOOKS if SECTIONS[runner.section_of(nb)].timed]
    shared = [nb for nb in NOTEBOOKS if nb not in timed]
    assert timed == ["50_bench"] and len(shared) == 4
    assert all(_overlap(spans[a], spans[b]) for a in shared for b in shared if a != b)
    assert all(not _overlap(spans[t], spans[o]) for t in timed for o in NOTEBOOKS if o != t)


def test_side_by_side_one_runs_every_section_in_turn(monkeypatch, tmp_path):
    entries, spans = _schedule(monkeypatch, tmp_path, 1)
    assert [e["name"] for e in entries] == NOTEBOOKS
    ends = [spans[nb] for nb in NOTEBOOKS]
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))                # no two at once, table order


def test_profiles_side_by_side_is_a_run_setting():
    assert get_profile("gpu").side_by_side > 1 and get_profile("ci").side_by_side == 1
    assert "side_by_side" not in get_profile("gpu").parameters()          # no notebook receives it
