"""A user's own kernel set (``module:ATTR``): one name in every section and summary cell, its provenance, validation
on import with one-line errors, and FP64 judging its captured rows when it runs alone."""
from __future__ import annotations

import hashlib
import re

import pytest

from exactness.analysis import hashes, streams
from exactness.analysis.contract import check as contract
from exactness.analysis.fp64 import section as fp64
from exactness.kernels import KERNEL_SETS, get_set, provenance
from exactness.params import ParamError, check_common
from exactness.profiles import get_profile
from exactness.receipt.cli import section_parameters
from exactness.receipt.overrides import plan_parameters
from exactness.receipt.preflight import PreflightError, check_run
from exactness.receipt.sections import SECTIONS
from exactness.receipt.render import render_header, render_summary
from user_modules import user_module

MODULE = "user_kernels_h9"
SOURCE = '''
import dataclasses
from exactness.kernels import KERNEL_SETS

_inv = KERNEL_SETS["invariant"]


def _wrap(f):
    def wrapped(*a, **k):
        return f(*a, **k)
    return wrapped


def _row0(f):
    def faulty(x, *a, **k):   # a planted fault: in calls of more than one row, row 0 a few ULPs off
        y = f(x, *a, **k)
        if y.shape[0] > 1:
            y = y.clone()
            y[0] = y[0] * (1 + 2 ** -5)
        return y
    return faulty


def _copy(name, cls=None, wrap=_wrap, role="prompt"):
    table = getattr(_inv, role)
    if cls is not None:
        table = {**table, cls: dataclasses.replace(table[cls], fn=wrap(table[cls].fn))}
    return dataclasses.replace(_inv, name=name, description=f"{name}: a copy of invariant",
                               **{role: table})


SET = _copy("mine", "lm_head")
FAULTY = _copy("mine_faulty", "residual", _row0)


def factory():
    return _copy("mine_made")


def raises():
    raise RuntimeError("no device for my kernels")


MISSING = dataclasses.replace(_inv, name="mine_missing", decode={k: v for k, v in _inv.decode.items() if k != "rope"})
BADSIG = _copy("mine_badsig", "rmsnorm", lambda f: (lambda x: x), "decode")
SHORT = _copy("mine_short", "lm_head", lambda f: (lambda x, w: f(x, w)[:, :-1]))   # one logit short, no error
HALF = _copy("mine_half", "rmsnorm", lambda f: (lambda x, w, eps: f(x, w, eps).half()), "decode")
NOT_A_SET = 42
NOT_SPEC = dataclasses.replace(_inv, name="mine_notspec", prompt={**_inv.prompt, "rope": _inv.prompt["rope"].fn})
'''


@pytest.fixture(scope="module", name="user_module")
def user_module_fixture(tmp_path_factory):
    """The module above on sys.path; every set it gave is unregistered afterwards."""
    with user_module(tmp_path_factory.mktemp("userkit"), MODULE, SOURCE) as path:
        yield path


def test_user_set_is_named_labelled_and_its_provenance_recorded(user_module):
    ks = get_set(f"{MODULE}:SET")
    assert ks.name == "mine" and KERNEL_SETS["mine"] is ks
    names = [s.name for s in (*ks.decode.values(), *ks.prompt.values())]
    assert all(n.startswith("mine.") for n in names), names      # dataclasses.replace kept "invariant.*" names
    assert ks.prompt["rmsnorm"].replaces == "mine.rmsnorm.decode"
    rec = provenance(f"{MODULE}:SET")
    assert rec["sha256"] == hashlib.sha256(user_module.read_bytes()).hexdigest()
    assert rec["file"] == str(user_module.resolve()) and rec["module"] == MODULE
    assert rec["kernels_own"] == ["mine.lm_head.prompt"]              # the one wrapped kernel, the rest built in
    assert rec["kernels_builtin"]["mine.dense.decode"] == "invariant.dense.decode"
    assert rec["claims_exact"] is True and rec["description"] == "mine: a copy of invariant"
    made = provenance(f"{MODULE}:factory")
    assert made["name"] == "mine_made" and made["kernels_own"] == []  # an unwrapped copy: nothing of its own
    header = render_header({"status": "ok", "profile": "ci",
                            "env": {"kernel_sets": ["invariant", f"{MODULE}:SET"], "kernel_set_records": [rec]}})
    assert "## Kernel sets" in header and rec["sha256"] in header and "mine.lm_head.prompt" in header
    assert f"| invariant, mine ({MODULE}:SET)" in header.replace("  ", " ")   # the environment row names it


@pytest.mark.parametrize("attr, words", [
    ("raises", r"kernel set reference '\w+:raises': its function raised \(RuntimeError: no device for my kernels\)"),
    ("MISSING", r"kernel set 'mine_missing' \(\w+:MISSING\) has no decode kernel for classes \['rope'\]"),
    ("BADSIG", r"kernel set 'mine_badsig' \(\w+:BADSIG\), class 'rmsnorm', decode kernel fails on tiny inputs .*"
               r"TypeError: .*takes 1 positional argument"),
    ("SHORT", r"kernel set 'mine_short' \(\w+:SHORT\), class 'lm_head', prompt kernel returns \[2, \d+\] float32 on "
              r"tiny inputs .*; the class's kernels return \[2, \d+\] float32$"),
    ("HALF", r"class 'rmsnorm', decode kernel returns \[2[, \d]*\] float16 on tiny .*kernels return "
             r"\[2[, \d]*\] bfloat16$"),
    ("NOT_A_SET", r"gives a int, not a KernelSet"),
    ("NOT_SPEC", r"kernel set 'mine_notspec' \(\w+:NOT_SPEC\), class 'rope', prompt: not a KernelSpec"),
    ("NOPE", r"module '\w+' has no attribute 'NOPE'"),
])
def test_a_bad_set_is_refused_on_import_in_one_line(user_module, attr, words):
    """What a run checks before it starts: the parameters (params.check_common: the set's tables), then the
    preflight (preflight.check_run: every kernel on tiny inputs), as the receipt runner and the command line do."""
    values = {"kernel_sets": [f"{MODULE}:{attr}"], "device": "cpu"}
    with pytest.raises(ValueError) as e:
        check_common(values)
        check_run(values, ["contract"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"parameter kernel_sets: '{MODULE}:{attr}' is not allowed: ")
    assert re.search(words, msg), msg
    good = {"kernel_sets": [f"{MODULE}:SET"], "device": "cpu"}   # the control: a good set passes
    check_common(good)
    check_run(good, ["contract"])


BADSIG_WORDS = (rf"^parameter kernel_sets: '{MODULE}:BADSIG' is not allowed: kernel set 'mine_badsig' "
                rf"\({MODULE}:BADSIG\), class 'rmsnorm', decode kernel fails on tiny inputs [^\n]*TypeError")


def test_a_set_failing_on_tiny_inputs_is_refused_by_the_command_line_before_it_runs(user_module):
    """The parameters only import the set and check its tables; the preflight calls its kernels: the per-section
    command line's (section_parameters, before run_section) and the receipt runner's (plan_parameters, before the
    run folder is made)."""
    check_common({"kernel_sets": [f"{MODULE}:BADSIG"], "device": "cpu"})
    with pytest.raises(PreflightError, match=BADSIG_WORDS):
        section_parameters("ci", [f"kernel_sets=[{MODULE}:BADSIG]", "device=cpu"], [], ["contract"])
    declared = {SECTIONS["contract"].notebook: {"params"}}
    with pytest.raises(PreflightError, match=BADSIG_WORDS):
        plan_parameters(get_profile("ci").parameters(), {"kernel_sets": [f"{MODULE}:BADSIG"]}, declared)
    plan_parameters(get_profile("ci").parameters(), {"kernel_sets": [f"{MODULE}:SET"]}, declared)   # the control


@pytest.mark.parametrize("section", [hashes, contract, streams])
def test_a_set_failing_on_tiny_inputs_is_refused_by_run_section(user_module, section):
    """A section's run_section called directly refuses the set before it computes anything."""
    with pytest.raises(ParamError, match=BADSIG_WORDS):
        section.run_section({**BASE, "kernel_sets": [f"{MODULE}:BADSIG"]})


@pytest.mark.parametrize("sets", [["invariant", "invariant"], [f"{MODULE}:SET", "mine"],
                                  [f"{MODULE}:SET", f"{MODULE}:SET"]])
def test_the_same_set_twice_is_refused(user_module, sets):
    with pytest.raises(ParamError, match=r"^parameter kernel_sets: kernel set '\w+' is given twice .*give each set "
                                         r"once$"):
        check_common({"kernel_sets": sets, "device": "cpu"})


BASE = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=24, steps=[16],
            gen_tokens=3, deep_threshold=8)


def _sections(ref: str) -> dict:
    """The four sections a summary joins, each on the one set ``ref``, small."""
    return {
        "hashes": hashes.run_section({**BASE, "kernel_sets": [ref], "hash_rerun": False, "hash_sweep_tokens": 24}),
        "contract": contract.run_section({**BASE, "kernel_sets": [ref], "contract_sweep": "quick",
                                          "contract_dtypes": ["bfloat16"], "contract_classes": ["residual", "argmax"]}),
        "fp64": fp64.run_section({**BASE, "kernel_sets": [ref], "fp64_tokens": 20, "fp64_rows": 4, "fp64_cert": 2,
                                  "fp64_synthetic": False}),
        "streams": streams.run_section({**BASE, "kernel_sets": [ref], "stream_counts": [2], "drafts": ["self"],
                                        "mtp_k": 1, "stream_prompt_tokens": 12}),
    }


def _summary_row(secs: dict, name: str) -> list[str]:
    text = render_summary({"sections": secs})
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {name} "))
    return [c.strip() for c in row.strip("|").split("|")]


def test_a_copy_of_invariant_alone_is_clean_in_every_section_under_its_name(user_module):
    secs = _sections(f"{MODULE}:SET")
    assert {r["kernels"] for r in secs["hashes"]["rows"]} == {"mine"}
    for name in ("contract", "fp64"):
        assert {r["set"] for r in secs[name]["rows"]} == {"mine"}, name
    st = [r for part in ("drafted", "resumed", "concurrent", "packed") for r in secs["streams"]["data"][part]]
    assert st and {r["set"] for r in st} == {"mine"} and all(r["equal"] for r in st)
    captured = {(r["class"], r["path"]) for r in secs["fp64"]["rows"] if r["input_set"] == "captured"}
    assert captured == {(c, p) for c in fp64.CLASSES for p in ("decode", "batched", "deep")}  # judged, not lost
    assert not [r for r in secs["fp64"]["rows"] if "outside" in str(r["verdict"])]
    row = _summary_row(secs, "mine")
    assert len(row) == 6 and all(re.fullmatch(r"\d+/\d+", c) for c in row[1:]), row      # every column filled
    n = [tuple(map(int, c.split("/"))) for c in row[1:]]
    assert all(a == b for a, b in (n[0], n[1], n[2], n[4])) and n[3][0] == 0, row      # all hold; 0 outside
    packed = len(secs["streams"]["data"]["packed"])
    assert packed and n[4][1] == len(st)                                                # packed == alone counted


def test_a_planted_fault_shows_in_the_summary_under_the_sets_name(user_module):
    """The negative control: the same copy with a prompt residual row perturbed loses equalities in the summary."""
    ref = f"{MODULE}:FAULTY"
    secs = {"hashes": hashes.run_section({**BASE, "kernel_sets": [ref], "hash_rerun": False,
                                          "hash_sweep_tokens": 24}),
            "contract": contract.run_section({**BASE, "kernel_sets": [ref], "contract_sweep": "quick",
                                              "contract_dtypes": ["bfloat16"], "contract_classes": ["residual"]})}
    row = _summary_row(secs, "mine_faulty")
    logits, pairs = (tuple(map(int, c.split("/"))) for c in (row[2], row[3]))
    assert logits[0] < logits[1] and pairs[0] < pairs[1], row
