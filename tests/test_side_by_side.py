"""A receipt run's side_by_side setting: untimed sections share the machine, timed ones (the bench) run alone.

The notebooks are replaced by a stand-in for runner._execute that records when each one started and ended, so the
schedule itself is what is checked (no kernels run).
"""
from __future__ import annotations

import threading
import time

from exactness.receipt import runner
from exactness.profiles import get_profile
from exactness.receipt.sections import SECTIONS

NOTEBOOKS = [s.notebook for s in SECTIONS.values() if "reference" in s.runs_on]


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


def test_out_of_memory_side_by_side_runs_again_alone(monkeypatch, tmp_path):
    """A notebook that fails out of device memory beside the others runs again once they are done, alone, and its
    entry says so; a notebook that fails otherwise is not run again (the control); nor is one that ran alone."""
    spans, calls, lock = {}, {}, threading.Lock()
    oom, other = NOTEBOOKS[1], NOTEBOOKS[2]

    def fake_execute(nb, src, tmp, params, kernel_name, position=""):
        t0 = time.perf_counter()
        time.sleep(0.2)
        with lock:
            calls[nb] = calls.get(nb, 0) + 1
            spans.setdefault(nb, []).append((t0, time.perf_counter()))
            first = calls[nb] == 1
        if nb in (oom, other) and (first or nb == other):
            ename, evalue = (("OutOfMemoryError", "CUDA out of memory. Tried to allocate 20.00 MiB")
                             if nb == oom else ("ValueError", "bad value"))
            return {"name": nb, "status": "failed", "error": {"ename": ename, "evalue": evalue}}
        return {"name": nb, "status": "ok"}

    monkeypatch.setattr(runner, "_execute", fake_execute)
    entries = {e["name"]: e for e in runner._execute_all(tmp_path, tmp_path, {nb: {} for nb in NOTEBOOKS}, "k", 4)}
    assert calls[oom] == 2 and entries[oom]["status"] == "ok"
    assert entries[oom]["retried_alone"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"
    again = spans[oom][1]
    assert all(not _overlap(again, span) for nb in NOTEBOOKS if nb != oom for span in spans[nb])
    assert calls[other] == 1 and entries[other]["status"] == "failed" and "retried_alone" not in entries[other]
    calls.clear()
    entries = {e["name"]: e for e in runner._execute_all(tmp_path, tmp_path, {nb: {} for nb in NOTEBOOKS}, "k", 1)}
    assert calls[oom] == 1 and entries[oom]["status"] == "failed"        # in turn: it already ran alone


def test_profiles_side_by_side_is_a_run_setting():
    assert get_profile("gpu").side_by_side > 1 and get_profile("ci").side_by_side == 1
    assert "side_by_side" not in get_profile("gpu").parameters()          # no notebook receives it


def test_receipt_md_says_which_notebook_ran_again_alone():
    """receipt.md's notebook table: the retry note on the retried notebook only; times with one decimal."""
    from exactness.receipt.render import render_header
    nbs = [{"name": "20_kernel_contract", "status": "ok", "seconds": 250.0,
            "retried_alone": "OutOfMemoryError: CUDA out of memory."}, {"name": "40_streams", "status": "ok", "seconds": 57.83}]
    md = render_header({"status": "ok", "profile": "gpu", "notebooks": nbs})
    row = next(line for line in md.splitlines() if "20_kernel_contract" in line)
    assert "ok (run again alone after: OutOfMemoryError: CUDA out of memory.)" in row
    assert "run again" not in next(line for line in md.splitlines() if "40_streams" in line)
    streams = next(line for line in md.splitlines() if "40_streams" in line)
    assert "250.0" in row and "57.8" in streams and "57.83" not in streams
